"""A rank's first sends, the half of :class:`~raps_slurm.runtime.context.Context`'s
sending that :mod:`raps_slurm.runtime.links` does not do: a large message streamed into
the log as it goes out, the unlogged baseline's frames, and the CHECKSUMS frames that
follow large messages sent without their checksum."""

from __future__ import annotations

import time

from raps_slurm.runtime.frames import CHECKSUMS, DATA, HEADER, MAX_SUMS, SUM, encode
from raps_slurm.runtime.links import PeerLinks, _padding
from raps_slurm.runtime.msglog import ARENA_AT, Entry, MessagingError, checksum
from raps_slurm.runtime.transport import Outgoing
from raps_slurm.wire import datapath


class Sending(PeerLinks):
    """Sends of :class:`~raps_slurm.runtime.context.Context` beyond a logged entry's."""

    _records_pending: bool  # Context's: determinants to flush before the next send

    def send_small(self, dst: int, head: bytes, data: bytes | bytearray | memoryview) -> None:
        """:meth:`~raps_slurm.runtime.context.Context.send_parts` of a message given as
        ``head`` (the MPI envelope) and ``data``, for a message below
        :data:`~raps_slurm.runtime.msglog.ARENA_AT` bytes while nothing unusual goes on
        (the rank started, no decision to flush first, the log under its high watermark,
        a connection to ``dst`` open): the same steps in a fraction of the calls, since
        they are most of a short message's latency. The unlogged baseline takes the same
        lane (the benchmarks compare the two). Anything else goes the general way."""
        if (self._records_pending or not self._started or self._error is not None
                or self.drop_every or dst == self.rank or not 0 <= dst < self.size):
            self.send_parts(dst, [head, data])  # type: ignore[attr-defined]
            return
        n = len(head) + (data.nbytes if isinstance(data, memoryview) else len(data))
        if n >= ARENA_AT or n > self.s.max_message:
            self.send_parts(dst, [head, data])  # type: ignore[attr-defined]
            return
        body = head + data  # the log's copy (the application may change its buffer)
        e: Entry | None = None
        early = False
        with self._mu:
            log = self.log
            if not self.s.logging:
                seq = log.sent.get(dst, 0) + 1
                log.sent[dst] = seq
            elif log.over_watermark():
                seq = 0
            else:
                early = log.spill_due()
                e = log.append(dst, body, self.epoch, n)
                seq = e.seq
        if not seq:  # the spill fell behind: send_parts waits for it
            self.send_parts(dst, [head, data])  # type: ignore[attr-defined]
            return
        if early and not self._wake.is_set():
            self._wake.set()
        crc = checksum(body) if e is None else e.crc
        o = self._out.get(dst)  # as _outgoing's first look (a dict read is atomic)
        if o is not None:
            if e is not None:
                self._sent_frames += 1
            try:
                o.send_data(self.rank, dst, seq, self.epoch, crc, body)
                return
            except OSError:
                self._drop_out(dst, o)
                if e is not None:
                    return  # logged: sent again once connected (HELLO, RESEND)
        if e is None:  # unlogged: over a new connection, within recv_timeout
            self._send_unlogged(Entry(dst, seq, self.epoch, n, crc, False, None), [body])
        else:
            self._send_entry(e)

    def _send_streamed(self, e: Entry, parts: list[bytes | bytearray | memoryview]) -> None:
        """The first send of an entry :meth:`SenderLog.reserve` d: the frame goes out from
        ``parts`` while they are copied into the entry's room (wire/datapath.py), and the
        entry is published once its body is whole, whatever the send did (a frame lost
        with its connection is sent again as any other: HELLO, RESEND)."""
        assert isinstance(e.body, memoryview)
        filled = False  # send_logged fills the room whether it sends or fails
        crc: int | None = None  # send_logged's (datapath.send_frame)
        try:
            self._sent_frames += 1
            dropped = bool(self.drop_every and self._sent_frames % self.drop_every == 0)
            o = None if dropped else self._outgoing(e.dst)
            if o is not None:
                # No checksum in the frame: it is taken once the frame is out, off the
                # message's path, and follows in a CHECKSUMS frame.
                head = HEADER.pack(DATA, self.rank, e.dst, e.seq, self.epoch, e.size,
                                   0) + _padding(parts)
                try:
                    crc = o.send_logged(head, parts, e.body)
                    filled = True
                except OSError:
                    filled = True
                    self._drop_out(e.dst, o)
                    o = None
        finally:
            if not filled:
                crc = datapath.copy(e.body, parts)  # its CRC-32C where the copy takes it
            if crc is None:
                # From the application's buffer, as the copy was (the log's is cold:
                # written past the cache), before the send returns and it may change.
                crc = 0
                for p in parts:
                    crc = checksum(p, crc)
            e.crc = crc
            with self._mu:
                self.log.publish(e)
        if o is None or not self._send_sum(o, e.dst, [(e.seq, e.crc)]):
            with self._mu:  # the next tick sends it, on the next connection
                self._sums.setdefault(e.dst, []).append((e.seq, e.crc))

    def _send_unlogged(self, e: Entry, parts: list[bytes | bytearray | memoryview]) -> None:
        """The unlogged baseline keeps nothing to send again on a (re)connection: a frame
        (``e``'s header, then ``parts``) goes out only over a connection, waiting for the
        peer to listen (it may start later than this rank) and sending again over a new
        one if the old one broke (the receiver drops a duplicate by its seq).
        MessagingError after ``recv_timeout``."""
        deadline = self._clock() + self.s.recv_timeout
        frame: list[bytes | memoryview] = [
            HEADER.pack(DATA, self.rank, e.dst, e.seq, self.epoch, e.size, e.crc)
            + _padding(parts), *(memoryview(p).cast("B") for p in parts)]
        while True:
            o = self._outgoing(e.dst)
            if o is not None:
                try:
                    o.send(frame)
                    return
                except OSError:
                    self._drop_out(e.dst, o)
            if self._clock() >= deadline:
                raise MessagingError(f"rank {self.rank}: no connection to rank {e.dst} for "
                                     f"{self.s.recv_timeout:.0f}s (unlogged: seq {e.seq} "
                                     "cannot wait in a log)")
            time.sleep(0.01)

    def _send_sum(self, o: Outgoing, dst: int, pairs: list[tuple[int, int]]) -> bool:
        """Send ``dst`` the checksums of messages sent with none (at most
        :data:`MAX_SUMS`) over ``o``: a receiver compares a re-executed sender's with
        them. False if the connection broke."""
        chunk = b"".join(SUM.pack(q, c) for q, c in pairs)
        try:
            o.send(encode(CHECKSUMS, self.rank, dst, pairs[0][0], self.epoch, chunk, crc=0))
            return True
        except OSError:
            self._drop_out(dst, o)
            return False

    def _send_sums(self) -> None:
        """The checksums whose frame could not go right after their message's, over the
        next connection; a rank lost before that leaves its receivers none to compare."""
        with self._mu:
            pending, self._sums = self._sums, {}
        for dst, pairs in pending.items():
            for i in range(0, len(pairs), MAX_SUMS):
                o = self._outgoing(dst)
                if o is None or not self._send_sum(o, dst, pairs[i:i + MAX_SUMS]):
                    with self._mu:
                        self._sums.setdefault(dst, [])[:0] = pairs[i:]
                    break
