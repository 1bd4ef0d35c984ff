"""The rank's runtime context: send/recv with sender-based logging, checkpoints that agree
with the logs, restore and replay.

Semantics an application relies on (docs/messaging.md):
- a rank must be *piecewise deterministic*: given the same messages in the same order it
  sends the same messages; ``recv`` names its source (no any-source receive), so the
  order is fixed by the program;
- ``send`` never waits for a peer (nor for its checkpoint): it logs the message and
  writes it to the peer's connection if there is one; a peer that is down gets it when
  it comes back. It blocks only for a local disk write when the log is over its high
  watermark (``messagelog.buffer_high_watermark_mb``): the log then *spills*;
- ``recv`` returns messages from one source in the order they were sent, exactly once,
  across failures of either side; it gives up after ``recv_timeout`` in which the source
  made no progress (no frame with a seq beyond those it sent before: a relaunched source
  re-executing its lost work re-sends in order), with an error naming the pair and the
  sequence it waits for, and reports it to the agent. An explicit ``timeout`` is wall
  time.

Connections, incoming frames and the background flushes: :mod:`raps_slurm.runtime.links`;
receives: :mod:`raps_slurm.runtime.receiving`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from raps_slurm.core.launch import LOST_EXIT, PREEMPTED_EXIT
from raps_slurm.errors import RapsError
from raps_slurm.runtime.arena import Arena
from raps_slurm.runtime.frames import COVERED, MAX_MESSAGE, SENT_FLOOR
from raps_slurm.runtime.inbox import Inbox
from raps_slurm.runtime.lanes import Lane
from raps_slurm.runtime.msglog import (
    ARENA_AT,
    Entry,
    MessagingError,
    SenderLog,
    checksum,
    parse_records,
    parts_size,
)
from raps_slurm.runtime.ports import Port
from raps_slurm.runtime.rankauth import Auth
from raps_slurm.runtime.receiving import Receiving
from raps_slurm.runtime.transport import Listener, Outgoing

# A relaunched rank redoes about one interval of lost steps at most, but may first wait
# for neighbours restored after it (up to 4.3 s in the recovery benchmark's traces).
REPLAY_DEFER_INTERVALS = 3

log = logging.getLogger("raps.runtime")

STATE_ITEM = "\0raps/state"
LARGE_PREFIX = "\0raps/large/"
# The log entries receivers may still ask for, inside the checkpoint (small ones with
# their bodies, large ones as headers): a node lost together with its log backup, or a
# log pulled only in part, leaves them in the checkpoint's copies.
LOG_ITEM = "\0raps/log"
CLOSE_WAIT = 10.0  # seconds close() waits for a flush in progress (one log-store write)


@dataclass(frozen=True)
class Settings:
    """Runtime knobs (from the config / environment)."""

    flush_ms: int = 100
    large_threshold: int = 4096 * 1024
    buffer_bytes: int = 256 << 20
    high_watermark: int = 192 << 20
    checkpoint_interval: float = 600.0
    max_generations: int = 5
    recv_timeout: float = 600.0
    host: str = "127.0.0.1"
    stats_interval: float = 10.0
    logging: bool = True  # False only for the benchmark's unlogged baseline
    max_message: int = MAX_MESSAGE  # bytes; peers refuse a longer frame from its header
    spin_us: int = 0  # a receive polls this long before it sleeps (runtime/pump.py)
    frame_mac: str = "control"  # which frames carry a MAC (runtime/transport.py)
    same_node: str = "unix"  # a peer on this host: over a Unix socket, or tcp


class Context(Receiving):
    """One rank's runtime (thread-safe for one application thread plus its own threads)."""

    def __init__(self, port: Port, rank: int, size: int, epoch: int,
                 settings: Settings | None = None, *, job: str = "local",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside 0..{size - 1}")
        self.port, self.rank, self.size, self.epoch, self.job = port, rank, size, epoch, job
        self.s = settings or Settings()
        self._clock = clock
        # The log's copies go to warm memory (runtime/arena.py); the unlogged baseline
        # keeps nothing.
        self.arena = Arena(self.s.buffer_bytes) if self.s.logging else None
        self.log = SenderLog(large_threshold=self.s.large_threshold,
                             high_watermark=self.s.high_watermark, arena=self.arena,
                             own=rank)
        # frame_mac all tags DATA too: a message is logged whole, then sent MAC'd
        self._stream = self.arena is not None and self.s.frame_mac == "control"
        self.inbox = Inbox()
        self._mu = threading.Lock()
        self._out: dict[int, Outgoing] = {}
        self._out_lock = threading.Lock()
        self._deferred = {}
        self._dialing = {}
        self._peer_epoch: dict[int, int] = {}
        self._hello_cids: dict[int, int] = {}   # incoming connection -> src (after HELLO)
        self._into = {}  # a receive waiting with somewhere to read in place (receiving.py)
        self._sums = {}  # checksums of large messages taken after their send (sending.py)
        self._error: MessagingError | None = None
        self._work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._kept: deque[tuple[dict[int, int], dict[int, int]]] = deque()
        self._last_ckpt = clock()
        self._started = False
        self._closed = False
        self._persisted_bodies: dict[tuple[int, int], Entry] | None = None
        self._gaps: dict[int, tuple[int, int]] = {}
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()  # the flush thread's, to spill before its period
        self._blocked: dict[int, float] = {}  # src -> since when a recv waits for it
        self._acked: dict[int, int] = {}      # dst -> what it confirmed delivered
        self._floor_epoch: dict[int, int] = {}  # dst -> epoch that reported its floor
        self._pending_hellos: dict[int, tuple[int, int]] = {}  # before restore: src -> seq
        self._confirmed: dict[int, int] = {}  # src -> what we told it we delivered
        self.refused_hellos = 0
        self.resent = 0  # messages sent again (gap repair, replay)
        self.drop_every = 0  # test knob: silently skip every Nth DATA write
        self._sent_frames = 0
        self.generation: int | None = None
        # (what this rank's log says it sent before its loss, what its checkpoint had sent)
        self._replay: tuple[dict[int, int], int] | None = None
        self.deferred_checkpoints = 0  # checkpoint() calls skipped while replaying
        self._resumed = False  # the recovery was told this relaunched rank runs again
        self._last_step = 0
        self._restored_delivered: dict[int, int] = {}  # per source, at the restored checkpoint
        self._peer_had: dict[int, int] = {}  # per peer, what its HELLO says it delivered
        self._heard: dict[int, tuple[int, int, float]] = {}  # src -> its progress (links)
        self._relayed = 0.0  # the last progress origin told to the peers (links)
        self._unsendable: set[tuple[int, int]] = set()  # logged bodies that failed a check
        self.preempted = False
        self._records_pending = False  # determinants not yet flushed (see record())
        self._records_replay: list[bytes] = []
        # Peers authenticate with their nodes' keys (docs/messaging.md, Authentication).
        self.listener = Listener(self.s.host, self._on_frame, self._on_close,
                                 Auth(port.rank_keys, rank, self.s.max_message,
                                      epoch=epoch, frame_mac=self.s.frame_mac,
                                      ranks=size),
                                 self.s.spin_us / 1e6, unix=self.s.same_node == "unix",
                                 place=self._place, on_data=self._on_data)
        host, port_no = self.listener.address
        port.publish(host, port_no, epoch)
        self._flusher = threading.Thread(target=self._ticker, name="raps-msg-flush",
                                         daemon=True)
        self._threads = [threading.Thread(target=self._worker, name="raps-msg-worker",
                                          daemon=True), self._flusher]
        for t in self._threads:
            t.start()

    # --- application API -------------------------------------------------------------

    def restore(self) -> Any:
        """The state of this rank's newest checkpoint (None if it has none), with the
        message layer put back where that checkpoint left it; then peers replay.

        If the agent found generations but none whole, the process exits ``LOST_EXIT``
        (74): its agent has told the leader, which requeues the run or gives up, and no
        restart from the beginning may pass for a restore."""
        try:
            got = self.port.restore()
        except RapsError as exc:
            if getattr(exc, "kind", None) != "lost":
                raise
            print(f"raps: rank {self.rank} epoch {self.epoch} cannot be restored: {exc}; "
                  f"exiting {LOST_EXIT}", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                self.port.close()
            os._exit(LOST_EXIT)  # as for PREEMPTED_EXIT: no thread may hold the exit
        if got is None:
            self._replay = ({}, 0)  # nothing to catch up with: running from the start
            if self.epoch > 1:  # relaunched before its first checkpoint: its decisions
                self._records_replay = _own_records(
                    parse_records(self.port.log_read()), self.rank, 0)
            self._start()
            return None
        items, gen, extra = got
        meta = extra.get("raps_msg") or {}
        delivered = {int(k): int(v) for k, v in (meta.get("delivered") or {}).items()}
        sent = {int(k): int(v) for k, v in (meta.get("sent") or {}).items()}
        floors = {int(k): int(v) for k, v in (meta.get("floors") or {}).items()}
        bodies = {}
        for name in [n for n in items if n.startswith(LARGE_PREFIX)]:
            dst, seq = (int(x) for x in name[len(LARGE_PREFIX):].split("/"))
            bodies[(dst, seq)] = bytes(items.pop(name))
        carried = items.pop(LOG_ITEM, None)
        # the log store's records (this node's, or its log backup's), and those the
        # checkpoint carries: enough for every replay even if the node and its log
        # backup were lost together
        records = list(parse_records(self.port.log_read()))
        if carried is not None:
            records += parse_records(bytes(carried))
        # What this rank had sent before it was lost: re-execution has caught up (its
        # replay is over) once it has sent as much again to every peer.
        target: dict[int, int] = dict(sent)
        for e in records:
            target[e.dst] = max(target.get(e.dst, 0), e.seq)
        self._replay = (target, sum(sent.values()))
        self._records_replay = _own_records(records, self.rank, sent.get(self.rank, 0))
        self._restored_delivered = dict(delivered)
        with self._mu:
            self.inbox.restore(delivered)
            self.log.reload(records, sent, bodies, floors)
            self._kept = deque([(delivered, sent)])
            self.generation = gen
        # The state just restored is a committed generation: the checkpoint interval
        # counts from now, not from the process's start (a restore of a large state
        # would make the next step save it all again at once).
        self._last_ckpt = self._clock()
        log.info("rank %d epoch %d restored generation %d (delivered %s, sent %s)",
                 self.rank, self.epoch, gen, delivered, sent)
        self._start()
        if STATE_ITEM in items:
            return items[STATE_ITEM]
        return items

    def send(self, dst: int, payload: bytes | bytearray | memoryview) -> None:
        """Send a message to rank ``dst`` (logged first; never waits for ``dst``)."""
        self.send_parts(dst, payload if isinstance(payload, bytes) else [payload])

    def send_parts(self, dst: int, payload: bytes | list[bytes | bytearray | memoryview]
                   ) -> None:
        """:meth:`send` of one message given as ``bytes`` (kept by reference) or as a list
        of parts, joined as they are copied into the log (the MPI layer's envelope and the
        application's buffer: one copy, into warm memory)."""
        if not 0 <= dst < self.size or dst == self.rank:
            raise ValueError(f"destination {dst}: expected another rank in 0..{self.size - 1}")
        nbytes = len(payload) if isinstance(payload, bytes) else parts_size(payload)
        if nbytes > self.s.max_message:
            raise ValueError(f"message of {nbytes} bytes: at most "
                             f"{self.s.max_message} (Settings.max_message)")
        self._start()
        self._raise_error()
        if self._records_pending:
            # Decisions this send may depend on are durable before it leaves.
            self._records_pending = False
            self._flush()
        if not self.s.logging:  # benchmark baseline: numbered frames, nothing kept
            with self._mu:
                seq = self.log.sent.get(dst, 0) + 1
                self.log.sent[dst] = seq
            # Sent from the caller's parts, as the logged path sends a large message:
            # joining them first cost the baseline a copy into fresh memory.
            parts: list[bytes | bytearray | memoryview] = (
                [payload] if isinstance(payload, bytes) else payload)
            crc = 0
            if not (self.s.frame_mac == "control" and nbytes >= ARENA_AT):  # as logged
                for p in parts:
                    crc = checksum(p, crc)
            self._send_unlogged(Entry(dst, seq, self.epoch, nbytes, crc, False, None), parts)
            return
        # A large message under frame_mac control is copied into the log as it is sent
        # (wire/datapath.py); else logged whole first.
        stream = self._stream and nbytes >= ARENA_AT and not isinstance(payload, bytes)
        with self._mu:
            spill = self.log.over_watermark()
            if not spill:  # the usual case: one hold of the lock
                early = self.log.spill_due()
                e, pending = self._log(dst, payload, stream, nbytes)
        if spill:
            self._spill()  # the background spill fell behind: this send waits for it
            with self._mu:
                e, pending = self._log(dst, payload, stream, nbytes)
        elif early and not self._wake.is_set():  # set, it wakes the flush thread each send
            self._wake.set()
        if pending:
            assert isinstance(payload, list)
            self._send_streamed(e, payload)
        else:
            self._send_entry(e)

    def _log(self, dst: int, payload: bytes | list[bytes | bytearray | memoryview],
             stream: bool, size: int) -> tuple[Entry, bool]:
        if stream:
            assert isinstance(payload, list)
            return self.log.reserve(dst, payload, self.epoch, size)
        return self.log.append(dst, payload, self.epoch, size), False

    def record(self, data: bytes) -> None:
        """Append a *determinant* (a decision this rank took that a re-execution must
        take again, e.g. which source an any-source receive matched) to this rank's own
        log stream, as an entry to itself: the log store, its backup and checkpoints
        cover it like a message. It is durable before this rank's next ``send``."""
        self._start()
        with self._mu:
            self.log.append(self.rank, data, self.epoch)
            self._records_pending = True

    def replayed_records(self) -> list[bytes]:
        """After ``restore()``: the determinants recorded after the restored checkpoint
        (or since the start, for a rank relaunched before its first one), in order."""
        return list(self._records_replay)

    def heartbeat(self, step: int, items: int = 0) -> None:
        """Report progress (through the agent). After a relaunch, the first one tells the
        recovery the rank is running again, and the first one at its pre-fault progress
        that it has caught up."""
        self.port.heartbeat(step, items)
        self._last_step = step
        if self._replay is not None and self.epoch > 1:
            self._catch_up(step)

    def _catch_up(self, step: int, finished: bool = False) -> None:
        assert self._replay is not None
        if not self._resumed:
            self._resumed = True
            self.port.recovery_event("running", {"step": step})
        logged, base = self._replay
        with self._mu:
            # Pre-fault progress: what the log held, or what a peer had delivered if
            # more (messages sent just before the loss, never flushed to the log).
            target = {**self._peer_had,
                      **{d: max(n, self._peer_had.get(d, 0)) for d, n in logged.items()}}
            met = all(self.log.sent.get(d, 0) >= n for d, n in target.items())
            caught_up = met or finished
            replayed = sum(target.values()) - base
            # from the peers since the restored checkpoint: what they replayed from
            # their logs, and anything new they sent meanwhile
            received = sum(self.inbox.delivered(src) - self._restored_delivered.get(src, 0)
                           for src in list(self.inbox.sources)
                           if src != self.rank) if caught_up else 0
        if caught_up:
            self._replay = None
            detail: dict[str, Any] = {"replayed": replayed, "received": received, "step": step}
            if not met:  # its program ended first (it reported no progress past the fault)
                detail["finished"] = True
            self.port.recovery_event("caught_up", detail)

    def checkpoint_due(self) -> bool:
        """True once ``checkpoint.interval_sec`` passed since the last checkpoint, and at
        once after a SIGUSR1 (the job is about to be preempted or hit its time limit)."""
        return self.preempted or self._clock() - self._last_ckpt >= self.s.checkpoint_interval

    def preempt(self, signum: int = 0, frame: object = None) -> None:
        """SIGUSR1 handler: checkpoint at the next ``checkpoint_due()`` and then exit."""
        self.preempted = True

    def checkpoint(self, state: Any) -> int:
        """Flush the log, save ``state`` with the delivered and sent vectors and the large
        bodies not yet covered; returns the generation (while etcd has no quorum, the
        last committed one, or 0: the rank goes on and the next checkpoint commits).

        A relaunched rank that has not yet regained its pre-fault progress saves nothing
        and returns the generation it restored, for at most REPLAY_DEFER_INTERVALS
        checkpoint intervals after its restore (or until SIGUSR1)."""
        self._start()
        if self._replay is not None and self.epoch > 1:
            self._catch_up(self._last_step)  # a program may checkpoint without heartbeats
        if self._replay is not None and self.epoch > 1 and not self.preempted and \
                self._clock() - self._last_ckpt < \
                REPLAY_DEFER_INTERVALS * self.s.checkpoint_interval:
            # Redoing steps its lost incarnation had done: saving them again would stall
            # this rank, and every neighbour that waits on it, for the save (1.3-2.1 s
            # a save of a 128 MiB rank on the test machine, at each 20th step of the
            # replay). A crash meanwhile restores the same generation again.
            self.deferred_checkpoints += 1
            return self.generation or 0
        # A large state takes a while, and the step stands still meanwhile: reported as
        # waiting on itself, so the detector's progress window does not count this time.
        self.port.blocked(self.rank)
        try:
            return self._checkpoint(state)
        finally:
            self.port.blocked(None)

    def _log_records(self, logged: list[Lane]) -> bytes:
        """Log-store records of the entries a checkpoint carries (``logged``: the lanes'
        snapshots): small ones with their bodies, large ones as headers (their bodies are
        the checkpoint's large items)."""
        parts: list[bytes | memoryview] = []
        spilled: dict[tuple[int, int], Entry] | None = None
        for lane in logged:
            for e in lane.entries(0, lane.dst == self.rank):
                if e.large:
                    parts += e.record(False)
                    continue
                if e.body is None:  # spilled under memory pressure: it is in the log store
                    spilled = self._persisted() if spilled is None else spilled
                    stored = spilled.get((e.dst, e.seq))
                    if stored is None:
                        raise MessagingError(f"rank {self.rank}: the body of seq {e.seq} to "
                                             f"rank {e.dst} is neither in memory nor in the "
                                             "log store")
                    e = stored
                parts += Entry(e.dst, e.seq, e.epoch, e.size, e.crc, False, e.body).record(True)
        return b"".join(parts)

    def _items(self, state: Any, logged: list[Lane],
               large: list[tuple[int, int, bytes | memoryview | None]]) -> dict[str, Any]:
        """A checkpoint's items: the state, the log records, the large bodies uncovered."""
        items: dict[str, Any] = dict(state) if isinstance(state, dict) and all(
            isinstance(k, str) and not k.startswith("\0") for k in state) else {STATE_ITEM: state}
        items[LOG_ITEM] = self._log_records(logged)
        missing = [(d, s) for d, s, b in large if b is None]
        if missing:
            spilled = self._persisted()
            for d, s in missing:
                if (d, s) not in spilled:
                    raise MessagingError(f"rank {self.rank}: the body of seq {s} to rank {d} "
                                         "is neither in memory nor in the log store")
                items[f"{LARGE_PREFIX}{d}/{s}"] = spilled[(d, s)].body
        for d, s, b in large:
            if b is not None:
                items[f"{LARGE_PREFIX}{d}/{s}"] = bytes(b)
        return items

    def _checkpoint(self, state: Any) -> int:
        self._flush()
        with self._mu:
            delivered = self.inbox.delivered_vector()
            sent = self.log.sent_vector()
            floors = dict(self.log.floors)
            large = [(e.dst, e.seq, e.body) for e in self.log.large_uncovered()]
            logged = self.log.snapshot()
            pinned = contextlib.ExitStack()
            if self.arena is not None:  # the bodies read below stay whole until copied
                pinned.enter_context(self.arena.pin())
        with pinned:
            items = self._items(state, logged, large)
        extra = {"raps_msg": {"delivered": {str(k): v for k, v in delivered.items()},
                              "sent": {str(k): v for k, v in sent.items()},
                              "floors": {str(k): v for k, v in floors.items()},
                              "epoch": self.epoch}}
        try:
            gen = self.port.save(items, extra)
        except RapsError as exc:
            if getattr(exc, "kind", None) not in ("unavailable", "unbacked"):
                raise
            # etcd has no quorum, or the log backup does not hold this rank's log yet:
            # computing on beats stopping; the next checkpoint commits (its base is the
            # last committed generation, nothing is skipped).
            log.warning("rank %d: checkpoint not committed (%s); going on", self.rank, exc)
            self._last_ckpt = self._clock()
            return self.generation or 0
        self._last_ckpt = self._clock()
        with self._mu:
            self.generation = gen
            self._kept.append((delivered, sent))
            while len(self._kept) > self.s.max_generations:
                self._kept.popleft()
            oldest_delivered, oldest_sent = self._kept[0]
        with self._mu:  # own determinants the oldest kept generation covers
            self.log.raise_floor(self.rank, oldest_sent.get(self.rank, 0))
        for src in range(self.size):
            if src != self.rank:
                self._control(src, COVERED, oldest_delivered.get(src, 0))
                self._control(src, SENT_FLOOR, oldest_sent.get(src, 0))
        with contextlib.suppress(Exception):
            self.port.log_trim(dict(self.log.floors))
        if self.preempted:
            log.warning("rank %d: checkpointed generation %d after SIGUSR1; exiting %d so "
                        "the job can be requeued (or this rank moved)", self.rank, gen,
                        PREEMPTED_EXIT)
            with contextlib.suppress(Exception):
                self._flush()
            with contextlib.suppress(Exception):
                self.port.close()
            # Not SystemExit: threads serving peers must not hold the process at exit.
            os._exit(PREEMPTED_EXIT)
        return gen

    def finalize(self, timeout: float | None = None) -> None:
        """Flush the log, say this rank is done, and wait until every peer is done too,
        serving resends meanwhile: a peer that fails now is relaunched and replays from
        ranks that are still here. Then close every connection."""
        if self._closed:
            return
        with contextlib.suppress(Exception):
            self._flush()
            self._confirm()
        if self._replay is not None and self.epoch > 1:
            with contextlib.suppress(Exception):  # the recovery must not wait for ever
                self._catch_up(self._last_step, finished=True)
        host, port_no = self.listener.address
        with contextlib.suppress(Exception):
            self.port.publish(host, port_no, self.epoch, done=True)
        deadline = self._clock() + (self.s.recv_timeout if timeout is None else timeout)
        waiting = set(range(self.size)) - {self.rank}
        while waiting and self._clock() < deadline:
            for d in list(waiting):
                where = self.port.lookup(d)
                if where is not None and where[3] and where[2] >= self._peer_epoch.get(d, 0):
                    waiting.discard(d)
            if waiting:
                time.sleep(min(0.05, self.s.flush_ms / 1000))
        if waiting:
            log.warning("rank %d finalized before rank(s) %s were done", self.rank,
                        ", ".join(map(str, sorted(waiting))))
        with contextlib.suppress(Exception):
            self._confirm()
        with contextlib.suppress(Exception):
            self.port.report(self.stats())  # the last figures, for rapsctl inspect
        self.close()

    def close(self) -> None:
        """Stop without flushing (what a crash looks like to the peers)."""
        self._closed = True
        self._wake.set()
        self._work.put(None)
        self.listener.close()
        with self._out_lock:
            outs, self._out = list(self._out.values()), {}
        for o in outs:
            o.close()
        # A flush the ticker started before this must not write after it: a closed
        # context is a dead rank, and what it wrote later would land in a log store that
        # its relaunch (or a test standing for a lost node) is already replacing.
        if self._flusher is not threading.current_thread():
            self._flusher.join(CLOSE_WAIT)
        self.port.close()

    def stats(self) -> dict[str, Any]:
        """Sent, delivered, logged and collected ranges per peer; buffer use; gaps."""
        with self._out_lock:
            over = {p: "theirs" if o.theirs else "own" for p, o in self._out.items()}
        with self._mu:
            peers = {}
            for p in range(self.size):
                if p == self.rank:
                    continue
                src = self.inbox.sources.get(p)
                peers[p] = {
                    "sent": self.log.sent.get(p, 0),
                    "logged": self.log.held_range(p),
                    "collected_upto": self.log.floors.get(p, 0),
                    "delivered": self.inbox.delivered(p),
                    "waiting_for_gap": self.inbox.waiting(p),
                    "early": sorted(src.early) if src else [],
                    "peer_epoch": self._peer_epoch.get(p),
                    # the connection we send over: one we opened, the peer's, or none
                    "sends_over": over.get(p),
                }
            return {"rank": self.rank, "epoch": self.epoch, "generation": self.generation,
                    "buffer_bytes": self.log.held, "buffer_peak": self.log.peak,
                    "high_watermark": self.s.high_watermark, "spilled": self.log.spilled,
                    "duplicates": self.inbox.duplicates, "resent": self.resent,
                    "refused_stale_frames": self.inbox.refused_epoch,
                    "refused_hellos": self.refused_hellos,
                    "refused_connections": self.listener.auth.refusals(),
                    # who read the frames (runtime/pump.py): the waiting application
                    # thread, or the background one
                    "frames_read_waiting": self.listener.pump.frames_app,
                    "frames_read_background": self.listener.pump.frames_background,
                    # read straight into the waiting receive's buffer (receiving.py)
                    "messages_read_in_place": self.inbox.placed,
                    **(self.arena.stats() if self.arena is not None else {}),
                    "peers": peers}


def _own_records(records: Iterable[Entry], rank: int, after: int) -> list[bytes]:
    """The determinants (entries to ``rank`` itself) above seq ``after``, contiguous and
    in order; a seq logged by several incarnations carries the same decision."""
    got: dict[int, bytes] = {}
    for e in records:
        if e.dst == rank and e.seq > after and e.body is not None:
            got.setdefault(e.seq, bytes(e.body))
    out: list[bytes] = []
    while after + 1 + len(out) in got:
        out.append(got[after + 1 + len(out)])
    return out
