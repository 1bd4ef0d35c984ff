"""Message-log segments of ranks on a node (the agent's, or a local run's directory).

A rank flushes its message log in batches; each batch is one *segment* file,
``job-<id>/logs/<rank>/<n>.seg``, written atomically (temp file, fsync, rename): a
crash keeps whole segments only. Segments are numbered in the order they were written;
reading concatenates them. Trimming deletes the segments whose every record is at or
below the floor its destination gave (those messages can never be asked for again), but
never the newest one, so that numbers only grow even across an agent restart.

Numbers never collide across incarnations: an incarnation with epoch ``e`` numbers its
segments above ``e << 32`` (and above every segment already here), so a fenced older
copy of a rank and its successor never write one number with two contents. A copy of a
number that already exists with other bytes is refused, never silently dropped.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from raps_slurm.checkpoint.chunkstore import drop_cached, fsync_dir, write_atomic
from raps_slurm.errors import RapsError
from raps_slurm.runtime.msglog import MessagingError, parse_records

MAX_SEGMENT = 256 << 20
EPOCH_SHIFT = 32  # segment numbers of epoch e start above e << 32


class LogStoreError(RapsError):
    """A segment is refused (malformed, too large)."""


class LogStore:
    """Segments under one root; thread-safe.

    A segment is cold data, read back only for a resend, a restore or its one copy to
    the log backup. With ``cold`` its pages leave the page cache as soon as it is on
    disk (a store with no copy to make: a backup's, or a local run's); otherwise the
    copy lane calls :meth:`drop_pages` once the copy is made. The node's page cache
    stays the application's, and new segments reuse freed pages rather than take new
    ones (``write_atomic``)."""

    def __init__(self, root: str | Path, *, cold: bool = False) -> None:
        self.root = Path(root)
        self.cold = cold
        self._lock = threading.Lock()

    def _dir(self, job: str, rank: int) -> Path:
        if not (job.isascii() and job.isdigit() and 0 < len(job) <= 20) and job != "local":
            raise ValueError(f"job id {job!r}: expected 1..20 decimal digits")
        return self.root / f"job-{job}" / "logs" / str(int(rank))

    def segments(self, job: str, rank: int) -> list[int]:
        """Segment numbers, ascending."""
        d = self._dir(job, rank)
        if not d.is_dir():
            return []
        return sorted(int(p.stem) for p in d.glob("*.seg") if p.stem.isdigit())

    def append(self, job: str, rank: int, data: bytes | list[bytes | memoryview],
               number: int | None = None, *, check: bool = True, epoch: int = 0,
               sync_dir: bool = True) -> int:
        """Store one segment (its framing checked unless ``check`` is off: a rank's own
        local store); its number, above ``epoch << 32`` and every number here. With
        ``number`` (a copy from the primary) the same number is used: a copy already
        here with the same bytes is kept, one with other bytes is refused. Bodies'
        checksums are checked when the log is read back. ``sync_dir=False``: the new name
        is durable only after :meth:`sync` (a batch of copies syncs the directory once)."""
        parts = [data] if isinstance(data, bytes) else data
        size = sum(len(p) for p in parts)
        if size > MAX_SEGMENT:
            raise LogStoreError(f"log segment of {size} bytes exceeds {MAX_SEGMENT}")
        if check and (problem := _malformed(b"".join(parts))) is not None:
            raise LogStoreError(problem)
        d = self._dir(job, rank)
        with self._lock:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = d.parent.parent / "tmp"
            tmp.mkdir(mode=0o700, exist_ok=True)
            if number is None:
                number = max(max(self.segments(job, rank), default=0), epoch << EPOCH_SHIFT) + 1
            elif (d / f"{number}.seg").exists():
                if (d / f"{number}.seg").read_bytes() != b"".join(parts):
                    raise LogStoreError(_conflict(job, rank, number))
                return number
            write_atomic(d, tmp, f"{number}.seg", parts, cold=self.cold, sync_dir=sync_dir)
        return number

    def sync(self, job: str, rank: int) -> None:
        """Make the rank's segment names durable (after appends with ``sync_dir=False``)."""
        d = self._dir(job, rank)
        if d.is_dir():
            fsync_dir(d)

    def drop_pages(self, job: str, rank: int, n: int) -> None:
        """Let segment ``n``'s pages leave the page cache (it was copied; gone: nothing)."""
        drop_cached(self._dir(job, rank) / f"{int(n)}.seg")

    def segment(self, job: str, rank: int, n: int, off: int = 0, size: int = -1) -> bytes:
        """Segment ``n``'s bytes, or ``size`` of them from ``off`` (empty if it is gone)."""
        try:
            with open(self._dir(job, rank) / f"{int(n)}.seg", "rb") as f:
                if off:
                    f.seek(off)
                return f.read(size)
        except FileNotFoundError:
            return b""

    def size(self, job: str, rank: int, n: int) -> int:
        """Segment ``n``'s length in bytes (0 if it is gone)."""
        try:
            return (self._dir(job, rank) / f"{int(n)}.seg").stat().st_size
        except FileNotFoundError:
            return 0

    def put_part(self, job: str, rank: int, number: int, off: int, total: int,
                 data: bytes | memoryview) -> bool:
        """Store ``data`` at ``off`` of copied segment ``number`` of ``total`` bytes: a
        segment larger than one transfer frame comes in pieces, in order. True once the
        last piece is in and the whole segment is stored as :meth:`append` would (checked,
        compared with a copy already here). A piece that does not follow the ones held
        is refused; a copy starts over at offset 0."""
        if not 0 < total <= MAX_SEGMENT:
            raise LogStoreError(f"log segment of {total} bytes: expected 1..{MAX_SEGMENT}")
        if not (data and off >= 0 and off + len(data) <= total):
            raise LogStoreError(f"piece of {len(data)} bytes at {off}: outside the "
                                f"segment's {total} bytes")
        tmp = self._dir(job, rank).parent.parent / "tmp"
        path = tmp / f".part-{int(rank)}-{int(number)}"
        with self._lock:
            tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags | (os.O_TRUNC if off == 0 else 0), 0o600)
            try:
                held = os.fstat(fd).st_size
                if held != off:
                    raise LogStoreError(f"piece at {off} of segment {number}: {held} bytes "
                                        "are held, a copy resumes there or starts at 0")
                view = memoryview(data)
                while view:
                    view = view[os.pwrite(fd, view, off + len(data) - len(view)):]
                if off + len(data) < total:
                    return False
                whole = os.pread(fd, total, 0)
                d = self._dir(job, rank)
                final = d / f"{int(number)}.seg"
                here = final.exists()  # a copy already stored: the same bytes, or refused
                problem = _malformed(whole)
                if problem is None and here and final.read_bytes() != whole:
                    problem = _conflict(job, rank, number)
                if problem is None and not here:
                    # Checked, the pieces take the segment's name: no second write.
                    os.fsync(fd)
                    if self.cold:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            if problem is not None or here:
                path.unlink()
                if problem is not None:
                    raise LogStoreError(problem)
                return True
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.rename(path, final)
            fsync_dir(d)
        return True

    def read(self, job: str, rank: int, after: int = 0) -> bytes:
        """Every segment above ``after``, concatenated in order."""
        d = self._dir(job, rank)
        out = []
        for n in self.segments(job, rank):
            if n > after:
                with contextlib.suppress(FileNotFoundError):
                    out.append((d / f"{n}.seg").read_bytes())
        return b"".join(out)

    def trim(self, job: str, rank: int, floors: dict[int, int]) -> int:
        """Delete segments whose every record is at or below its destination's floor (all
        but the newest segment, which keeps the numbering's high mark)."""
        d = self._dir(job, rank)
        gone = 0
        with self._lock:
            for n in self.segments(job, rank)[:-1]:
                path = d / f"{n}.seg"
                try:
                    entries = list(parse_records(path.read_bytes()))
                except (OSError, MessagingError):
                    continue
                if all(e.seq <= floors.get(e.dst, 0) for e in entries):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                        gone += 1
        return gone


def _malformed(segment: bytes) -> str | None:
    """Why ``segment`` is no log segment (None: its framing holds)."""
    try:
        for _ in parse_records(segment, verify=False):
            pass
    except MessagingError as exc:
        return f"malformed log segment: {exc}"
    return None


def _conflict(job: str, rank: int, number: int) -> str:
    return (f"segment {number} of rank {rank} of job {job} is already stored with other "
            "bytes: copy refused")
