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

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import crc32c

from raps_slurm.errors import RapsError
from raps_slurm.runtime.arena import Arena
from raps_slurm.runtime.lanes import (
    F_BODY,
    F_LARGE,
    R_LARGE,
    RECORD,
    ROW_BYTES,
    Chunk,
    Entry,
    Lane,
    checksum,
)
from raps_slurm.wire.datapath import untrack

# Entries, their records and checksums are defined with the lanes that hold them
__all__ = ["ARENA_AT", "F_BODY", "F_LARGE", "HEADS_PER_PART", "RECORD", "RUN_BYTES", "Batch",
           "Entry", "MessagingError", "NotDeterministic", "SenderLog", "checksum",
           "parse_records", "parts_size", "runs", "segments"]

ARENA_AT = 64 << 10  # copies of at least this many bytes go to the arena (smaller: heap)
# A flush writes each run of metadata records as one part of at most this many: a part
# each cost a writev entry and a pass of the segmenting and framing checks.
HEADS_PER_PART = 4096


class MessagingError(RapsError):
    """A message cannot be delivered correctly (named pair and sequence)."""


class NotDeterministic(MessagingError):
    """A re-executed send differs from what was delivered before: the rank is not
    piecewise deterministic."""


def parts_size(parts: Sequence[bytes | bytearray | memoryview]) -> int:
    """Bytes of ``parts`` joined (a memoryview's ``len`` counts its items, not bytes)."""
    n = 0
    for p in parts:
        n += p.nbytes if isinstance(p, memoryview) else len(p) if isinstance(
            p, bytes | bytearray) else memoryview(p).nbytes
    return n


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


def _queue(items: Iterable[Chunk | Entry] = ()) -> deque[Chunk | Entry]:
    """A deque of chunks and entries, out of the garbage collector's sight as they are: it
    and they are in no cycle (they hold numbers, buffers and arena rooms), and a full
    collection visited every entry of every such deque (datapath.untrack)."""
    q = deque(items)
    untrack(q)
    return q


def _alive(x: Chunk | Entry) -> bool:
    return not x.dead if isinstance(x, Chunk) else x.body is not None


Batch = list[tuple[Lane, int, int]]  # a flush's lanes and the seqs [lo, hi] it took of each


