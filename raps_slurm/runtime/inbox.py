"""The receiver's side of message logging: per source, in-order delivery, duplicates,
gaps, and the checksums a re-executed sender's messages are compared with. No I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from raps_slurm.runtime.msglog import NotDeterministic


@dataclass
class _Source:
    next: int = 1
    # seq -> (crc, body)
    early: dict[int, tuple[int, bytes | memoryview | Placed]] = field(default_factory=dict)
    crcs: dict[int, int] = field(default_factory=dict)                 # delivered seq -> crc
    epoch: int = 0
    asked: int = 0  # a resend was requested up to this seq
    run: int = 0  # every seq from next to this one is here (in early, or delivered)
    placing: int = 0  # a seq being read straight into a receive's buffer ...
    placing_cid: int = 0  # ... on this connection
    trimmed: int = 0  # checksums up to this seq are forgotten (trim_checksums)


@dataclass(frozen=True)
class Placed:
    """A message whose first bytes are ``head`` and whose rest was read straight into
    ``tail``, the receive's own buffer (wire/framing.py, ``FrameReader.place``)."""

    head: bytes
    tail: memoryview

    def __bytes__(self) -> bytes:
        return self.head + bytes(self.tail)

    def __len__(self) -> int:
        return len(self.head) + self.tail.nbytes


def _differ(a: int, b: int) -> bool:
    """Two checksums of one message disagree (0 is none: it follows in a CHECKSUMS
    frame)."""
    return bool(a and b and a != b)


