"""Node-local saves and restores on top of the chunk store (agent side, no etcd, no network).

A save is a session: :meth:`LocalCheckpoints.begin` pins the base generation the rank
will reference, :meth:`ingest` stores each pack of new chunks as one durable pack file (pinned
as they arrive), :meth:`finish` checks that every chunk
the manifest names is here and writes the manifest. Until then, a crash leaves the
previous generations untouched: chunks without a manifest are garbage that the next
collection removes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.manifest import Manifest
from raps_slurm.checkpoint.pack import iter_records
from raps_slurm.checkpoint.reader import BadChunk, memory_file, read_into
from raps_slurm.errors import RapsError


class SaveError(RapsError):
    """A save cannot complete (missing chunks, bad manifest); the previous generation stands."""


@dataclass
class Session:
    """One save in progress."""

    job: str
    rank: int
    epoch: int
    base: int | None
    pins: set[str]
    exit: contextlib.ExitStack
    chunks_written: int = 0
    bytes_written: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Restored:
    """A verified generation in a memory file: ``fd`` and its map hold the raw state."""

    manifest: Manifest
    fd: int
    buffer: mmap.mmap | None
    alloc_seconds: float = 0.0  # of the total: allocating the memory file's pages

    def close(self) -> None:
        """Unmap and close (the rank's copy of the descriptor stays valid)."""
        if self.buffer is not None:
            with contextlib.suppress(BufferError):
                self.buffer.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class LocalCheckpoints:
    """Saves and verified restores of one node's chunk store."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.progress: Callable[[int], None] | None = None  # bytes verified (CLI bar)

    # --- saves -------------------------------------------------------------------------

    def begin(self, job: str, rank: int, epoch: int, base: int | None) -> tuple[Session, bool]:
        """Open a save; the second value says whether ``base`` is held here (then the rank
        may reference its chunks without sending them)."""
        stack = contextlib.ExitStack()
        gens = [(rank, base)] if base is not None else []
        pins = stack.enter_context(self.store.pinned(job, gens=gens))
        base_ok = False
        if base is not None:
            try:
                m = self.store.manifest(job, rank, base)
            except RapsError:
                m = None
            base_ok = m is not None and not self.store.missing(job, m.digests())
        return Session(job, rank, epoch, base if base_ok else None, pins, stack), base_ok

    def ingest(self, session: Session, fd: int) -> tuple[int, int]:
        """Store every chunk of the pack in ``fd``; (chunks written, bytes written).

        PackError at a malformed record: chunks before it are stored (and collected later
        if no manifest comes to need them).
        """
        entries = list(iter_records(fd, with_payload=False))
        for entry in entries:
            self.store.pin_chunk(session.job, session.pins, entry.digest)
        done = self.store.adopt(session.job, fd, entries)
        if done is None:  # some chunks are here already: copy only the others
            done = self.store.put_many(session.job, (
                (e.digest, e.raw_size, os.pread(fd, e.stored_size, e.offset)) for e in entries))
        written, nbytes = done
        with session.lock:
            session.chunks_written += written
            session.bytes_written += nbytes
        return written, nbytes

    def finish(self, session: Session, manifest: Manifest, generation: int) -> bytes:
        """Check and write the manifest as ``generation``; its canonical JSON.

        SaveError if it is not this session's rank and epoch or names a chunk not stored.
        """
        if (manifest.job, manifest.rank, manifest.epoch) != \
                (session.job, session.rank, session.epoch):
            raise SaveError(f"manifest is for job {manifest.job} rank {manifest.rank} epoch "
                            f"{manifest.epoch}, the save was opened for job {session.job} "
                            f"rank {session.rank} epoch {session.epoch}")
        missing = self.store.missing(session.job, manifest.digests())
        if missing:
            raise SaveError(f"{len(missing)} chunk(s) named by the manifest are not stored, "
                            f"first {missing[0][:16]}")
        return self.store.put_manifest(manifest.with_generation(generation))

    def end(self, session: Session) -> None:
        """Release the session's pins (after commit or abort)."""
        session.exit.close()

    # --- restores ----------------------------------------------------------------------

    def restore(self, job: str, rank: int, gen: int) -> tuple[Restored | None, list[BadChunk]]:
        """A verified copy of a generation held here; (None, bad chunks) when it is not whole.

        Missing manifest → (None, []). A damaged manifest counts as a bad chunk named
        ``manifest``.
        """
        with self.store.pinned(job, gens=[(rank, gen)]):
            try:
                m = self.store.manifest(job, rank, gen)
            except RapsError as exc:
                return None, [BadChunk("manifest", str(exc))]
            if m is None:
                return None, []
            return self.restore_manifest(m)

    def restore_manifest(self, m: Manifest,
                         memory: tuple[int, mmap.mmap | None] | None = None,
                         fetch: Callable[[str], bytes | memoryview] | None = None,
                         checked: Container[str] = frozenset()
                         ) -> tuple[Restored | None, list[BadChunk]]:
        """Decode and verify ``m`` from this store into a memory file (``memory``: one
        allocated beforehand, e.g. while the missing chunks were pulled; it is closed on
        failure like one allocated here). ``fetch``: where a chunk's stored bytes come
        from instead (chunks pulled and not yet stored); ``checked``: chunks ``fetch``
        gives as verified already, only decoded (:func:`read_into`)."""
        t = time.perf_counter()
        fd, buf = memory if memory is not None else memory_file(m.total_size)
        alloc = time.perf_counter() - t
        try:
            view = memoryview(buf) if buf is not None else memoryview(bytearray())
            bad = read_into(m, fetch or (lambda d: self.store.read(m.job, d)), view,
                            progress=self.progress, checked=checked)
            view.release()
        except BaseException:
            if buf is not None:
                buf.close()
            os.close(fd)
            raise
        if bad:
            if buf is not None:
                buf.close()
            os.close(fd)
            return None, bad
        return Restored(m, fd, buf, alloc), []