class SenderLog:
    """The sender's side: sequence numbers, the log (a :class:`Lane` per destination),
    flush batches, spilling, collection.

    :attr:`held` counts what the log takes in memory: its chunks, its rows
    (:data:`ROW_BYTES` each), the bodies of its other entries."""

    def __init__(self, *, large_threshold: int, high_watermark: int,
                 arena: Arena | None = None, own: int | None = None) -> None:
        self.large_threshold = large_threshold
        self.arena = arena
        self.own = own  # the rank itself: entries to it are determinants
        self.high_watermark = high_watermark
        self.sent: dict[int, int] = {}          # dst -> last seq
        self.lanes: dict[int, Lane] = {}
        self.floors: dict[int, int] = {}        # dst -> collectable up to
        self.held = 0                           # bytes in memory (see the class)
        self.peak = 0
        self.spilled = 0                        # messages written out under pressure
        self.reserved = 0                       # messages copied in as they were sent
        # Chunks and entries whose bodies are in memory, oldest first (a spill takes from
        # the left), and some gone since (dropped as a spill or _age() meets them): a
        # spill used to sort every entry twice, O(n log n) in Python per spill.
        self._aged: deque[Chunk | Entry] = _queue()
        self._live = 0  # items of _aged still alive
        # After a restore: what a lost incarnation logged past the checkpoint (dst -> seq
        # -> entry), sent to a peer that asks for it before re-execution sends it again
        self.ahead: dict[int, dict[int, Entry]] = {}

    def _lane(self, dst: int) -> Lane:
        lane = self.lanes.get(dst)
        if lane is None:
            lane = self.lanes[dst] = Lane(dst)
        return lane

    # --- sending ---------------------------------------------------------------------

    def append(self, dst: int, payload: bytes | bytearray | memoryview | list[
               bytes | bytearray | memoryview], epoch: int, size: int | None = None) -> Entry:
        """Log a message to ``dst`` (``payload``: the message, or its parts to join;
        ``size``: their bytes, when the caller knows); the entry carries its seq and
        checksum."""
        parts = payload if isinstance(payload, list) else [payload]
        if size is None:
            size = parts_size(parts)
        seq = self.sent.get(dst, 0) + 1
        if size < ARENA_AT and size <= self.large_threshold:
            # A copy into the lane's chunk (the application may change its buffer, and a
            # row costs less than an Entry); the Entry sent has its body as bytes, which a
            # small frame goes out fastest with (framing.send_parts).
            data = payload if isinstance(payload, bytes) else b"".join(parts)
            size = len(data)  # exactly what the chunk takes (a slice assignment resizes)
            crc = int(crc32c.crc32c(data))
            if self.ahead:
                self._next(dst, seq)
            else:  # the usual case, inline: a call costs as much as a row
                self.sent[dst] = seq
            lane = self.lanes.get(dst)
            if lane is None:
                lane = self._lane(dst)
            made = lane.add_small(seq, epoch, data, size, crc)
            held = self.held = self.held + ROW_BYTES + (
                self._age(made) if made is not None else 0)
            if held > self.peak:
                self.peak = held
            return Entry(dst, seq, epoch, size, crc, False, data)
        slot = None
        if isinstance(payload, bytes):
            kept: bytes | memoryview = payload  # immutable: a reference is enough
        elif self.arena is not None:
            kept, slot = self.arena.copy(parts)
        else:
            kept = b"".join(parts)
        e = Entry(dst, seq, epoch, size, checksum(kept), size > self.large_threshold, kept,
                  slot=slot)
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
            return self.append(dst, parts, epoch, size), False
        self.reserved += 1
        room, slot = got
        return Entry(dst, self.sent.get(dst, 0) + 1, epoch, size, 0,
                     size > self.large_threshold, room, slot=slot), True

    def publish(self, e: Entry) -> None:
        """``e`` (the next to its destination, its body not copied into a chunk) is
        logged: resent, spilled, collected."""
        if e.seq != self.sent.get(e.dst, 0) + 1:
            raise MessagingError(f"seq {e.seq} to rank {e.dst} logged after seq "
                                 f"{self.sent.get(e.dst, 0)}")
        self._next(e.dst, e.seq)
        # Held until a checkpoint covers it, and in no cycle: out of the collector's sight
        untrack(e)
        self._lane(e.dst).add_obj(e)
        self._grow(ROW_BYTES + (self._age(e) if e.body is not None else 0))

    def _next(self, dst: int, seq: int) -> None:
        self.sent[dst] = seq
        if self.ahead:
            ahead = self.ahead.get(dst)
            if ahead is not None:
                ahead.pop(seq, None)  # sent again by re-execution: from the log from now on
                if not ahead:
                    del self.ahead[dst]

    def _age(self, x: Chunk | Entry) -> int:
        """``x`` joins the spill order; its bytes."""
        self._aged.append(x)
        self._live += 1
        if len(self._aged) > 2 * self._live + 4096:  # collected ones pile up
            self._aged = _queue(y for y in self._aged if _alive(y))
        return len(x.buf) if isinstance(x, Chunk) else x.size

    def _grow(self, n: int) -> None:
        held = self.held = self.held + n
        if held > self.peak:
            self.peak = held

    def flushes_body(self, e: Entry) -> bool:
        """Whether a flush writes ``e`` with its body: only a determinant (an entry to
        the rank itself, which a re-execution reads back). A message's body reaches the
        log store when it spills or in a checkpoint: writing every message's bytes to a
        new file at each flush cost more CPU than sending them (2.5 ms per MiB on the test
        machine, docs/benchmarks.md), and a re-executed sender sends them again anyway."""
        return e.dst == self.own

    def take_unpersisted(self) -> tuple[Batch, list[list[bytes | memoryview]]]:
        """What to persist now and its records (determinants with their bodies, messages
        as metadata, a run of those joined in one item); call :meth:`persisted` with the
        batch once they are durable."""
        batch: Batch = []
        records: list[list[bytes | memoryview]] = []
        heads: list[bytes] = []  # a run of metadata records, written as one part
        pack = RECORD.pack
        for dst, lane in self.lanes.items():
            top = lane.last()
            if top is None or top <= lane.taken:
                continue
            own = dst == self.own
            seq, epoch, size, crc, flags = lane.seq, lane.epoch, lane.size, lane.crc, lane.flags
            for j in range(lane.index(lane.taken), len(seq)):
                if own:
                    if heads:
                        records.append([b"".join(heads)])
                        heads = []
                    records.append(lane.entry(j, True).record(with_body=True))
                    continue
                heads.append(pack(dst, seq[j], epoch[j], size[j], crc[j],
                                  F_LARGE if flags[j] & R_LARGE else 0))
                if len(heads) == HEADS_PER_PART:
                    records.append([b"".join(heads)])
                    heads = []
            batch.append((lane, lane.taken + 1, top))
            lane.taken = top
        if heads:
            records.append([b"".join(heads)])
        return batch, records

    def unpersisted_again(self, batch: Batch) -> None:
        """A batch from :meth:`take_unpersisted` that could not be written: the next one
        takes it again."""
        for lane, lo, _ in batch:
            lane.taken = min(lane.taken, lo - 1)

    def persisted(self, batch: Batch) -> None:
        """Mark a batch from :meth:`take_unpersisted` as durable."""
        for lane, lo, hi in batch:
            lane.durable = max(lane.durable, hi)
            own = lane.dst == self.own
            for s, e in lane.objs.items():
                if lo <= s <= hi:
                    e.persisted = True
                    e.body_persisted = e.body_persisted or own

    def over_watermark(self) -> bool:
        """The log's memory exceeds the high watermark: spill before the next send."""
        return self.held > self.high_watermark

    def spill_due(self) -> bool:
        """The log's memory exceeds three quarters of the watermark: the background
        thread spills down to half of it, so that a steady sender rarely meets the
        watermark."""
        return self.held > self.high_watermark * 3 // 4

    def _goal(self, target: int | None) -> int:
        return self.high_watermark * 3 // 4 if target is None else target

    def spill_plan(self, target: int | None = None) -> list[Chunk | Entry]:
        """Chunks and entries to write out (oldest first, their metadata durable) before
        memory can shrink to ``target`` bytes (default: three quarters of the watermark).
        A chunk in the plan takes no more bodies."""
        goal = self._goal(target)
        plan: list[Chunk | Entry] = []
        would = self.held
        for x in self._aged:
            if would <= goal:
                break
            if isinstance(x, Chunk):
                if x.dead or x.last > self.lanes[x.dst].durable:
                    continue
                x.sealed = True
                if not x.written:
                    plan.append(x)
                would -= x.cost()
            elif x.body is not None and x.persisted:
                if not x.body_persisted:
                    plan.append(x)
                would -= x.size
        return plan

    def spill_records(self, plan: list[Chunk | Entry]) -> Iterator[list[bytes | memoryview]]:
        """The log-store records of a :meth:`spill_plan`: each message with its body."""
        for x in plan:
            if isinstance(x, Entry):
                yield x.record(with_body=True)
                continue
            lane = self.lanes[x.dst]
            for j in lane.chunk_rows(x):
                yield [RECORD.pack(x.dst, lane.seq[j], lane.epoch[j], lane.size[j],
                                   lane.crc[j], F_BODY), lane.body(j)]

    def spill_written(self, plan: list[Chunk | Entry]) -> None:
        """A :meth:`spill_plan`'s records are durable."""
        for x in plan:
            if isinstance(x, Chunk):
                x.written = True
            else:
                x.body_persisted = True

    def spill(self, target: int | None = None) -> int:
        """Drop from memory what is durable with its body (oldest first) until at most
        ``target`` bytes (default: three quarters of the watermark) are held; returns the
        bytes freed."""
        goal = self._goal(target)
        freed = 0
        for x in self._aged:  # items only die: the deque itself changes after the loop
            if self.held <= goal:
                break
            if isinstance(x, Chunk):
                lane = self.lanes.get(x.dst)
                if x.dead or not x.written or lane is None or lane.chunks[0] is not x:
                    continue
                n = len(x.buf) + lane.spill(x)
                self._live -= 1
                self.spilled += x.rows
            elif x.body is not None and x.body_persisted:
                n = x.size
                self._drop_body(x)
                self.spilled += 1
            else:
                continue
            self.held -= n
            freed += n
        aged = self._aged
        while aged and not _alive(aged[0]):
            aged.popleft()
        return freed

    # --- collection and resend -------------------------------------------------------

    def raise_floor(self, dst: int, floor: int) -> int:
        """The receiver ``dst`` will never ask again for seq <= ``floor``: collect them.
        Returns how many entries went."""
        if floor <= self.floors.get(dst, 0):
            return 0
        self.floors[dst] = floor
        lane = self.lanes.get(dst)
        if lane is None:
            return 0
        n, rows, gone, dead = lane.collect(floor)
        self.held -= rows
        for e in gone:
            if e.body is not None:
                self.held -= e.size
                self._drop_body(e)
        for c in dead:
            self.held -= len(c.buf)
            self._live -= 1
        return n

    def _drop_body(self, e: Entry) -> None:
        """Forget an entry's body; its arena room goes back."""
        if e.body is not None:
            self._live -= 1
        e.body = None
        if e.slot is not None and self.arena is not None:
            self.arena.release(e.slot)
            e.slot = None

    def after(self, dst: int, seq: int) -> list[Entry]:
        """Entries to ``dst`` with a sequence above ``seq`` (a resend or a replay); one
        whose body is only in the log store has neither body nor checksum (the caller
        reads it there).

        MessagingError if some of them were collected already (the receiver went back
        further than its oldest kept checkpoint): never replay a hole.
        """
        want_from = seq + 1
        last = self.sent.get(dst, 0)
        if want_from > last:
            return []
        lane = self.lanes.get(dst)
        first = lane.first() if lane is not None else None
        if lane is None or first is None or want_from < first:
            first = last + 1 if first is None else first
            raise MessagingError(f"rank {dst} asks for messages from seq {want_from}, but "
                                 f"seq {want_from}..{first - 1} were collected (floor "
                                 f"{self.floors.get(dst, 0)})")
        return list(lane.entries(seq, dst == self.own))

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

    def count(self) -> int:
        """Messages held (in memory or only in the log store), not yet collected."""
        return sum(len(lane) for lane in self.lanes.values())

    def held_range(self, dst: int) -> list[int] | None:
        """The first and last seq held to ``dst``, None if none."""
        lane = self.lanes.get(dst)
        first = lane.first() if lane is not None else None
        return None if lane is None or first is None else [first, lane.last() or first]

    def snapshot(self) -> list[Lane]:
        """Copies of the lanes (a checkpoint reads them outside the rank's lock)."""
        return [lane.snapshot() for lane in self.lanes.values()]

    def large_uncovered(self) -> list[Entry]:
        """Large entries whose receivers have not covered them (they go into a checkpoint)."""
        return [e for lane in self.lanes.values() for e in lane.objs.values() if e.large]

    def reload(self, entries: Iterable[Entry], sent: dict[int, int],
               bodies: dict[tuple[int, int], bytes], floors: dict[int, int]) -> None:
        """After a restore: the persisted entries up to the checkpoint's sent vector and
        above the floors it had collected to, with large bodies from the checkpoint; later
        entries with their bodies are kept :attr:`ahead` (re-execution sends them again,
        a peer that asks meanwhile gets them from there: :meth:`ahead_after`)."""
        self.sent = {int(k): int(v) for k, v in sent.items()}
        self.floors = {int(k): int(v) for k, v in floors.items()}
        for lane in self.lanes.values():
            for c in lane.chunks:
                c.dead = True
            for gone in lane.objs.values():
                self._drop_body(gone)
        self.lanes, self._aged, self._live = {}, _queue(), 0
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
            lane = self._lane(dst)
            if (e.body is not None and e.slot is None and not e.large
                    and e.size < ARENA_AT and e.size <= self.large_threshold):
                body = bytes(e.body)
                made = lane.add_small(seq, e.epoch, body, len(body), e.crc)
                self._grow(ROW_BYTES + (self._age(made) if made is not None else 0))
            else:
                e.persisted = True
                untrack(e)
                lane.add_obj(e)
                self._grow(ROW_BYTES + (self._age(e) if e.body is not None else 0))
            lane.taken = lane.durable = seq
