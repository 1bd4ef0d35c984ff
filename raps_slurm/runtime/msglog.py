"""Sender-based message logging and in-order delivery: the bookkeeping, no I/O.

Vocabulary. Every message from rank ``s`` to rank ``d`` has a sequence number
``seq`` (1, 2, ... per ordered pair). The *sent vector* of a rank is the last ``seq``
it used per destination; its *delivered vector* the last ``seq`` it handed to the
application per source. A *floor* is what a receiver's oldest kept checkpoint has
delivered from a sender: entries at or below it can never be asked for again, so the
sender may collect them.

:class:`SenderLog` keeps, per destination, the entries not yet collected: small
messages with their body (persisted at the next flush), large ones (over the
threshold) as metadata with the body kept in memory (a reference when the payload is
immutable ``bytes``, a copy otherwise: into the warm :class:`~raps_slurm.runtime.arena.Arena`
when it is large) until the receiver's floor passes them. When the
bodies held exceed the high watermark, the log *spills*: bodies already persisted are
dropped from memory and large bodies are persisted first, then dropped; the sender
blocks only for that local disk write, never for a peer.

:class:`Inbox` keeps, per source, the next sequence to deliver, early arrivals, and the
checksums of delivered messages (to check a re-executed sender's duplicates).
"""

from __future__ import annotations

import bisect
import struct
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import crc32c

from raps_slurm.errors import RapsError
from raps_slurm.runtime.arena import Arena, Slot
from raps_slurm.wire import datapath
from raps_slurm.wire.datapath import untrack

RECORD = struct.Struct(">IQQIIB")  # dst, seq, epoch, size, CRC-32C, flags
F_BODY, F_LARGE = 1, 2
ARENA_AT = 64 << 10  # copies of at least this many bytes go to the arena (smaller: heap)
# A flush writes each run of metadata records as one part of at most this many: a part
# each cost a writev entry and a pass of the segmenting and framing checks.
HEADS_PER_PART = 4096



class MessagingError(RapsError):
    """A message cannot be delivered correctly (named pair and sequence)."""


class NotDeterministic(MessagingError):
    """A re-executed send differs from what was delivered before: the rank is not
    piecewise deterministic."""


def checksum(data: bytes | bytearray | memoryview, start: int = 0) -> int:
    """CRC-32C (Castagnoli) of a payload (frames and logs); ``start``: the checksum of
    the bytes before ``data``, for a payload in parts. The ``crc32c`` library uses the
    CPU's CRC instruction where there is one: 8 MiB in 0.34 ms on this project's test
    machine, against 1.75 ms for zlib's CRC-32 (docs/benchmarks.md, MPI); a large payload
    is folded where the CPU can (wire/datapath.py: 0.22 ms)."""
    if len(data) < datapath.FOLD_AT:  # a memoryview's len counts items: at most its bytes
        return int(crc32c.crc32c(data, start))
    return datapath.checksum(data, start)


def parts_size(parts: Sequence[bytes | bytearray | memoryview]) -> int:
    """Bytes of ``parts`` joined (a memoryview's ``len`` counts its items, not bytes)."""
    n = 0
    for p in parts:
        n += p.nbytes if isinstance(p, memoryview) else len(p) if isinstance(
            p, bytes | bytearray) else memoryview(p).nbytes
    return n


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


def parse_records(data: bytes | memoryview, *, verify: bool = True) -> Iterator[Entry]:
    """Entries of a log-store blob; MessagingError at a truncated or inconsistent record
    (``verify=False`` checks the framing only, not the bodies' checksums)."""
    view = memoryview(data)
    pos = 0
    while pos < len(view):
        if len(view) - pos < RECORD.size:
            raise MessagingError(f"log record truncated at offset {pos}")
        dst, seq, epoch, size, crc, flags = RECORD.unpack_from(view, pos)
        pos += RECORD.size
        body = None
        if flags & F_BODY:
            if len(view) - pos < size:
                raise MessagingError(f"log body truncated at offset {pos}")
            body = bytes(view[pos:pos + size])
            pos += size
            if verify and checksum(body) != crc:
                raise MessagingError(f"log record to {dst} seq {seq}: body checksum mismatch")
        yield Entry(dst, seq, epoch, size, crc, bool(flags & F_LARGE), body, True,
                    body is not None)


RUN_BYTES = 1 << 20  # small records joined into one part of at most this many (runs())


def runs(records: Iterable[list[bytes | memoryview]], most: int = RUN_BYTES
         ) -> Iterator[list[bytes | memoryview]]:
    """``records`` in order, those under :data:`ARENA_AT` bytes joined into runs of at
    most ``most`` bytes, each one record of one part to :func:`segments` and the log
    store (which read records across parts). A part costs the write path Python work
    of its own: a spill of 4 KiB messages wrote two parts a message."""
    run: list[bytes | memoryview] = []
    size = 0
    for rec in records:
        n = parts_size(rec)
        if n >= ARENA_AT or size + n > most:
            if run:
                yield [b"".join(run)]
                run, size = [], 0
            if n >= ARENA_AT:
                yield rec
                continue
        run.extend(rec)
        size += n
    if run:
        yield [b"".join(run)]


