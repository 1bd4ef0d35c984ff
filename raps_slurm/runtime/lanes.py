"""The sender's log to one destination, packed (:class:`~raps_slurm.runtime.msglog.SenderLog`
keeps a :class:`Lane` per destination), no I/O.

A small message (under ``ARENA_AT`` bytes, not large) costs a row of six numbers in arrays
(:data:`ROW_BYTES`) and its body's bytes in a :class:`Chunk` of the lane, instead of an
``Entry`` object, a ``bytes`` object and its ints: 195 bytes of memory for an 8-byte
message, of which the high watermark counted 8 (docs/messaging.md, Memory). An ``Entry`` is
made only for a send, a resend, a replay or a checkpoint. A message whose body is not
copied here (large, in the arena, an immutable reference, or restored without its body)
keeps its ``Entry`` in :attr:`Lane.objs`, with a row that says so.

A spill writes a chunk's messages whole to the log store and drops their rows and the
chunk: seqs in :attr:`Lane.disk` are then only there (a resend or a checkpoint reads them
back), so a spill frees what the messages cost, not only their bodies.
"""

from __future__ import annotations

import bisect
import struct
from array import array
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace

import crc32c

from raps_slurm.runtime.arena import Slot
from raps_slurm.wire import datapath

RECORD = struct.Struct(">IQQIIB")  # dst, seq, epoch, size, CRC-32C, flags
F_BODY, F_LARGE = 1, 2  # a record's flags: it carries the body; a large message
R_LARGE, R_OBJ = 1, 2  # a row's flags: a large message; its Entry is in Lane.objs
# seq, epoch, size, offset (8 bytes each), CRC-32C (4), flags (1)
ROW_BYTES = 4 * 8 + 4 + 1
FIRST_CHUNK = 4096  # a lane's first chunk; each next one doubles up to MAX_CHUNK
MAX_CHUNK = 256 << 10
_POS = (1 << 32) - 1


def checksum(data: bytes | bytearray | memoryview, start: int = 0) -> int:
    """CRC-32C (Castagnoli) of a payload (frames and logs); ``start``: the checksum of
    the bytes before ``data``, for a payload in parts. The ``crc32c`` library uses the
    CPU's CRC instruction where there is one: 8 MiB in 0.34 ms on this project's test
    machine, against 1.75 ms for zlib's CRC-32 (docs/benchmarks.md, MPI); a large payload
    is folded where the CPU can (wire/datapath.py: 0.22 ms)."""
    if len(data) < datapath.FOLD_AT:  # a memoryview's len counts items: at most its bytes
        return int(crc32c.crc32c(data, start))
    return datapath.checksum(data, start)


@dataclass(slots=True)
class Entry:
    """One logged message."""

    dst: int
    seq: int
    epoch: int
    size: int
    crc: int
    large: bool
    body: bytes | memoryview | None
    persisted: bool = False       # a record is in the log store
    body_persisted: bool = False  # ... and it carries the body
    slot: Slot | None = None      # the body's room in the arena

    def record(self, with_body: bool) -> list[bytes | memoryview]:
        """The log-store record (header, then the body when asked and known)."""
        flags = (F_LARGE if self.large else 0) | (F_BODY if with_body else 0)
        head = RECORD.pack(self.dst, self.seq, self.epoch, self.size, self.crc, flags)
        if with_body:
            assert self.body is not None
            return [head, self.body]
        return [head]


class Chunk:
    """Bodies of consecutive small messages to one destination, in one buffer that is
    written once, never moved nor resized (a view of it stays valid)."""

    __slots__ = (
        "buf",
        "dead",
        "dst",
        "last",
        "rows",
        "sealed",
        "serial",
        "used",
        "written",
    )

    def __init__(self, dst: int, serial: int, size: int) -> None:
        self.dst, self.serial = dst, serial
        self.buf = bytearray(size)
        self.used = 0
        self.last = 0          # seq of its last body
        self.rows = 0          # its messages
        self.sealed = False    # a spill is writing it: it takes no more bodies
        self.written = False   # every body of it is in the log store (a spill wrote them)
        self.dead = False      # collected or spilled: its lane no longer has it

    def cost(self) -> int:
        """What it and its rows take in memory, as the high watermark counts it."""
        return len(self.buf) + self.rows * ROW_BYTES


