"""The rank side of a save: cut, name and compress the state, ship only new chunks in packs.

Runs in the rank process on the rank's own CPU time (the agent only stores what it is
given). The state is cut by FastCDC in the calling thread (the cut releases the GIL);
naming and compression run on a thread pool (blake3 and zstd release the GIL too), so
with N cores the stages overlap. With the previous generation's manifest (whose chunks
the agent holds and pins during the save), a pre-pass hashes the state at the old cut
points: unchanged chunks are only referenced, and only the changed regions are cut,
named and compressed again. New chunks go into packs of about ``pack_bytes`` that a
sender thread hands to ``sink`` while the next pack is being filled, so the agent's
disk writes overlap the rank's computation.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from raps_slurm.checkpoint.codec import Chunker, CodecParams, Encoder, as_bytes, hasher
from raps_slurm.checkpoint.manifest import Item, Manifest, whole_digest
from raps_slurm.checkpoint.pack import PackWriter

Sink = Callable[[PackWriter], None]


@dataclass(frozen=True)
class SaveStats:
    """What one save did."""

    total_bytes: int
    chunks: int
    new_chunks: int
    new_raw_bytes: int
    new_stored_bytes: int
    packs: int
    seconds: float


def state_items(state: object) -> list[tuple[str, object]]:
    """(name, buffer) pairs: one unnamed item, or one per key of a dict (keys are strings)."""
    if isinstance(state, Mapping):
        out = []
        for name, value in state.items():
            if not isinstance(name, str):
                raise TypeError(f"checkpoint dict keys must be strings, got {name!r}")
            out.append((name, value))
        return out
    return [("", state)]


def describe(name: str, obj: object, nbytes: int, chunks: int) -> Item:
    """The manifest item for one buffer (numpy arrays keep dtype and shape)."""
    dtype = getattr(obj, "dtype", None)
    shape = getattr(obj, "shape", None)
    if dtype is not None and shape is not None and type(obj).__module__ == "numpy":
        return Item(name, "ndarray", nbytes, chunks, str(getattr(dtype, "str", dtype)),
                    tuple(int(s) for s in shape))
    return Item(name, "bytes", nbytes, chunks)


class _Sender:
    """Hands full packs to the sink on its own thread; the first failure is re-raised."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._q: queue.Queue[PackWriter | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self.packs = 0
        self._t = threading.Thread(target=self._run, name="raps-pack-sender", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (pack := self._q.get()) is not None:
            try:
                if self._error is None:
                    self._sink(pack)
                    self.packs += 1
            except BaseException as exc:  # re-raised in the saving thread
                self._error = exc
            finally:
                pack.close()

    def put(self, pack: PackWriter) -> None:
        self.check()
        self._q.put(pack)

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        self._q.put(None)
        self._t.join()
        self.check()


def _segments(view: memoryview, prev: list[tuple[int, int, str]] | None,
              digest_of: Callable[[object], bytes], pool: ThreadPoolExecutor
              ) -> list[tuple[int, int, str | None]]:
    """The pre-pass: (offset, length, digest or None) covering ``view``. A previous chunk
    whose bytes still hash to its name is reused as is (digest given); each run of
    changed chunks becomes one region (digest None) that is cut anew."""
    if prev is None:
        return [(0, len(view), None)]
    same = list(pool.map(lambda c: digest_of(view[c[0]:c[0] + c[1]]).hex() == c[2], prev))
    out: list[tuple[int, int, str | None]] = []
    for (off, length, digest), ok in zip(prev, same, strict=True):
        if ok:
            out.append((off, length, digest))
        elif out and out[-1][2] is None:
            first = out[-1][0]
            out[-1] = (first, off + length - first, None)
        else:
            out.append((off, length, None))
    return out


def _previous_chunks(previous: Manifest | None
                     ) -> dict[str, tuple[int, list[tuple[int, int, str]]]]:
    """Per item name: (size, [(offset in the item, length, digest)]) of the previous save."""
    if previous is None:
        return {}
    out = {}
    i = 0
    for item in previous.items:
        off = 0
        chunks = []
        for digest, size in previous.chunks[i:i + item.chunks]:
            chunks.append((off, size, digest))
            off += size
        i += item.chunks
        out[item.name] = (item.nbytes, chunks)
    return out


def encode_state(state: object, *, job: str, rank: int, epoch: int, params: CodecParams,
                 previous: Manifest | None, sink: Sink, extra: dict[str, Any] | None = None,
                 workers: int | None = None, pack_bytes: int = 32 << 20,
                 clock: Callable[[], float] = time.time) -> tuple[Manifest, SaveStats]:
    """Save ``state``: new chunks go to ``sink`` in packs; returns the manifest (generation 0:
    the agent numbers it at commit) and what was written.

    ``previous``: the manifest of a generation whose chunks the agent holds (it pins them
    for the save); its chunks are referenced instead of sent, and its cut points drive
    the pre-pass, so an unchanged region is hashed once and neither cut nor compressed.
    """
    t0 = time.perf_counter()
    workers = workers or max(2, min(8, 2 * len(os.sched_getaffinity(0))))
    digest_of = hasher(params.digest)
    known = previous.digests() if previous is not None and \
        previous.digest_algo == params.digest else frozenset()
    prev_items = _previous_chunks(previous) if known else {}
    local = threading.local()

    def work(view: memoryview, elem: int
             ) -> tuple[bytes, tuple[bytes, bytes | memoryview] | None]:
        digest = digest_of(view)
        if digest.hex() in known:
            return digest, None
        enc = getattr(local, "enc", None)
        if enc is None:
            enc = local.enc = Encoder(params)
        return digest, enc.encode(view, elem)

    chunker = Chunker(params.avg_chunk_kb)
    sender = _Sender(sink)
    pack = PackWriter()
    items: list[Item] = []
    chunks: list[tuple[str, int]] = []
    sent: set[str] = set()
    new_raw = new_stored = 0
    pending: deque[tuple[Future[tuple[bytes, Any]] | str, int]] = deque()

    def drain(limit: int) -> None:
        nonlocal pack, new_raw, new_stored
        while len(pending) > limit:
            fut, size = pending.popleft()
            if isinstance(fut, str):
                chunks.append((fut, size))
                continue
            digest, encoded = fut.result()
            name = digest.hex()
            chunks.append((name, size))
            if encoded is not None and name not in sent:
                sent.add(name)
                new_stored += pack.add(digest, size, *encoded)
                new_raw += size
                if pack.size >= pack_bytes:
                    sender.put(pack)
                    pack = PackWriter()

    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="raps-encode") as pool:
            for name, obj in state_items(state):
                view, elem = as_bytes(obj)
                prev = prev_items.get(name)
                segs = _segments(view, prev[1] if prev and prev[0] == len(view) else None,
                                 digest_of, pool)
                count = 0
                for seg_off, seg_len, seg_digest in segs:
                    if seg_digest is not None:
                        pending.append((seg_digest, seg_len))
                        count += 1
                        continue
                    region = view[seg_off:seg_off + seg_len]
                    for off, length in chunker.cuts(region):
                        pending.append((pool.submit(work, region[off:off + length], elem),
                                        length))
                        count += 1
                        drain(4 * workers)
                items.append(describe(name, obj, len(view), count))
            drain(0)
        if pack.count:
            sender.put(pack)
        else:
            pack.close()
        sender.finish()
    except BaseException:
        pack.close()
        raise
    total = sum(i.nbytes for i in items)
    whole = whole_digest(params.digest, items, chunks)
    manifest = Manifest(job, rank, 0, epoch, params.digest, tuple(items), tuple(chunks),
                        total, whole, clock(), dict(extra or {}))
    manifest.check("new manifest")
    return manifest, SaveStats(total, len(chunks), len(sent), new_raw, new_stored,
                               sender.packs, time.perf_counter() - t0)


def iter_chunk_offsets(manifest: Manifest) -> Iterable[tuple[int, str, int]]:
    """(offset in the whole, digest, size) of every chunk, in order."""
    off = 0
    for digest, size in manifest.chunks:
        yield off, digest, size
        off += size
