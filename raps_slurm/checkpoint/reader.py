"""Verified reads: chunks from a store into one buffer, every chunk and the whole checked.

``read_into`` decodes a generation's chunks on a thread pool (zstd and the digests
release the GIL) straight into the caller's buffer (an ``mmap`` of a memory file the
agent later hands to the rank) and checks each chunk against its name (the manifest's
whole digest is a root over those names, checked when the manifest is decoded). It
reports every bad chunk instead of stopping at the first, so the caller can fetch
exactly those from another holder.

``materialize`` turns the verified buffer back into what the rank saved: bytes, a
numpy array (a view on the buffer, no copy), or a dict of them.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Container
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from raps_slurm.checkpoint.codec import ChunkError, Decoder, hasher
from raps_slurm.checkpoint.manifest import Manifest
from raps_slurm.checkpoint.writer import iter_chunk_offsets


@dataclass(frozen=True)
class BadChunk:
    """A chunk that is missing or does not decode to its name."""

    digest: str
    reason: str


def read_into(manifest: Manifest, fetch: Callable[[str], bytes | memoryview], out: memoryview, *,
              workers: int | None = None, only: set[str] | None = None,
              progress: Callable[[int], None] | None = None,
              checked: Container[str] = frozenset()) -> list[BadChunk]:
    """Decode and verify every chunk of ``manifest`` into ``out``; the bad ones, by name.

    ``fetch(digest)`` returns stored bytes (FileNotFoundError: missing). With ``only``,
    just the chunks with those names are (re)read, the rest of ``out`` is left alone.
    Chunks named in ``checked`` are only decoded: their stored bytes, as ``fetch`` returns
    them, were verified already (pulled chunks, checked on arrival and held in memory).
    """
    if len(out) != manifest.total_size:
        raise ValueError(f"buffer of {len(out)} bytes for a {manifest.total_size}-byte checkpoint")
    workers = workers or max(2, min(8, 2 * len(os.sched_getaffinity(0))))
    digest_of = hasher(manifest.digest_algo)
    local = threading.local()
    bad: dict[str, BadChunk] = {}
    lock = threading.Lock()

    def one(offset: int, digest: str, size: int) -> None:
        dec = getattr(local, "dec", None)
        if dec is None:
            dec = local.dec = Decoder()
        target = out[offset:offset + size]
        try:
            dec.decode_into(fetch(digest), target)
            if digest not in checked and digest_of(target).hex() != digest:
                raise ChunkError("content does not match its digest")
        except FileNotFoundError:
            with lock:
                bad.setdefault(digest, BadChunk(digest, "missing"))
        except ChunkError as exc:
            with lock:
                bad.setdefault(digest, BadChunk(digest, str(exc)))
        if progress is not None:
            progress(size)

    jobs = [c for c in iter_chunk_offsets(manifest) if only is None or c[1] in only]
    with ThreadPoolExecutor(workers, thread_name_prefix="raps-restore") as pool:
        list(pool.map(lambda c: one(*c), jobs))
    return sorted(bad.values(), key=lambda b: b.digest)


def memory_file(size: int, name: str = "raps-restore") -> tuple[int, mmap.mmap | None]:
    """An anonymous memory file of ``size`` bytes and a writable map of it (None if empty).

    The pages are allocated up front (``posix_fallocate``): a node short of memory gives
    a clean OSError here instead of a SIGBUS in the middle of a restore.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
        return fd, (mmap.mmap(fd, size) if size else None)
    except BaseException:
        os.close(fd)
        raise


def materialize(manifest: Manifest, buf: memoryview | mmap.mmap | None) -> object:
    """The saved state from a verified buffer: arrays are views on it (no copy)."""
    out: dict[str, object] = {}
    offset = 0
    whole = memoryview(buf) if buf is not None else memoryview(b"")
    for item in manifest.items:
        part = whole[offset:offset + item.nbytes]
        offset += item.nbytes
        if item.kind == "ndarray":
            out[item.name] = np.frombuffer(part, dtype=np.dtype(item.dtype)).reshape(item.shape)
        else:
            out[item.name] = bytes(part)
    if len(manifest.items) == 1 and manifest.items[0].name == "":
        return out[""]
    return out
