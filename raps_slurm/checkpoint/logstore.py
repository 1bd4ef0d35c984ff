"""Message-log segments of ranks on a node (the agent's, or a local run's directory).

A rank flushes its message log in batches; each batch is one *segment* file,
``job-<id>/logs/<rank>/<n>.seg``, written atomically (temp file, fsync, rename): a
crash keeps whole segments only. A *spill* segment (nothing but bodies of messages to
other ranks) is renamed into place without fsync (:func:`spill_only`); a reader leaves
out one that a crash of the node's kernel tore (:meth:`LogStore.torn`). Segments are
numbered in the order they were written; reading concatenates them. Trimming deletes
the segments whose every record is at or below the floor its destination gave (those
messages can never be asked for again), but never the newest one, so that numbers only
grow even across an agent restart.

Numbers never collide across incarnations: an incarnation with epoch ``e`` numbers its
segments above ``e << 32`` (and above every segment already here), so a fenced older
copy of a rank and its successor never write one number with two contents. A copy of a
number that already exists with other bytes is refused, never silently dropped.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from raps_slurm.checkpoint.chunkstore import drop_cached, fsync_dir, write_atomic
from raps_slurm.errors import RapsError
from raps_slurm.runtime.msglog import F_BODY, RECORD, MessagingError, parse_records

MAX_SEGMENT = 256 << 20
EPOCH_SHIFT = 32  # segment numbers of epoch e start above e << 32


class LogStoreError(RapsError):
    """A segment is refused (malformed, too large)."""


class LogStore:
    """Segments under one root; thread-safe.

    A segment is cold data, read back only for a resend, a restore or its one copy to
    the log backup. With ``cold`` its pages leave the page cache as soon as it is on
    disk (a spill segment's at the next append; a store with no copy to make: a
    backup's, or a local run's); otherwise the
    copy lane calls :meth:`drop_pages` once the copy is made. The node's page cache
    stays the application's, and new segments reuse freed pages rather than take new
    ones (``write_atomic``).

    A store numbers a new segment above the highest it wrote or listed in that directory
    (listing it only the first time, or when that number is taken): the store must be
    its directories' only writer, as the agent's and a local rank's are."""

    def __init__(self, root: str | Path, *, cold: bool = False) -> None:
        self.root = Path(root)
        self.cold = cold
        self._lock = threading.Lock()
        self._unsynced: list[Path] = []  # a cold store's spill written last (see append)
        # directory -> the highest segment number written there: a flush every 100 ms
        # listed the whole directory to number its segment, more CPU the longer the run
        self._high: dict[Path, int] = {}

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
        if check and (problem := _malformed(parts)) is not None:
            raise LogStoreError(problem)
        durable = not spill_only(parts, rank)
        d = self._dir(job, rank)
        with self._lock:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = d.parent.parent / "tmp"
            tmp.mkdir(mode=0o700, exist_ok=True)
            if number is None:
                high = self._high.get(d)
                number = max(high or 0, epoch << EPOCH_SHIFT) + 1
                if high is None or (d / f"{number}.seg").exists():  # first, or another writer
                    number = max(max(self.segments(job, rank), default=0),
                                 epoch << EPOCH_SHIFT) + 1
            elif (d / f"{number}.seg").exists():
                if (d / f"{number}.seg").read_bytes() != b"".join(parts):
                    raise LogStoreError(_conflict(job, rank, number))
                self._high[d] = max(self._high.get(d, 0), number)
                return number
            write_atomic(d, tmp, f"{number}.seg", parts, cold=self.cold, sync_dir=sync_dir,
                         durable=durable)
            self._high[d] = max(self._high.get(d, 0), number)
            if self.cold and not durable:
                # Not on disk yet, so its pages cannot leave now: fadvise starts their
                # write-back, and the next append drops them (written back by then).
                for path in self._unsynced:
                    drop_cached(path)
                self._unsynced = [d / f"{number}.seg"]
                drop_cached(self._unsynced[0])
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
                problem = _malformed([whole])
                if problem is None and here and final.read_bytes() != whole:
                    problem = _conflict(job, rank, number)
                if problem is None and not here:
                    # Checked, the pieces take the segment's name: no second write.
                    if not spill_only([whole], rank):
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
            self._high[d] = max(self._high.get(d, 0), int(number))
        return True

    def read(self, job: str, rank: int, after: int = 0) -> bytes:
        """Every segment above ``after``, concatenated in order (torn ones left out)."""
        d = self._dir(job, rank)
        out = []
        for n in self.segments(job, rank):
            if n > after and not self.torn(job, rank, n):
                with contextlib.suppress(FileNotFoundError):
                    out.append((d / f"{n}.seg").read_bytes())
        return b"".join(out)

    def torn(self, job: str, rank: int, n: int) -> bool:
        """Whether segment ``n`` is a spill segment cut short: written without fsync, a
        crash of the node's kernel may leave it empty or in part. What it held, bodies of
        messages to other ranks, a re-executed sender sends again; a segment with any
        other record was fsync'ed and is never left out. Reads the records' headers
        only (a spill's bodies are large)."""
        try:
            fd = os.open(self._dir(job, rank) / f"{int(n)}.seg",
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            size, pos = os.fstat(fd).st_size, 0
            while pos < size:
                head = os.pread(fd, RECORD.size, pos)
                if len(head) < RECORD.size:
                    return True
                dst, _, _, length, _, flags = RECORD.unpack(head)
                if not flags & F_BODY or dst == rank:
                    return False  # durable: whatever fails here is not a torn spill
                pos += RECORD.size + length
            return pos > size
        finally:
            os.close(fd)

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


def spill_only(parts: Sequence[bytes | memoryview], rank: int) -> bool:
    """Whether the segment ``parts`` joined holds nothing but bodies of messages to
    other ranks (a spill), which need no fsync. Recovery never needs them from this
    disk: a lost sender's relaunch re-executes from its checkpoint and sends them again,
    and the disk goes with the node only when the sender goes too (an agent that
    restarts finds them in the page cache). Determinants (records to ``rank`` itself:
    decisions a re-execution must repeat) and message metadata (the sent vector a
    relaunch resumes from) are fsync'ed before they count (docs/architecture.md,
    Checkpoints and message logs). False for a segment whose framing fails."""
    seen = False
    try:
        for dst, flags in _heads(parts):
            if not flags & F_BODY or dst == rank:
                return False
            seen = True
    except MessagingError:
        return False
    return seen


def _heads(parts: Sequence[bytes | memoryview]) -> Iterator[tuple[int, int]]:
    """(dst, flags) of each record of ``parts`` joined, without joining or copying the
    bodies; MessagingError at a truncated record."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    i = off = 0
    while i < len(views):
        v = views[i]
        if v.nbytes - off >= RECORD.size:
            dst, _, _, size, _, flags = RECORD.unpack_from(v, off)
            off += RECORD.size
        else:  # a header split across parts
            head = bytearray()
            while len(head) < RECORD.size and i < len(views):
                piece = views[i][off:off + RECORD.size - len(head)]
                head += piece
                off += piece.nbytes
                if off == views[i].nbytes:
                    i, off = i + 1, 0
            if len(head) < RECORD.size:
                raise MessagingError("log record truncated")
            dst, _, _, size, _, flags = RECORD.unpack(head)
        left = size if flags & F_BODY else 0
        while left:
            if i == len(views):
                raise MessagingError(f"log body to {dst} truncated")
            step = min(left, views[i].nbytes - off)
            left -= step
            off += step
            if off == views[i].nbytes:
                i, off = i + 1, 0
        if i < len(views) and off == views[i].nbytes:
            i, off = i + 1, 0
        yield dst, flags


def _malformed(segment: Sequence[bytes | memoryview]) -> str | None:
    """Why the segment ``segment`` joined is no log segment (None: its framing holds).
    Headers only: a body's checksum is checked when the log is read back."""
    try:
        for _ in _heads(segment):
            pass
    except MessagingError as exc:
        return f"malformed log segment: {exc}"
    return None


def _conflict(job: str, rank: int, number: int) -> str:
    return (f"segment {number} of rank {rank} of job {job} is already stored with other "
            "bytes: copy refused")
