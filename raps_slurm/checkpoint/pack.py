"""Packs: how encoded chunks cross from a rank (user) to its agent (root) in one file descriptor.

A rank cuts, names and compresses its chunks on its own CPU time and writes them into
an anonymous memory file (``memfd_create``), which it passes to the agent with
``SCM_RIGHTS``. The agent never opens a path the user chose (no symlink games) and
reads the pack with ``pread``; the pack is parsed like any other untrusted input.

Layout: the magic ``RAPSPAK1``, then records of a 40-byte header (32-byte digest, raw
size u32, stored size u32, big-endian) followed by the stored bytes (codec byte
first, see :mod:`raps_slurm.checkpoint.codec`). Nothing follows the last record.
"""

from __future__ import annotations

import fcntl
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from raps_slurm.checkpoint.codec import DIGEST_SIZE
from raps_slurm.errors import RapsError

IOV_MAX = 1024  # Linux's bound on the buffers of one writev

MAGIC = b"RAPSPAK1"
HEADER = struct.Struct(">32sII")
MAX_CHUNK = 16 << 20  # FastCDC's largest max_size
# A stored chunk is never much larger than raw: raw storage is chosen when zstd does not save.
STORED_SLACK = 64


class PackError(RapsError):
    """A pack is malformed (names the offset and what is wrong)."""


@dataclass(frozen=True)
class PackEntry:
    """One chunk in a pack: its name, raw size, and where its stored bytes are."""

    digest: str
    raw_size: int
    offset: int
    stored_size: int
    payload: bytes = b""


class PackWriter:
    """Appends chunks to an anonymous memory file; ``fd`` is what travels to the agent."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("raps-pack", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.write(self.fd, MAGIC)
        self.size = len(MAGIC)
        self.count = 0

    def add(self, digest: bytes, raw_size: int, head: bytes,
            payload: bytes | memoryview) -> int:
        """Append one encoded chunk (codec header + payload); its stored size."""
        stored = len(head) + len(payload)
        parts = [HEADER.pack(digest, raw_size, stored), head, payload]
        total = HEADER.size + stored
        done = 0
        while done < total:  # writev may stop short on a memory file under pressure
            n = os.writev(self.fd, parts)
            done += n
            while parts and n >= len(parts[0]):
                n -= len(parts[0])
                parts.pop(0)
            if parts and n:
                parts[0] = memoryview(parts[0])[n:]
        self.size += total
        self.count += 1
        return stored

    def seal(self) -> None:
        """Make the pack immutable before it is handed over (the agent checks the seals:
        a pack that could change between its checks and its copy is refused)."""
        seal_memfd(self.fd)

    def close(self) -> None:
        """Release the memory file (the agent keeps its own descriptor while reading)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def seal_memfd(fd: int) -> None:
    """Forbid any further change to a memory file (and to its seals)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)


def is_sealed(fd: int) -> bool:
    """Is ``fd`` a memory file nobody can change any more?"""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    except OSError:
        return False  # not a memfd (or one created without sealing)


def sealed_bytes(data: bytes, name: str = "raps-data") -> int:
    """A sealed memory file holding ``data``."""
    return sealed_parts([data], name)


def sealed_parts(parts: Iterable[bytes | memoryview], name: str = "raps-data") -> int:
    """A sealed memory file holding ``parts`` one after the other (written as they are,
    not joined into one copy first)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        write_all(fd, parts)
        seal_memfd(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_all(fd: int, data: Iterable[bytes | memoryview]) -> None:
    """Write every part with as few system calls as possible (writev, no joining copy)."""
    pending = [v for v in (memoryview(p).cast("B") for p in data) if v.nbytes]
    i = 0
    while i < len(pending):
        n = os.writev(fd, pending[i:i + IOV_MAX])
        while i < len(pending) and n >= len(pending[i]):
            n -= len(pending[i])
            i += 1
        if i < len(pending) and n:
            pending[i] = pending[i][n:]


def iter_records(fd: int, *, with_payload: bool = True, limit: int = 1 << 40
                 ) -> Iterator[PackEntry]:
    """Each record of the pack in ``fd`` (payload read and attached when asked); PackError
    at the first bad record."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise PackError(f"pack of {size} bytes is larger than the limit {limit}")
    if os.pread(fd, len(MAGIC), 0) != MAGIC:
        raise PackError("not a pack (bad magic)")
    pos = len(MAGIC)
    while pos < size:
        head = os.pread(fd, HEADER.size, pos)
        if len(head) != HEADER.size:
            raise PackError(f"truncated record header at offset {pos}")
        digest, raw_size, stored_size = HEADER.unpack(head)
        if not 0 < raw_size <= MAX_CHUNK:
            raise PackError(f"record at offset {pos}: raw size {raw_size} outside 1..{MAX_CHUNK}")
        if not 1 <= stored_size <= raw_size + STORED_SLACK:
            raise PackError(f"record at offset {pos}: stored size {stored_size} outside "
                            f"1..{raw_size + STORED_SLACK}")
        start = pos + HEADER.size
        if start + stored_size > size:
            raise PackError(f"record at offset {pos}: truncated payload")
        payload = os.pread(fd, stored_size, start) if with_payload else b""
        if with_payload and len(payload) != stored_size:
            raise PackError(f"record at offset {pos}: truncated payload")
        yield PackEntry(digest.hex(), raw_size, start, stored_size, payload)
        pos = start + stored_size


assert HEADER.size == DIGEST_SIZE + 8