def segments(records: Iterable[list[bytes | memoryview]], limit: int
             ) -> Iterator[list[bytes | memoryview]]:
    """``records`` (each a list of parts) grouped in order into segments of at most
    ``limit`` bytes (a record is never split: each is at most ``limit`` itself)."""
    seg: list[bytes | memoryview] = []
    size = 0
    for rec in records:
        n = sum(memoryview(p).nbytes for p in rec)
        if seg and size + n > limit:
            yield seg
            seg, size = [], 0
        seg.extend(rec)
        size += n
    if seg:
        yield seg


def _queue(items: Iterable[Entry] = ()) -> deque[Entry]:
    """A deque of log entries, out of the garbage collector's sight as they are: it and
    they are in no cycle (the entries hold numbers, bytes and arena rooms), and a full
    collection visited every entry of every such deque (datapath.untrack)."""
    q = deque(items)
    untrack(q)
    return q


class SenderLog:
    """The sender's side: sequence numbers, the log, flush batches, spilling, collection."""

    def __init__(self, *, large_threshold: int, high_watermark: int,
                 arena: Arena | None = None, own: int | None = None) -> None:
        self.large_threshold = large_threshold
        self.arena = arena
        self.own = own  # the rank itself: entries to it are determinants
        self.high_watermark = high_watermark
        self.sent: dict[int, int] = {}          # dst -> last seq
        self.entries: dict[int, deque[Entry]] = {}
        self.floors: dict[int, int] = {}        # dst -> collectable up to
        self.held = 0                           # bytes of bodies in memory
        self.peak = 0
        self.spilled = 0                        # bodies written out under pressure
        self.reserved = 0                       # messages copied in as they were sent
        self._unpersisted: list[Entry] = []
        # Entries whose bodies are in memory, oldest first (a spill takes from the left),
        # and some whose bodies went since (dropped as a spill or a pass of publish()
        # meets them): a spill used to sort every entry twice, O(n log n) in Python per
        # spill, which a stream of small messages past the watermark paid all the time.
        self._aged: deque[Entry] = _queue()
        self._bodies = 0  # entries of _aged whose bodies are in memory
        # After a restore: what a lost incarnation logged past the checkpoint (dst -> seq
        # -> entry), sent to a peer that asks for it before re-execution sends it again
        self.ahead: dict[int, dict[int, Entry]] = {}

    # --- sending ---------------------------------------------------------------------

    def append(self, dst: int, payload: bytes | bytearray | memoryview | list[
               bytes | bytearray | memoryview], epoch: int, size: int | None = None) -> Entry:
        """Log a message to ``dst`` (``payload``: the message, or its parts to join;
        ``size``: their bytes, when the caller knows); the entry carries its seq and
        checksum."""
        slot = None
        if isinstance(payload, bytes):
            body: bytes | memoryview = payload  # immutable: a reference is enough
        else:
            # The application may change its buffer after send(): a copy.
            parts = payload if isinstance(payload, list) else [payload]
            if size is None:
                size = parts_size(parts)
            if self.arena is not None and size >= ARENA_AT:
                body, slot = self.arena.copy(parts)
            else:
                body = b"".join(parts)
        size = len(body)
        e = Entry(dst, self.sent.get(dst, 0) + 1, epoch, size, int(crc32c.crc32c(body)),
                  size > self.large_threshold, body, slot=slot)
        self.publish(e)
        return e

    def reserve(self, dst: int, parts: list[bytes | bytearray | memoryview], epoch: int,
                size: int | None = None) -> tuple[Entry, bool]:
        """Log a message whose body the caller copies into the log as it sends it
        (wire/datapath.py): its entry, with room in the arena as ``body`` and no checksum
        yet (the caller takes it from the copy once the message is sent), and True; it is
        logged once :meth:`publish` ed, its checksum set (before, no resend, spill or
        collection can see a body not yet copied). A message below :data:`ARENA_AT`, or
        that finds no room, is :meth:`append` ed instead: False. ``size``: the parts'
        bytes, when the caller knows."""
        if size is None:
            size = parts_size(parts)
        got = self.arena.room(size) if self.arena is not None and size >= ARENA_AT else None
        if got is None:
            if size >= ARENA_AT:
                return self.append(dst, b"".join([memoryview(p).cast("B") for p in parts]),
                                   epoch), False
            return self.append(dst, parts, epoch), False
        self.reserved += 1
        room, slot = got
        return Entry(dst, self.sent.get(dst, 0) + 1, epoch, size, 0,
                     size > self.large_threshold, room, slot=slot), True

    def publish(self, e: Entry) -> None:
        """``e`` (the next to its destination) is logged: resent, spilled, collected."""
        dst, seq, sent = e.dst, e.seq, self.sent
        if seq != sent.get(dst, 0) + 1:
            raise MessagingError(f"seq {seq} to rank {dst} logged after seq "
                                 f"{sent.get(dst, 0)}")
        sent[dst] = seq
        # Held until a checkpoint covers it, and in no cycle: out of the collector's sight
        untrack(e)
        if self.ahead:
            ahead = self.ahead.get(dst)
            if ahead is not None:
                ahead.pop(seq, None)  # sent again by re-execution: from the log from now on
                if not ahead:
                    del self.ahead[dst]
        # once per message: no deque made to be thrown away, no max() call
        queue = self.entries.get(dst)
        if queue is None:
            queue = self.entries[dst] = _queue()
        queue.append(e)
        self._unpersisted.append(e)
        if e.body is not None:
            self._aged.append(e)
            self._bodies += 1
            if len(self._aged) > 2 * self._bodies + 4096:  # collected ones pile up
                self._aged = _queue(x for x in self._aged if x.body is not None)
        held = self.held = self.held + e.size
        if held > self.peak:
            self.peak = held

    def flushes_body(self, e: Entry) -> bool:
        """Whether a flush writes ``e`` with its body: only a determinant (an entry to
        the rank itself, which a re-execution reads back). A message's body reaches the
        log store when it spills or in a checkpoint: writing every message's bytes to a
        new file at each flush cost more CPU than sending them (2.5 ms per MiB on the test
        machine, docs/benchmarks.md), and a re-executed sender sends them again anyway."""
        return e.dst == self.own

    def take_unpersisted(self) -> tuple[list[Entry], list[list[bytes | memoryview]]]:
        """The entries to persist now and their records (determinants with their bodies,
        messages as metadata, a run of those joined in one item); call :meth:`persisted`
        with them once they are durable."""
        batch, self._unpersisted = self._unpersisted, []
        records: list[list[bytes | memoryview]] = []
        heads: list[bytes] = []  # a run of metadata records, written as one part
        for e in batch:
            if self.flushes_body(e):
                if heads:
                    records.append([b"".join(heads)])
                    heads = []
                records.append(e.record(with_body=True))
            else:
                heads.append(RECORD.pack(e.dst, e.seq, e.epoch, e.size, e.crc,
                                         F_LARGE if e.large else 0))
                if len(heads) == HEADS_PER_PART:
                    records.append([b"".join(heads)])
                    heads = []
        if heads:
            records.append([b"".join(heads)])
        return batch, records

    def unpersisted_again(self, batch: list[Entry]) -> None:
        """A batch from :meth:`take_unpersisted` that could not be written: it goes first
        in the next one."""
        self._unpersisted[:0] = batch

    def persisted(self, batch: list[Entry]) -> None:
        """Mark a batch from :meth:`take_unpersisted` as durable."""
        for e in batch:
            e.persisted = True
            e.body_persisted = self.flushes_body(e)

    def over_watermark(self) -> bool:
        """Bodies held exceed the high watermark: spill before the next send."""
        return self.held > self.high_watermark

    def spill_due(self) -> bool:
        """Bodies held exceed three quarters of the watermark: the background thread
        spills down to half of it, so that a steady sender rarely meets the watermark."""
        return self.held > self.high_watermark * 3 // 4

    def _goal(self, target: int | None) -> int:
        return self.high_watermark * 3 // 4 if target is None else target

    def spill_plan(self, target: int | None = None) -> list[Entry]:
        """Entries whose bodies must be written out before memory can shrink
        (oldest first) until the held bytes would fall to ``target`` (default: three
        quarters of the watermark)."""
        goal = self._goal(target)
        plan = []
        would = self.held
        for e in self._aged:
            if would <= goal:
                break
            if e.body is not None and e.persisted:
                if not e.body_persisted:
                    plan.append(e)
                would -= e.size
        return plan

    def spill(self, target: int | None = None) -> int:
        """Drop from memory the bodies that are durable (oldest first) until at most
        ``target`` (default: three quarters of the watermark) are held; returns the bytes
        freed."""
        goal = self._goal(target)
        freed = 0
        for e in self._aged:  # bodies only go: the deque itself changes after the loop
            if self.held <= goal:
                break
            if e.body is not None and e.body_persisted:
                self.held -= e.size
                freed += e.size
                self._drop_body(e)
                self.spilled += 1
        aged = self._aged
        while aged and aged[0].body is None:
            aged.popleft()
        return freed

    # --- collection and resend -------------------------------------------------------

    def raise_floor(self, dst: int, floor: int) -> int:
        """The receiver ``dst`` will never ask again for seq <= ``floor``: collect them.
        Returns how many entries went."""
        if floor <= self.floors.get(dst, 0):
            return 0
        self.floors[dst] = floor
        q = self.entries.get(dst)
        n = 0
        while q and q[0].seq <= floor and q[0].persisted:
            e = q.popleft()
            if e.body is not None:
                self.held -= e.size
                self._drop_body(e)
            n += 1
        return n

    def _drop_body(self, e: Entry) -> None:
        """Forget an entry's body; its arena room goes back."""
        if e.body is not None:
            self._bodies -= 1
        e.body = None
        if e.slot is not None and self.arena is not None:
            self.arena.release(e.slot)
            e.slot = None

    def after(self, dst: int, seq: int) -> list[Entry]:
        """Entries to ``dst`` with a sequence above ``seq`` (a resend or a replay).

        MessagingError if some of them were collected already (the receiver went back
        further than its oldest kept checkpoint): never replay a hole.
        """
        q = self.entries.get(dst, deque())
        want_from = seq + 1
        last = self.sent.get(dst, 0)
        if want_from > last:
            return []
        first = q[0].seq if q else last + 1
        if want_from < first:
            raise MessagingError(f"rank {dst} asks for messages from seq {want_from}, but "
                                 f"seq {want_from}..{first - 1} were collected (floor "
                                 f"{self.floors.get(dst, 0)})")
        # Entries are in seq order: find the first by bisection, not by a scan of a log
        # that may hold every message since the receiver's checkpoint.
        i = bisect.bisect_right(q, seq, key=lambda e: e.seq)
        return [q[j] for j in range(i, len(q))]

    def ahead_after(self, dst: int, seq: int) -> list[Entry]:
        """Entries to ``dst`` a lost incarnation logged past the restored checkpoint, from
        above ``seq`` (and above what this one sent), in order and without a hole.

        Re-execution would send them again, identical (the program is deterministic, its
        nondeterministic choices replayed from its determinants); sent now, a peer
        restored with this rank replays at once instead of waiting while this rank redoes
        its steps (seen: a restored rank waiting 1.5 s for a neighbour restored one
        checkpoint earlier). A copy that re-execution sends differently is refused by its
        receiver (NotDeterministic), as it is by every peer that got the original."""
        ahead = self.ahead.get(dst)
        if not ahead:
            return []
        out = []
        k = max(seq, self.sent.get(dst, 0)) + 1
        while k in ahead:
            out.append(ahead[k])
            k += 1
        return out

    def sent_vector(self) -> dict[int, int]:
        """Last seq per destination."""
        return dict(self.sent)

    def large_uncovered(self) -> list[Entry]:
        """Large entries whose receivers have not covered them (they go into a checkpoint)."""
        return [e for q in self.entries.values() for e in q if e.large]

    def reload(self, entries: Iterable[Entry], sent: dict[int, int],
               bodies: dict[tuple[int, int], bytes], floors: dict[int, int]) -> None:
        """After a restore: the persisted entries up to the checkpoint's sent vector and
        above the floors it had collected to, with large bodies from the checkpoint; later
        entries with their bodies are kept :attr:`ahead` (re-execution sends them again,
        a peer that asks meanwhile gets them from there: :meth:`ahead_after`)."""
        self.sent = {int(k): int(v) for k, v in sent.items()}
        self.floors = {int(k): int(v) for k, v in floors.items()}
        for q in self.entries.values():
            for gone in q:
                self._drop_body(gone)
        self.entries = {}
        self._aged, self._bodies = _queue(), 0
        self.ahead = {}
        self.held = 0
        best: dict[tuple[int, int], Entry] = {}
        for e in entries:
            if e.seq > self.sent.get(e.dst, 0):
                if e.body is not None:
                    newest = self.ahead.setdefault(e.dst, {}).get(e.seq)
                    if newest is None or e.epoch >= newest.epoch:
                        e.persisted = True
                        self.ahead[e.dst][e.seq] = e
            elif self.floors.get(e.dst, 0) < e.seq:
                old = best.get((e.dst, e.seq))
                if old is None or (old.body is None and e.body is not None):
                    best[(e.dst, e.seq)] = e
        for (dst, seq), e in sorted(best.items()):
            if e.body is None and (dst, seq) in bodies:
                e.body = bodies[(dst, seq)]
            e.persisted = True
            untrack(e)
            held = self.entries.get(dst)
            if held is None:
                held = self.entries[dst] = _queue()
            held.append(e)
            if e.body is not None:
                self.held += e.size
        # oldest first, as they were sent: by epoch, then seq
        self._aged = _queue(sorted((e for q in self.entries.values() for e in q
                                   if e.body is not None), key=lambda e: (e.epoch, e.seq)))
        self._bodies = len(self._aged)
        self._unpersisted = []
