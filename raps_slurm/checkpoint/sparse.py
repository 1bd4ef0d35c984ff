"""A restore's memory file, allocated only where the state is not zero.

A checkpoint's chunks are named by the digest of their content, so a chunk whose name
is the digest of ``size`` zero bytes holds zeros: nothing needs to be read, decoded or
allocated for it, since a memory file's holes read as zeros. A state of 512 MiB of
zeros is a few chunks on disk (every zero chunk has the same name); restoring it must
not make the agent allocate 512 MiB. What a restore allocates is the non-zero part,
which the caller charges before anything is allocated (:mod:`raps_slurm.agent.uid_limits`).
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass

from raps_slurm.checkpoint.codec import hasher
from raps_slurm.checkpoint.manifest import Manifest


@functools.lru_cache(maxsize=64)
def zero_digest(algo: str, size: int) -> str:
    """The name of a chunk of ``size`` zero bytes."""
    return hasher(algo)(bytes(size)).hex()


@dataclass(frozen=True)
class Layout:
    """Where a manifest's state is not zero."""

    ranges: tuple[tuple[int, int], ...]  # (offset, length) of non-zero runs, merged
    zero: frozenset[str]  # digests of the chunks that hold zeros
    nonzero_bytes: int

    def wanted(self, digests: Iterable[str]) -> list[str]:
        """``digests`` but the zero chunks', sorted."""
        return sorted(d for d in digests if d not in self.zero)


def layout(m: Manifest) -> Layout:
    """The non-zero runs of ``m``'s state. Only a chunk that occurs more than once is
    looked at: a single zero chunk costs no more than any other chunk, and hashing zeros
    for every chunk size of a random state would double a restore's hashing."""
    seen: dict[tuple[str, int], int] = {}
    for chunk in m.chunks:
        seen[chunk] = seen.get(chunk, 0) + 1
    sizes: dict[str, int] = {}
    for digest, _ in seen:
        sizes[digest] = sizes.get(digest, 0) + 1
    # a name that comes with two sizes cannot be zeros at both: such a chunk is read (and
    # fails its check) like any other
    zeros = {c for c, n in seen.items() if n > 1 and sizes[c[0]] == 1
             and c[0] == zero_digest(m.digest_algo, c[1])}
    ranges: list[list[int]] = []
    off = 0
    for digest, size in m.chunks:
        if (digest, size) not in zeros and size:
            if ranges and ranges[-1][0] + ranges[-1][1] == off:
                ranges[-1][1] += size
            else:
                ranges.append([off, size])
        off += size
    return Layout(tuple((a, b) for a, b in ranges), frozenset(d for d, _ in zeros),
                  sum(b for _, b in ranges))


def memory_file(total: int, ranges: tuple[tuple[int, int], ...],
                name: str = "raps-restore") -> tuple[int, mmap.mmap | None]:
    """A memory file of ``total`` bytes whose pages are allocated only in ``ranges`` (up
    front, so a node short of memory gives a clean OSError here instead of a SIGBUS in
    the middle of a restore), and a writable map of it (None if empty)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        if total:
            os.ftruncate(fd, total)
        for off, length in ranges:
            os.posix_fallocate(fd, off, length)
        return fd, (mmap.mmap(fd, total) if total else None)
    except BaseException:
        os.close(fd)
        raise


def allocated_bytes(fd: int) -> int:
    """Bytes of memory a memory file holds (its allocated blocks)."""
    return os.fstat(fd).st_blocks * 512