class Inbox:
    """The receiver's side: per source, in-order delivery, duplicates, gaps."""

    def __init__(self) -> None:
        self.sources: dict[int, _Source] = {}
        self.refused_epoch = 0
        self.duplicates = 0
        self.placed = 0  # messages read straight into a receive's buffer

    def _src(self, src: int) -> _Source:
        s = self.sources.get(src)
        if s is None:  # not setdefault: that made a _Source per call, three per message
            s = self.sources[src] = _Source()
        return s

    def delivered(self, src: int) -> int:
        """Last seq delivered from ``src``."""
        return self._src(src).next - 1

    def delivered_vector(self) -> dict[int, int]:
        """Last seq delivered per source."""
        return {s: v.next - 1 for s, v in self.sources.items() if v.next > 1}

    def set_epoch(self, src: int, epoch: int) -> bool:
        """Note the sender's newest epoch; False if ``epoch`` is older than known."""
        s = self._src(src)
        if epoch < s.epoch:
            return False
        s.epoch = epoch
        return True

    def can_place(self, src: int, seq: int, epoch: int) -> bool:
        """Whether a frame of ``src``'s ``seq`` just begun may be read straight into a
        receive's buffer: it is the next to deliver, and neither it nor another frame
        of it is already here or being read so."""
        s = self._src(src)
        return epoch >= s.epoch and seq == s.next and seq not in s.early and not s.placing

    def placing(self, src: int, seq: int, cid: int) -> None:
        """``src``'s ``seq`` is being read in place on connection ``cid``: a copy of it
        that comes on another connection meanwhile (a resend after a reconnection) is not
        delivered before this one has ended, whole or not (:meth:`cancel`): its bytes are
        going into the buffer the receive returns."""
        s = self._src(src)
        s.placing, s.placing_cid = seq, cid

    def cancel(self, cid: int) -> None:
        """Connection ``cid`` ended: a frame it was reading in place will not come whole."""
        for s in self.sources.values():
            if s.placing and s.placing_cid == cid:
                s.placing = s.placing_cid = 0

    def offer(self, src: int, seq: int, epoch: int, crc: int,
              body: bytes | memoryview | Placed) -> tuple[str, int, int]:
        """A data frame arrived: ``("ok"|"dup"|"stale", 0, 0)`` or ``("gap", first, last)``
        (ask the sender to resend first..last). NotDeterministic for a duplicate whose
        checksum differs from the delivered one. A :class:`Placed` body (read in place)
        replaces a copy that came meanwhile: the receive's buffer holds its bytes."""
        s = self._src(src)
        if isinstance(body, Placed) and s.placing == seq:
            s.placing = s.placing_cid = 0
            self.placed += 1
            if seq in s.early:
                if _differ(s.early[seq][0], crc):
                    raise NotDeterministic(f"rank {src} sent seq {seq} twice with "
                                           "different checksums: not piecewise deterministic")
                s.early[seq] = (crc or s.early[seq][0], body)
                return "ok", 0, 0
        if epoch < s.epoch:
            self.refused_epoch += 1
            return "stale", 0, 0
        s.epoch = epoch
        if seq < s.next:
            self.duplicates += 1
            self._compare(src, s, seq, crc)
            return "dup", 0, 0
        if seq in s.early:
            if _differ(s.early[seq][0], crc):
                raise NotDeterministic(f"rank {src} sent seq {seq} twice with different "
                                       f"checksums: not piecewise deterministic")
            return "dup", 0, 0
        s.early[seq] = (crc, body)
        # What came in order extends the run: a gap is looked for only past it (a scan
        # from ``next`` cost each frame the length of the queue a busy application had
        # not taken, quadratic in it: 10,000 unread messages took in 600 frames a second).
        run = max(s.run, s.next - 1)
        if seq == run + 1:
            run = seq
            while run + 1 in s.early:
                run += 1
        s.run = run
        lo = max(s.next, s.asked + 1, run + 1)
        if seq > lo:
            # Only seqs that have not arrived are a gap: those waiting in ``early`` for
            # the application to take them are not (asking for them again made the
            # sender resend every message that arrived while one was still unread).
            first = lo
            while first < seq and first in s.early:
                first += 1
            if first < seq:
                last = seq - 1
                while last in s.early:
                    last -= 1
                s.asked = seq - 1
                return "gap", first, last
        return "ok", 0, 0

    def pop(self, src: int) -> bytes | memoryview | Placed | None:
        """The next in-order message from ``src``, None if it has not arrived (or is
        still being read in place)."""
        s = self._src(src)
        if s.placing == s.next:
            return None
        got = s.early.pop(s.next, None)
        if got is None:
            return None
        if got[0]:  # else its CHECKSUMS frame gives it (it may have come already)
            s.crcs[s.next] = got[0]
        s.next += 1
        return got[1]

    def checksums(self, src: int, epoch: int, pairs: list[tuple[int, int]]) -> None:
        """A CHECKSUMS frame: the checksums of messages ``src`` sent with none in their
        frame, kept as the header's would be (a re-executed sender's are compared with
        the first ones). NotDeterministic if one differs from the one known."""
        s = self._src(src)
        if epoch < s.epoch:
            self.refused_epoch += 1
            return
        for seq, crc in pairs:
            # Only for a message that came (a CHECKSUMS frame follows its message): what a
            # peer makes this rank keep stays bounded by what it delivers.
            if seq > s.trimmed and (seq < s.next or seq in s.early):
                if seq in s.early and _differ(s.early[seq][0], crc):
                    raise NotDeterministic(f"rank {src} sent seq {seq} twice with different "
                                           "checksums: not piecewise deterministic")
                self._compare(src, s, seq, crc)
                s.crcs[seq] = crc

    def _compare(self, src: int, s: _Source, seq: int, crc: int) -> None:
        known = s.crcs.get(seq)
        if known is not None and _differ(known, crc):
            raise NotDeterministic(
                f"rank {src} re-sent seq {seq} with checksum {crc:08x}, but "
                f"{known:08x} was delivered: rank {src} is not piecewise deterministic")

    def trim_checksums(self, src: int, upto: int) -> None:
        """Forget delivered checksums up to ``upto`` (the sender's checkpoint passed them:
        a re-execution never sends them again)."""
        s = self._src(src)
        s.trimmed = max(s.trimmed, upto)
        for seq in [q for q in s.crcs if q <= upto]:
            del s.crcs[seq]

    def restore(self, delivered: dict[int, int]) -> None:
        """After a restore: continue after the checkpoint's delivered vector."""
        self.sources = {int(k): _Source(next=int(v) + 1) for k, v in delivered.items()}

    def waiting(self, src: int) -> bool:
        """A gap is open (early arrivals wait for a missing one)."""
        s = self._src(src)
        return bool(s.early) and s.next not in s.early
