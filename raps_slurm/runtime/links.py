"""A rank's links to its peers, the half of :class:`~raps_slurm.runtime.context.Context`
below the application API: connections and HELLOs, logged entries sent and sent again,
the frames that come in, and the background threads that flush the log to the port and
tell peers what was delivered."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raps_slurm.checkpoint.logstore import MAX_SEGMENT
from raps_slurm.runtime.arena import Arena
from raps_slurm.runtime.frames import (
    CHECKSUMS,
    COVERED,
    DATA,
    DELIVERED,
    HEADER,
    HELLO,
    PAD_AT,
    PROGRESS,
    RESEND,
    SENT_FLOOR,
    Frame,
    encode,
    pad,
    sums,
)
from raps_slurm.runtime.inbox import Inbox, Placed
from raps_slurm.runtime.msglog import (
    RUN_BYTES,
    Entry,
    MessagingError,
    NotDeterministic,
    SenderLog,
    checksum,
    parse_records,
    parts_size,
    runs,
    segments,
)
from raps_slurm.runtime.ports import Port
from raps_slurm.runtime.transport import Listener, Outgoing
from raps_slurm.wire import datapath, framing

if TYPE_CHECKING:
    from raps_slurm.runtime.context import Settings

log = logging.getLogger("raps.runtime")
_LEAD = framing.HEADER.size + HEADER.size  # stream bytes of a frame before its payload
# s a first incarnation waits for a lower rank's connection before it opens its own: a
# lower rank opens its connections to the higher ones when it starts (its first send or
# receive), so when it runs at all they come within milliseconds.
CONNECT_GRACE = 0.5
AWAIT_MAX = 0.5  # s a receive waits at a time before it checks its deadline again
DONE = float("-inf")  # in _deferred: the grace is over


def _padding(parts: list[bytes | bytearray | memoryview] | list[bytes | memoryview]
             ) -> bytes:
    """The padding (frames.pad) of a DATA frame sent from ``parts``: none unless its
    last part (the application's buffer) is large."""
    last = parts[-1]
    # a small message's hot path: its size in one step (a memoryview's len counts items)
    if (last.nbytes if isinstance(last, memoryview) else len(last)) < PAD_AT:
        return b""
    return pad(_LEAD + parts_size(parts[:-1]), datapath.address(last))


class PeerLinks:
    """The links half of :class:`~raps_slurm.runtime.context.Context` (which sets these
    attributes in its ``__init__`` and provides ``stats``)."""

    port: Port
    rank: int
    size: int
    epoch: int
    s: Settings
    log: SenderLog
    arena: Arena | None
    inbox: Inbox
    listener: Listener
    refused_hellos: int
    resent: int
    drop_every: int
    _clock: Callable[[], float]
    _mu: threading.Lock
    _out: dict[int, Outgoing]
    _out_lock: threading.Lock
    _deferred: dict[int, float]  # lower rank -> until when we wait for its connection
    _dialing: dict[int, threading.Lock]  # dst -> held while a connection to it is made
    _peer_epoch: dict[int, int]
    _hello_cids: dict[int, int]
    _error: MessagingError | None
    _work: queue.Queue[Callable[[], None] | None]
    _started: bool
    _closed: bool
    _persisted_bodies: dict[tuple[int, int], Entry] | None
    _gaps: dict[int, tuple[int, int]]
    _flush_lock: threading.Lock
    _wake: threading.Event
    _blocked: dict[int, float]
    _sums: dict[int, list[tuple[int, int]]]  # dst -> (seq, crc) not sent yet (sending.py)
    _send_sums: Callable[[], None]  # sends those (sending.py)
    _relay_progress: Callable[[], None]  # PROGRESS while this rank waits (receiving.py)
    _acked: dict[int, int]
    _floor_epoch: dict[int, int]
    _pending_hellos: dict[int, tuple[int, int]]
    _confirmed: dict[int, int]
    _sent_frames: int
    _peer_had: dict[int, int]
    _heard: dict[int, tuple[int, int, float]]
    _unsendable: set[tuple[int, int]]  # (dst, seq) refused at a resend, escalated
    _relayed: float
    segment_limit: int = MAX_SEGMENT  # bytes of one log-store write (the store's bound)

    def stats(self) -> dict[str, Any]:
        """Sent, delivered, logged and collected ranges per peer (Context)."""
        raise NotImplementedError

    # --- connections -----------------------------------------------------------------

    def _start(self) -> None:
        if self._started:  # every send and receive comes here: no lock once started
            return
        with self._mu:
            if self._started:
                return
            self._started = True
            pending, self._pending_hellos = self._pending_hellos, {}
        for p in range(self.size):
            if p != self.rank:
                self._work.put(lambda p=p: self._hello(p))  # type: ignore[misc]
        for src, (seq, epoch) in pending.items():
            self._work.put(lambda s=src, q=seq, e=epoch: self._resend(s, q, epoch=e))  # type: ignore[misc]

    def _outgoing(self, dst: int) -> Outgoing | None:
        """The connection to send to ``dst`` over: the one in use, else ``dst``'s own to
        this rank (one TCP connection per pair: a message's ACK rides on the answer
        instead of costing a packet of its own), else a new one. A first incarnation
        waits up to :data:`CONNECT_GRACE` for a lower rank's connection (each rank opens
        those to the ranks above it when it starts) before it opens its own; None
        meanwhile, the message waiting in the log as for a peer not reachable yet."""
        with self._out_lock:
            o = self._out.get(dst)
        if o is not None:
            return o
        # One thread at a time makes it: two connections at once (a send and the
        # greeting) left the peer answering over the one that was closed.
        with self._dialing.setdefault(dst, threading.Lock()):
            with self._out_lock:
                o = self._out.get(dst)
            if o is not None:
                return o
            return self._open(dst)

    def _open(self, dst: int) -> Outgoing | None:
        known = self._peer_epoch.get(dst, 0)
        where = None
        if self._deferred.get(dst, DONE) > self._clock():
            o = self.listener.reverse(dst, known)  # no lookup per message meanwhile
        else:
            where = self.port.lookup(dst)
            o = self.listener.reverse(dst, max(known, where[2] if where is not None else 0))
        if o is not None:
            self._deferred[dst] = DONE
        else:
            if where is None:
                return None
            host, port_no, epoch, _ = where
            if epoch < known:
                return None  # not published yet by the newer incarnation
            if dst < self.rank and self.epoch == epoch == 1 and dst not in self._deferred:
                self._deferred[dst] = self._clock() + CONNECT_GRACE
                return None  # the ticker tries again once it is over
            try:
                o = self.listener.connect((host, port_no), epoch, dst)
            except OSError:
                return None
        with self._mu:
            delivered = self.inbox.delivered(dst)
        try:
            o.send(encode(HELLO, self.rank, dst, delivered, self.epoch))
        except OSError:
            o.close()
            return None
        with self._out_lock:
            old = self._out.get(dst)
            if old is not None:  # another thread connected first
                if not o.theirs:  # theirs stays open: the peer sends over it
                    o.close()
                return old
            self._out[dst] = o
        return o

    def _drop_out(self, dst: int, o: Outgoing | None = None, *, below: int = 0) -> None:
        """Close the connection we send to ``dst`` over (only if it is ``o``; only if
        its peer's epoch is below ``below``: one to the new incarnation may be in use
        already)."""
        with self._out_lock:
            cur = self._out.get(dst)
            if cur is not None and (o is None or cur is o) and (
                    not below or cur.peer_epoch < below):
                del self._out[dst]
                cur.close()

    def _send_entry(self, e: Entry, *, again: bool = False) -> None:
        """Send a logged entry; ``again`` (a resend or a replay): its body is checked
        against the checksum it was logged with first (a frame carries no MAC under
        ``frame_mac: control``, and a body kept in memory or on disk for minutes must not
        reach the receiver changed)."""
        body = e.body
        if body is None:
            stored = self._persisted().get((e.dst, e.seq))  # checked as it is parsed
            if stored is None:
                raise MessagingError(f"rank {self.rank}: body of seq {e.seq} to rank {e.dst} "
                                     "is neither in memory nor in the log store")
            e, body = stored, stored.body  # a spilled message: its checksum is there too
            assert body is not None  # _persisted() keeps the records that carry bodies
        elif again and checksum(body) != e.crc:
            raise MessagingError(f"rank {self.rank}: logged body of seq {e.seq} to rank "
                                 f"{e.dst} does not match its checksum: not replayed")
        self._sent_frames += 1
        if self.drop_every and self._sent_frames % self.drop_every == 0:
            return  # test knob: as if the network lost it
        o = self._outgoing(e.dst)
        if o is None:
            return  # logged; the peer gets it when it (re)connects
        try:
            # The frame carries this incarnation's epoch (a resend of an entry an earlier
            # incarnation logged is sent by this one, and fencing is about the sender).
            frame = encode(DATA, self.rank, e.dst, e.seq, self.epoch, body, crc=e.crc)
            if e.size >= PAD_AT:  # a small message's frame goes as it is
                frame[0] = bytes(frame[0]) + _padding(frame[1:])
            o.send(frame)
        except OSError:
            self._drop_out(e.dst, o)

    def _control(self, dst: int, kind: int, seq: int, last: int = 0) -> None:
        o = self._outgoing(dst)
        if o is None:
            return
        try:
            o.send(encode(kind, self.rank, dst, seq, self.epoch, length=last, crc=0))
        except OSError:
            self._drop_out(dst, o)

    def _hello(self, dst: int) -> None:
        """Say HELLO to ``dst`` (what we delivered from it): a new connection starts with
        one; on an existing connection it is sent again, so that a peer that greeted us
        before it could resend anything (before its own restore) hears from us now."""
        with self._out_lock:
            existing = self._out.get(dst)
        o = self._outgoing(dst)
        if o is None or o is not existing:
            return
        with self._mu:
            delivered = self.inbox.delivered(dst)
        try:
            o.send(encode(HELLO, self.rank, dst, delivered, self.epoch))
        except OSError:
            self._drop_out(dst, o)

    def _resend(self, dst: int, after: int, last: int | None = None,
                epoch: int | None = None) -> None:
        if not self.s.logging:
            return  # the unlogged baseline keeps nothing to resend
        err: MessagingError | None = None
        with contextlib.ExitStack() as pinned:
            with self._mu:
                if self.arena is not None:
                    # The bodies sent below are read outside the lock: room a spill or a
                    # collection frees meanwhile must not take a new message's bytes.
                    pinned.enter_context(self.arena.pin())
                floor = self.log.floors.get(dst, 0)
                if after < floor and (epoch is None
                                      or epoch <= self._floor_epoch.get(dst, 0)):
                    # A request older than the floor the same incarnation reported since
                    # (a HELLO overtaken by its COVERED): nothing below it is wanted.
                    after = floor
                entries: list[Entry] | None
                try:
                    entries = self.log.after(dst, after) + self.log.ahead_after(dst, after)
                except MessagingError as exc:
                    err, entries = exc, None
            self._resend_entries(dst, entries, last, err)

    def _resend_entries(self, dst: int, entries: list[Entry] | None, last: int | None,
                        err: MessagingError | None) -> None:
        """:meth:`_resend`'s sends (``entries`` None: ``err`` says why none can be)."""
        if entries is None:
            log.error("rank %d: %s", self.rank, err)
            # Recorded, but no requeue asked: this sender is not stuck, and the request it
            # could not serve may be a stale one that a later request from the same
            # receiver supersedes (seen: a run requeued while its replay went on to
            # succeed). A real hole leaves the receiver's plan short of caught_up, and
            # recovery_timeout_sec escalates that.
            self.port.escalate(f"rank {self.rank} cannot replay to rank {dst}: {err}",
                               requeue=False)
            return
        for e in entries:
            if last is not None and e.seq > last:
                break
            self.resent += 1
            try:
                self._send_entry(e, again=True)
            except MessagingError as exc:
                with self._mu:
                    collected = e.seq <= self.log.floors.get(dst, 0)
                if collected:
                    # COVERED came meanwhile and the body went with it: the receiver
                    # needs it no more.
                    continue
                if (dst, e.seq) not in self._unsendable:  # the receiver asks again and again
                    self._unsendable.add((dst, e.seq))
                    log.error("%s", exc)
                    self.port.escalate(str(exc))
                return

    # --- incoming --------------------------------------------------------------------

    def _await(self, left: float) -> None:
        """Wait (``_mu`` held) until a frame came, reading the connections on this
        thread (runtime/pump.py), at most ``left`` s (:data:`AWAIT_MAX` at a time, so that
        the caller's checks run)."""
        pump = self.listener.pump
        since = pump.events  # read holding _mu: what was handled so far, the caller saw
        self._mu.release()
        try:
            pump.wait(min(left, AWAIT_MAX), since)
        finally:
            self._mu.acquire()

    def poll(self) -> None:
        """Take in the frames that have come, without waiting (a program that polls with
        :meth:`try_recv` calls it first; they come anyway within 10 ms)."""
        self.listener.pump.poll()


    def _on_frame(self, f: Frame, cid: int) -> None:
        if f.dst != self.rank or not 0 <= f.src < self.size:
            return
        if f.kind == HELLO:
            with self._mu:
                known = self._peer_epoch.get(f.src, 0)
                if f.epoch < known:
                    self.refused_hellos += 1
                    stale = True
                else:
                    stale = False
                    if f.epoch > known:
                        self._progress(f.src, f.epoch, 0)  # a new incarnation: it restored
                    self._peer_epoch[f.src] = f.epoch
                    self.inbox.set_epoch(f.src, f.epoch)
                    self._peer_had[f.src] = max(self._peer_had.get(f.src, 0), f.seq)
                    new_conn = cid not in self._hello_cids
                    self._hello_cids[cid] = f.src
                    if new_conn:
                        self._confirmed.pop(f.src, None)  # tell this incarnation again
            if stale:
                log.warning("rank %d: refused rank %d epoch %d (epoch %d is current)",
                            self.rank, f.src, f.epoch, known)
                self.listener.drop(cid)
                return
            if f.epoch > known and known:
                self._drop_out(f.src, below=f.epoch)  # it moved: reconnect to it
            if new_conn and self._started:
                # Not before restore(): our HELLO says what we delivered, which a restore
                # is about to change (_start greets every peer afterwards).
                self._work.put(lambda: self._hello(f.src))
            with self._mu:
                if not self._started:
                    # Our log is not reloaded yet: answer once restore() is done.
                    self._pending_hellos[f.src] = (f.seq, f.epoch)
                    return
            self._work.put(lambda: self._resend(f.src, f.seq, epoch=f.epoch))
            return
        if f.kind == DATA:
            self._on_data(f.src, f.seq, f.epoch, f.crc, f.payload if f.placed is None
                          else Placed(bytes(f.payload), f.placed), cid)
            return
        with self._mu:
            if self._hello_cids.get(cid) != f.src:
                return  # no HELLO on this connection: not a peer we know
        if f.kind == RESEND:  # length: last seq wanted, 0 = everything after
            self._work.put(lambda: self._resend(f.src, f.seq - 1, f.length or None))
        elif f.kind == DELIVERED:
            with self._mu:
                if f.seq > self._acked.get(f.src, 0):
                    self._acked[f.src] = f.seq
        elif f.kind == COVERED:
            with self._mu:
                self.log.raise_floor(f.src, f.seq)
                self._floor_epoch[f.src] = max(self._floor_epoch.get(f.src, 0), f.epoch)
        elif f.kind == SENT_FLOOR:
            with self._mu:
                self.inbox.trim_checksums(f.src, f.seq)
        elif f.kind == CHECKSUMS:
            try:
                with self._mu:
                    self.inbox.checksums(f.src, f.epoch, sums(f.payload))
            except NotDeterministic as exc:
                with self._mu:
                    self._error = exc
                why = str(exc)
                log.error("rank %d: %s", self.rank, why)
                self._work.put(lambda: self.port.escalate(why))
        elif f.kind == PROGRESS:
            with self._mu:
                e, q, at = self._heard.get(f.src, (0, 0, 0.0))
                origin = self._clock() - f.seq / 1000
                if origin > at:
                    self._heard[f.src] = (e, q, origin)

    def _on_data(self, src: int, seq: int, epoch: int, crc: int,
                 payload: bytes | memoryview | Placed, cid: int) -> None:
        """A DATA frame from ``src`` on connection ``cid`` (its header checked against the
        connection's handshake: transport.Listener._body). Whoever waits for it learns
        from the pump that a frame was handled."""
        if not 0 <= src < self.size:
            return
        with self._mu:
            if self._hello_cids.get(cid) != src:
                return  # no HELLO on this connection: not a peer we know
            self._progress(src, epoch, seq)
            try:
                verdict, first, last = self.inbox.offer(src, seq, epoch, crc, payload)
            except NotDeterministic as exc:
                self._error = exc
                verdict, reason = "error", str(exc)  # this frame's: another may follow
        if verdict == "ok":
            return
        if verdict == "error":
            log.error("rank %d: %s", self.rank, reason)
            self._work.put(lambda: self.port.escalate(reason))
        elif verdict == "gap" and self._started:
            self._work.put(lambda: self._control(src, RESEND, first, last))

    def _progress(self, src: int, epoch: int, seq: int) -> None:
        """Note (``_mu`` held) a frame from ``src``: a seq (or epoch) beyond any heard
        before is progress, even a duplicate: a relaunched peer re-executing its lost work
        sends again what this rank has had, in order. A receive waits for a peer as long as
        it progresses (:meth:`heard_at`)."""
        e, q, _ = self._heard.get(src, (0, 0, 0.0))
        if (epoch, seq) > (e, q):
            self._heard[src] = (epoch, seq, self._clock())

    def _on_close(self, cid: int) -> None:
        with self._mu:
            self._hello_cids.pop(cid, None)
            self.inbox.cancel(cid)
        with self._out_lock:  # the connection we sent over, if it was this one
            gone = [dst for dst, o in self._out.items() if o.cid == cid]
            for dst in gone:
                del self._out[dst]

    # --- background ------------------------------------------------------------------

    def _worker(self) -> None:
        while (job := self._work.get()) is not None:
            try:
                job()
            except Exception:
                if not self._closed:
                    log.exception("rank %d: messaging worker", self.rank)

    def _ticker(self) -> None:
        period = self.s.flush_ms / 1000
        next_stats = self._clock() + self.s.stats_interval
        while not self._closed:
            if self._clock() >= next_stats:
                next_stats = self._clock() + self.s.stats_interval
                try:
                    self.port.report(self.stats())
                except Exception as exc:
                    log.debug("rank %d: stats not reported: %s", self.rank, exc)
            self._wake.wait(period)
            self._wake.clear()
            if self._closed:
                return
            try:
                self._flush()
                self._send_sums()
                self._connect_deferred()
                with self._mu:
                    due = self.log.spill_due()
                if due:
                    # Off the sender's path: it writes while the application goes on.
                    self._spill(self.s.high_watermark // 2)
                if self._started:  # before restore() our delivered vector is not known
                    self._reask()
                    self._confirm()
                    self._relay_progress()
            except Exception as exc:
                if not self._closed:
                    log.warning("rank %d: log flush failed: %s", self.rank, exc)

    def _connect_deferred(self) -> None:
        """Greet each lower rank whose connection did not come within
        :data:`CONNECT_GRACE` over one of our own (its answer brings what waits in the
        log: HELLO, then a resend)."""
        now = self._clock()
        for dst, until in list(self._deferred.items()):
            if until != DONE and now >= until:
                self._deferred[dst] = DONE
                self._work.put(lambda d=dst: self._hello(d))  # type: ignore[misc]

    def _flush(self) -> None:
        # The disk write happens outside _mu (sends and the readers go on); the
        # flush lock keeps batches in order. Entries count as persisted once durable.
        with self._flush_lock:
            with self._mu:
                batch, records = self.log.take_unpersisted()
            if not records:
                return
            try:
                self._append(records)
            except BaseException:
                with self._mu:  # the next flush writes them again (a reload keeps one)
                    self.log.unpersisted_again(batch)
                raise
            with self._mu:
                self.log.persisted(batch)
                self._persisted_bodies = None

    def _spill(self, target: int | None = None) -> None:
        """Persist what must be, then drop bodies from memory down to ``target`` bytes
        (default: three quarters of the high watermark)."""
        self._flush()
        with self._flush_lock:
            pinned = contextlib.ExitStack()
            with self._mu:
                plan = self.log.spill_plan(target)
                records = list(runs(self.log.spill_records(plan),
                                    min(RUN_BYTES, self.segment_limit)))
                if self.arena is not None:  # a body collected meanwhile stays whole
                    pinned.enter_context(self.arena.pin())
            with pinned:
                self._append(records)
            with self._mu:
                self.log.spill_written(plan)
                self._persisted_bodies = None
                self.log.spill(target)

    def _append(self, records: list[list[bytes | memoryview]]) -> None:
        """Write records to the log store, as many segments as its size bound needs (a
        100 ms batch of 1 MiB messages or a spill of 1 GiB is more than one)."""
        for seg in segments(records, self.segment_limit):
            self.port.log_append(seg)

    def _persisted(self) -> dict[tuple[int, int], Entry]:
        """The log store's entries that carry their bodies, by destination and seq."""
        if self._persisted_bodies is None:
            self._persisted_bodies = {(e.dst, e.seq): e for e in
                                      parse_records(self.port.log_read()) if e.body is not None}
        return self._persisted_bodies

    def _confirm(self) -> None:
        """Tell each source how far this rank has delivered (a sender's finalize waits
        for it, and it ends a resend of a lost last frame)."""
        with self._mu:
            now = self.inbox.delivered_vector()
            changed = {s: v for s, v in now.items() if self._confirmed.get(s) != v}
        for src, seq in changed.items():
            self._control(src, DELIVERED, seq)
            self._confirmed[src] = seq

    def _reask(self) -> None:
        # A gap still open one tick after it was seen is asked for again: the first
        # request (or the resend) may have been lost with a connection.
        with self._mu:
            gaps = {src: (s.next, min(s.early) - 1) for src, s in self.inbox.sources.items()
                    if s.early and s.next not in s.early}
            again = {src: g for src, g in gaps.items() if self._gaps.get(src) == g}
            self._gaps = gaps
            # A recv blocked for a while with no gap in sight may wait for a message whose
            # frame was the sender's last one and got lost: ask for everything after.
            now = self._clock()
            stuck = [(src, self.inbox.delivered(src) + 1) for src, since in self._blocked.items()
                     if src not in gaps and now - since > 3 * self.s.flush_ms / 1000]
            for src, _ in stuck:
                self._blocked[src] = now
        for src, (first, last) in again.items():
            self._control(src, RESEND, first, last)
        for src, first in stuck:
            self._control(src, RESEND, first, 0)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error
