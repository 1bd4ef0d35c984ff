"""The agent's node-level duties: membership lease, kernel heartbeats, self-fencing view.

Threads: the main loop (lease refresh, leader lookup, local data sweep), the heartbeat
sender and the datagram receiver (acks, probes). They share ``HeartbeatState`` under
a lock; nothing here decides about other nodes.

Self-fencing rule (docs/detection.md): the agent's ranks may act only while
``valid_until`` has not passed, where ``valid_until`` is the *send* time of the last
heartbeat the leader acknowledged + the miss window. The leader declares the node dead
no earlier than that same instant + ``fence_margin_sec``, so by then every rank of this
node has stopped by itself, whatever happened to the network or to this agent.
An agent that loses the acknowledgements but still reaches etcd keeps its ranks
(a coordinator pause or fail-over must not kill healthy ranks): epochs in etcd are
what fences a superseded copy. So does one that can prove etcd has no quorum at all
(a majority of its members refuse connections or answer without a leader): then no
coordinator can lead, write an epoch or relaunch anything, and a leader that comes
back with the quorum waits the miss window + margin before any DEAD verdict.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, field

from raps_slurm.config import Config
from raps_slurm.errors import BadDatagram, LeaseExpired, StoreError
from raps_slurm.store import Keys, Lease, StateStore
from raps_slurm.wire.heartbeat import Ack, Heartbeat, Probe, decode, encode, new_incarnation

log = logging.getLogger("raps.agent")


@dataclass
class HeartbeatState:
    """What the sender, the receiver and the main loop share (under ``lock``)."""

    incarnation: int
    counter: int = 0
    leader: tuple[str, int] | None = None       # UDP address of the leader's receiver
    leader_name: str = ""
    valid_until: float = 0.0                    # monotonic: last acked beat's send + miss window
    last_ack_at: float = 0.0                    # monotonic time the last ack arrived
    acked: set[int] = field(default_factory=set)
    sent: dict[int, float] = field(default_factory=dict)  # counter -> monotonic send time
    lock: threading.Lock = field(default_factory=threading.Lock)


class NodeAgent:
    """One node's agent: call ``start()``, then ``step()`` from the main loop, ``stop()``."""

    def __init__(self, cfg: Config, store: StateStore, keys: Keys, node: str, key: bytes, *,
                 loss: float = 0.0, jitter: float = 0.0,
                 accepted_key: bytes | None = None, incarnation_offset: float = 0.0) -> None:
        """``key``: this node's key (``heartbeat.node_key``), which signs its heartbeats and
        the leader's acks and probes; ``incarnation_offset``: a test knob, seconds taken off
        the incarnation (an agent restarted after its clock stepped back)."""
        self.cfg, self.store, self.keys, self.node, self._key = cfg, store, keys, node, key
        self._also = accepted_key  # a rollover's other key: accepted, never used to sign
        d = cfg.detection
        self.interval = d.kernel_heartbeat_interval_sec
        self.miss_window = d.kernel_heartbeat_interval_sec * d.miss_threshold
        self._loss, self._jitter = loss, jitter
        self.hb = HeartbeatState(incarnation=new_incarnation() - int(incarnation_offset * 1e9))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))  # the leader answers to the source address
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lease: Lease | None = None
        self._lease_refreshed = 0.0               # monotonic, last successful refresh
        self._next_refresh = 0.0
        self._leader_read = 0.0
        self._etcd_ok_at = 0.0  # monotonic time etcd last answered
        self._no_quorum_at = 0.0  # monotonic start of the last probe proving no quorum
        self._no_quorum_said = False
        self._started = time.monotonic()
        self.counters = {"sent": 0, "dropped_by_knob": 0, "acks": 0, "probes": 0,
                         "bad_datagrams": 0}
        self.transfer: str | None = None  # host:port of the chunk transfer server

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Start the sender and receiver threads."""
        loops = ((self._send_loop, "heartbeat-send"), (self._recv_loop, "heartbeat-recv"),
                 (self._quorum_loop, "quorum-watch"))
        for target, name in loops:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop the threads; the membership lease is left to expire (a restart within
        the window must not look like a node loss)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        self.sock.close()

    # -- main loop duties ----------------------------------------------------------

    def step(self) -> str:
        """Refresh the lease and the leader address when due; one status line.

        The leader key is read with every lease refresh, and at once (at most once per
        interval) when acks stopped for two intervals: after a fail-over the new
        leader must hear from us before its grace period ends.
        """
        now = time.monotonic()
        with self.hb.lock:
            unacked = now - max(self.hb.last_ack_at, self._started) > 2 * self.interval
        if unacked and now - self._leader_read >= self.interval:
            self._refresh_leader()
        if now < self._next_refresh:
            return ""
        status = self._refresh_membership(now)
        self._refresh_leader()
        return status

    @property
    def lease(self) -> Lease | None:
        """The membership lease (None while not registered)."""
        return self._lease

    def valid_until(self) -> float:
        """Monotonic time after which this node's ranks must have stopped (0: never acked).

        Counted on this host's monotonic clock from the send of the last acknowledged
        heartbeat: no wall-clock offset or step between hosts can make it late.
        """
        with self.hb.lock:
            return self.hb.valid_until

    def valid_for(self) -> float:
        """Seconds this node's ranks may still go on (<= 0: they must stop now).

        Valid while the leader acknowledged a heartbeat sent within the miss window, or
        while etcd answered within it: an agent that only lost the coordinator (a pause,
        a fail-over) keeps its ranks; epochs fence a copy that was replaced. Without
        acks the agent reads the leader key every interval, which keeps this fresh
        while etcd answers.
        """
        now = time.monotonic()
        last = max(self._etcd_ok_at, self._no_quorum_at)
        by_etcd = last + self.miss_window if last else 0.0
        return max(self.valid_until(), by_etcd) - now

    def quorum_lost(self) -> bool:
        """True while the last probe (within the miss window) proved etcd has no quorum."""
        return bool(self._no_quorum_at) and time.monotonic() - self._no_quorum_at < self.miss_window

    def _quorum_loop(self) -> None:
        # Keeps the etcd side of validity fresh while no acks arrive, in a thread of its
        # own: the main loop may sit in a read for the whole store timeout (far beyond
        # the miss window) when etcd lost its quorum, and again while it comes back.
        # It acts only when neither acks nor the main loop's reads are fresh, so during
        # a mere coordinator fail-over etcd sees no extra request.
        delay = self.interval
        while not self._stop.wait(delay):
            delay = self.interval
            now = time.monotonic()
            with self.hb.lock:
                acked = now - self.hb.last_ack_at <= self.interval
            if acked or now - self._etcd_ok_at <= self.interval or not self._etcd_ok_at:
                continue
            if self.store.quorum_lost(timeout=self.interval):
                if not self._no_quorum_said:
                    log.warning("etcd has no quorum (a majority of its members is down or "
                                "leaderless): no coordinator can relaunch anything; keeping "
                                "the local ranks")
                    self._no_quorum_said = True
                self._no_quorum_at = now
                # one proof per interval however long the probe took: the next one must
                # land well within this one's miss window
                delay = max(0.02, self.interval - (time.monotonic() - now))
                continue
            read_at = time.monotonic()  # the probe may have taken a while
            try:
                self.store.get(self.keys.leader())
            except StoreError:
                continue  # a partition: nothing proven, validity runs out
            self._etcd_ok_at = read_at
            if self._no_quorum_said:
                self._no_quorum_said = False
                log.info("etcd has a quorum again")

    def send(self, data: bytes, address: tuple[str, int]) -> None:
        """Send one datagram from the agent's socket (heartbeats, app reports)."""
        self._sendto(data, address)

    def etcd_reachable(self) -> bool:
        """True while the membership lease was refreshed within the miss window."""
        return time.monotonic() - self._lease_refreshed < self.miss_window

    def registration(self) -> bytes:
        """The value of ``nodes/<node>``."""
        port = self.sock.getsockname()[1]
        host = socket.gethostname()
        value = {"node": self.node, "host": host, "udp": f"{host}:{port}",
                 "incarnation": self.hb.incarnation, "pid": os.getpid(), "since": time.time()}
        if self.transfer:
            value["transfer"] = self.transfer
        return json.dumps(value).encode()

    def _refresh_membership(self, now: float) -> str:
        ttl = max(1, round(self.cfg.detection.lease_duration_sec))
        try:
            if self._lease is not None:
                try:
                    self.store.refresh_lease(self._lease)
                    self._lease_refreshed = self._etcd_ok_at = now
                    self._next_refresh = now + ttl / 3
                    return ""
                except LeaseExpired:
                    log.warning("membership lease expired (agent paused or cut off): "
                                "registering again")
                    self._lease = None
            lease = self.store.grant_lease(ttl)
            self.store.put(self.keys.node(self.node), self.registration(), lease)
            self._lease, self._lease_refreshed = lease, now
            self._etcd_ok_at = time.monotonic()
            self._next_refresh = now + ttl / 3
            return f"registered {self.node} (lease {lease.ttl}s)"
        except StoreError as exc:
            self._next_refresh = now + min(1.0, ttl / 3)
            return f"etcd unreachable: {exc}"

    def _refresh_leader(self) -> None:
        self._leader_read = time.monotonic()
        try:
            kv = self.store.get(self.keys.leader())
        except StoreError:
            return  # keep sending to the last known leader
        self._etcd_ok_at = self._leader_read
        if kv is None:
            return
        try:
            value = json.loads(kv.value)
            host, _, port = str(value["heartbeat"]).rpartition(":")
            address = (host, int(port))
        except (ValueError, KeyError, TypeError):
            log.warning("leader key has no usable heartbeat address: %r", kv.value[:120])
            return
        with self.hb.lock:
            if address != self.hb.leader:
                log.info("heartbeats go to %s at %s:%d", value.get("name"), *address)
            self.hb.leader, self.hb.leader_name = address, str(value.get("name", ""))

    # -- heartbeats ------------------------------------------------------------------

    def _beat(self) -> int | None:
        """Send one heartbeat (unless the test knob drops it); returns its counter."""
        with self.hb.lock:
            leader = self.hb.leader
            self.hb.counter += 1
            beat = Heartbeat(self.node, self.hb.incarnation, self.hb.counter, time.time())
            self.hb.sent[beat.counter] = time.monotonic()
            if len(self.hb.sent) > 64:  # acks older than this are useless anyway
                del self.hb.sent[min(self.hb.sent)]
        if leader is None:
            return None
        if self._loss and random.random() < self._loss:
            self.counters["dropped_by_knob"] += 1
            return beat.counter
        data = encode(beat, self._key)
        if self._jitter:
            threading.Timer(random.uniform(0, self._jitter), self._sendto, (data, leader)).start()
        else:
            self._sendto(data, leader)
        return beat.counter

    def _sendto(self, data: bytes, address: tuple[str, int]) -> None:
        try:
            self.sock.sendto(data, address)
            self.counters["sent"] += 1
        except OSError as exc:
            log.debug("heartbeat send to %s failed: %s", address, exc)

    def _send_loop(self) -> None:
        # One beat per interval; if its ack is not back within a third of the interval,
        # one more (with a new counter), so a single lost datagram is not a miss.
        next_at = time.monotonic()
        while not self._stop.is_set():
            counter = self._beat()
            if counter is not None and not self._stop.wait(self.interval / 3):
                with self.hb.lock:
                    missing = counter not in self.hb.acked
                    self.hb.acked.clear()
                if missing:
                    self._beat()
            next_at += self.interval
            delay = next_at - time.monotonic()
            if delay < 0:  # paused (frozen): do not burst, start again from now
                next_at, delay = time.monotonic(), 0
            self._stop.wait(delay)

    def _recv_loop(self) -> None:
        while not self._stop.is_set():
            try:
                data, address = self.sock.recvfrom(2048)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            try:
                msg = decode(data, self._key, self._also)
            except BadDatagram as exc:
                self.counters["bad_datagrams"] += 1
                log.debug("dropped datagram from %s: %s", address, exc)
                continue
            if isinstance(msg, Ack) and msg.node == self.node \
                    and msg.incarnation == self.hb.incarnation:
                self.counters["acks"] += 1
                with self.hb.lock:
                    self.hb.acked.add(msg.counter)
                    sent = self.hb.sent.get(msg.counter)
                    if sent is not None and sent + self.miss_window > self.hb.valid_until:
                        self.hb.valid_until = sent + self.miss_window
                        self.hb.last_ack_at = time.monotonic()
            elif isinstance(msg, Probe) and msg.node == self.node:
                # The second channel: answer at once, to whoever asked (the leader).
                self.counters["probes"] += 1
                with self.hb.lock:
                    self.hb.counter += 1
                    reply = Heartbeat(self.node, self.hb.incarnation, self.hb.counter,
                                      time.time(), probe_reply=True)
                self._sendto(encode(reply, self._key), address)