class Lane:
    """The log to one destination: rows in seq order from :attr:`head`, the chunks their
    bodies are in, the Entries of the messages not copied here, and the range of seqs that
    a spill left only in the log store."""

    def __init__(self, dst: int) -> None:
        self.dst = dst
        self.seq, self.epoch, self.size = array("Q"), array("Q"), array("Q")
        self.off, self.crc, self.flags = array("Q"), array("I"), array("B")
        self.head = 0                       # rows before it are gone
        self.objs: dict[int, Entry] = {}    # seq -> Entry, for rows flagged R_OBJ
        self.chunks: deque[Chunk] = deque()
        self.serial = 0
        self.grow = FIRST_CHUNK
        self.disk = (1, 0)                  # [lo, hi]: seqs only in the log store
        self.taken = 0                      # seqs up to this went to a flush
        self.durable = 0                    # ... and up to this are in the log store

    def __len__(self) -> int:
        return len(self.seq) - self.head + max(0, self.disk[1] - self.disk[0] + 1)

    def first(self) -> int | None:
        """The lowest seq still held (in memory or the log store), None if none."""
        if self.disk[0] <= self.disk[1]:
            return self.disk[0]
        return self.seq[self.head] if self.head < len(self.seq) else None

    def last(self) -> int | None:
        """The highest seq held, None if none."""
        if self.head < len(self.seq):
            return self.seq[-1]
        return self.disk[1] if self.disk[0] <= self.disk[1] else None

    # --- adding ---------------------------------------------------------------------

    def add_small(self, seq: int, epoch: int, data: bytes | bytearray | memoryview,
                  size: int, crc: int) -> Chunk | None:
        """Copy a small message's body (``data``, ``size`` bytes, its checksum ``crc``)
        into a chunk, its row after the last; the chunk if a new one was made."""
        c = self.chunks[-1] if self.chunks else None
        made = None
        if c is None or c.sealed or c.used + size > len(c.buf):
            c = made = Chunk(self.dst, self.serial, max(size, self.grow))
            self.serial += 1
            self.grow = min(self.grow * 2, MAX_CHUNK)
            self.chunks.append(c)
        pos = c.used
        c.buf[pos:pos + size] = data  # the same length: the buffer never resizes
        # _row's appends, inline: this runs once per small message sent
        self.seq.append(seq)
        self.epoch.append(epoch)
        self.size.append(size)
        self.off.append((c.serial << 32) | pos)
        self.crc.append(crc)
        self.flags.append(0)
        c.used, c.last = pos + size, seq
        c.rows += 1
        return made

    def add_obj(self, e: Entry) -> None:
        """A message that keeps its Entry (large, in the arena, a reference)."""
        self.objs[e.seq] = e
        self._row(e.seq, e.epoch, e.size, 0, e.crc, R_OBJ | (R_LARGE if e.large else 0))

    def _row(self, seq: int, epoch: int, size: int, off: int, crc: int, flags: int) -> None:
        self.seq.append(seq)
        self.epoch.append(epoch)
        self.size.append(size)
        self.off.append(off)
        self.crc.append(crc)
        self.flags.append(flags)

    # --- reading --------------------------------------------------------------------

    def _chunk(self, i: int) -> Chunk:
        return self.chunks[(self.off[i] >> 32) - self.chunks[0].serial]

    def body(self, i: int) -> memoryview:
        """Row ``i``'s body in its chunk (a row not flagged R_OBJ)."""
        pos = self.off[i] & _POS
        return memoryview(self._chunk(i).buf)[pos:pos + self.size[i]]

    def entry(self, i: int, own: bool) -> Entry:
        """Row ``i`` as an Entry (its body a copy); ``own``: the lane of the rank's own
        determinants, whose bodies every flush writes."""
        s = self.seq[i]
        f = self.flags[i]
        if f & R_OBJ:
            return self.objs[s]
        written = self._chunk(i).written
        durable = s <= self.durable
        return Entry(self.dst, s, self.epoch[i], self.size[i], self.crc[i], bool(f & R_LARGE),
                     bytes(self.body(i)), durable, written or (own and durable))

    def entries(self, after: int, own: bool) -> Iterator[Entry]:
        """Entries above seq ``after``, in order: those only in the log store as stubs
        (no body, no checksum: the caller reads them there), then the rows."""
        lo, hi = self.disk
        for s in range(max(lo, after + 1), hi + 1):
            e = self.objs.get(s)
            yield e if e is not None else Entry(self.dst, s, 0, 0, 0, False, None, True, True)
        i = bisect.bisect_right(self.seq, after, lo=self.head)
        for j in range(i, len(self.seq)):
            yield self.entry(j, own)

    def chunk_rows(self, c: Chunk) -> Iterator[int]:
        """Indices of the rows whose bodies are in ``c`` (one of the lane's chunks)."""
        k = c.serial - self.chunks[0].serial
        lo = self.index(self.chunks[k - 1].last) if k else self.head
        for j in range(lo, self.index(c.last)):
            if not self.flags[j] & R_OBJ:
                yield j

    def index(self, seq: int) -> int:
        """The row index of the first seq above ``seq``."""
        return bisect.bisect_right(self.seq, seq, lo=self.head)

    def snapshot(self) -> Lane:
        """A copy that later changes do not reach (its chunks are shared: they are only
        ever appended to; its Entries are copies, so a body spilled meanwhile stays)."""
        view = Lane(self.dst)
        for name in ("seq", "epoch", "size", "off", "crc", "flags"):
            setattr(view, name, getattr(self, name)[self.head:])
        view.objs = {s: replace(e) for s, e in self.objs.items()}
        view.chunks = deque(self.chunks)
        view.disk, view.taken, view.durable = self.disk, self.taken, self.durable
        return view

    # --- removing -------------------------------------------------------------------

    def collect(self, floor: int) -> tuple[int, int, list[Entry], list[Chunk]]:
        """Forget what a receiver will never ask for again (seq <= ``floor``, durable):
        how many messages went, the rows' bytes, the Entries that went (their bodies are
        the caller's to free) and the chunks that went."""
        n = 0
        lo, hi = self.disk
        if lo <= hi and lo <= floor:
            top = min(hi, floor)
            n += top - lo + 1
            self.disk = (top + 1, hi)
        upto = min(floor, self.durable)
        i = self.index(upto)
        gone: list[Entry] = []
        rows_before = i - self.head
        n += rows_before
        if self.objs:
            for s in [s for s in self.objs if s <= upto]:
                gone.append(self.objs.pop(s))
        self._drop_rows(i)
        dead = self._drop_chunks(upto)
        return n, rows_before * ROW_BYTES, gone, dead

    def spill(self, c: Chunk) -> int:
        """``c`` (the lane's first chunk, written) goes with the rows up to its last seq:
        they are only in the log store from now on. Returns the rows' bytes freed."""
        assert self.chunks and self.chunks[0] is c and c.written
        i = self.index(c.last)
        lo, hi = self.disk
        if lo > hi and i > self.head:
            lo = self.seq[self.head]
        self.disk = (lo, max(hi, c.last))
        freed = (i - self.head) * ROW_BYTES
        self._drop_rows(i)
        self.chunks.popleft()
        c.dead = True
        return freed

    def _drop_rows(self, i: int) -> None:
        self.head = i
        # Compacted at most every so often: a front deletion moves every later row.
        if self.head > 4096 and self.head * 2 > len(self.seq):
            for a in (self.seq, self.epoch, self.size, self.off, self.crc, self.flags):
                del a[:self.head]
            self.head = 0

    def _drop_chunks(self, upto: int) -> list[Chunk]:
        dead = []
        while self.chunks and self.chunks[0].last <= upto:
            c = self.chunks.popleft()
            c.dead = True
            dead.append(c)
        return dead
