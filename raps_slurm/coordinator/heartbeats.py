"""The coordinator's UDP side: receive and verify heartbeats, acknowledge, send probes.

A thread of its own reads the socket so that a slow etcd or Slurm call in the main loop
never delays an acknowledgement (a late ack shortens the agent's ``valid_until``).
Verified heartbeats are queued for the main loop, which owns the detector. Only a
coordinator that leads by its own clock acknowledges: an ack is a promise that the node
may go on until ``sent_at + miss window``, and a deposed leader must not make it.

The thread reads batches of up to 64 datagrams with one ``recvmmsg`` and acknowledges
them with one ``sendmmsg`` (raps_slurm/wire/_udp.c, which also signs the acks), then lets
the next ones gather for 2 ms: about 8 µs of CPU per heartbeat with its ack, against
22-32 µs for a ``recvfrom``/``sendto`` loop and twice that for an asyncio endpoint
(``rapsctl bench heartbeats``, docs/benchmarks.md). The receive buffer is enlarged so
that the main loop holding the GIL for a while (a large etcd read) delays heartbeats
instead of dropping them. ``coordinator.heartbeat_receivers`` > 1 adds receiver
processes on the same port (coordinator/receivers.py); they forward what they accepted,
and this server's replay guard, the one every heartbeat passes, decides.

Every datagram must be signed with the key of the node it names (``NodeKeys``, derived
from the cluster key): the tag is checked here with that node's precomputed HMAC state
(one ``_udp.verify`` call), and acks and probes are signed with the same node's key.
The detector takes a node's address only from these verified heartbeats.

Bounds per source (docs/architecture.md, Trust boundaries): a datagram naming a node
outside the cluster (Slurm's node list, read by ``members_from`` every
:data:`MEMBERS_REFRESH_SEC` and at most every :data:`MEMBERS_RETRY_SEC` after an unknown
name) is refused as ``member`` before any key is derived or used. Each datagram refused
charges its source address (:class:`SourceBudget`: ``coordinator.heartbeat_source_rate``
a second, ``coordinator.heartbeat_source_burst`` at once); an address with nothing left
has its datagrams dropped unread as ``rate``, except those naming a node whose
heartbeats last verified from that address, so that a user flooding from a node's
address does not silence its agent.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from raps_slurm.config import CoordinatorConfig
from raps_slurm.errors import BadDatagram
from raps_slurm.wire._udp import MAX_BATCH, recv_batch, sign_send
from raps_slurm.wire.heartbeat import (
    FRAME,
    AppReport,
    Heartbeat,
    NodeKeys,
    Probe,
    RankProgress,
    ReplayGuard,
    ack_body,
    claimed_node,
    decode_from_node,
    encode,
    parse_heartbeat,
)

log = logging.getLogger("raps.coordinator")


class Received(NamedTuple):
    """One verified heartbeat, as the detector needs it (a tuple: one per datagram)."""

    node: str
    sent_at: float
    received_at: float
    address: tuple[str, int]
    acked: bool
    probe_reply: bool
    incarnation: int = 0
    counter: int = 0


@dataclass(frozen=True)
class ReceivedApp:
    """One verified app report: the ranks of ``node`` that heartbeated since its last one."""

    node: str
    received_at: float
    ranks: tuple[RankProgress, ...]
    incarnation: int = 0
    counter: int = 0
    sent_at: float = 0.0


# Receive buffer asked for; Linux grants at most twice net.core.rmem_max (4 MiB here, so
# 8 MiB: ~10,000 heartbeats). The default 208 KiB holds ~15 ms of them at 20,000/s.
RECEIVE_BUFFER = 8 << 20
COALESCE_SEC = 0.002
MEMBERS_REFRESH_SEC = 60.0  # the cluster's node names are read again this often
MEMBERS_RETRY_SEC = 5.0  # ... and this soon after a datagram named an unknown node
SOURCE_RATE = CoordinatorConfig().heartbeat_source_rate  # the defaults: see the config
SOURCE_BURST = float(CoordinatorConfig().heartbeat_source_burst)
MAX_SOURCES = 4096  # addresses with a budget of their own; more share one


class SourceBudget:
    """Per source address, a token bucket that refused datagrams drain: ``rate`` a
    second, ``burst`` at most. Addresses beyond ``max_sources`` share one bucket, so
    spoofed addresses cost a bounded table. Not thread-safe (one server thread)."""

    def __init__(self, rate: float = SOURCE_RATE, burst: float = SOURCE_BURST,
                 max_sources: int = MAX_SOURCES) -> None:
        self.rate, self.burst, self.max_sources = rate, burst, max_sources
        self._buckets: dict[str, list[float]] = {}  # address -> [tokens, at]

    def _bucket(self, source: str, now: float) -> list[float]:
        b = self._buckets.get(source)
        if b is None:
            if len(self._buckets) >= self.max_sources:
                self._forget_full(now)
            key = source if len(self._buckets) < self.max_sources else ""
            b = self._buckets.setdefault(key, [self.burst, now])
        tokens = min(self.burst, b[0] + (now - b[1]) * self.rate)
        b[0], b[1] = tokens, now
        return b

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that refilled (they hold nothing a new one would not)."""
        for source, (tokens, at) in list(self._buckets.items()):
            if source and tokens + (now - at) * self.rate >= self.burst:
                del self._buckets[source]

    def exhausted(self, source: str, now: float) -> bool:
        """Whether ``source`` spent its budget (its datagrams are dropped unread)."""
        return self._bucket(source, now)[0] < 1.0

    def charge(self, source: str, now: float) -> None:
        """One datagram from ``source`` was refused."""
        b = self._bucket(source, now)
        b[0] = max(0.0, b[0] - 1.0)


class HeartbeatServer:
    """Receives on ``address``; ``leader_revision()`` > 0 while this coordinator may ack.
    ``key``: the cluster key, from which every node's key is derived."""

    def __init__(self, address: tuple[str, int], key: bytes, max_skew: float,
                 leader_revision: Callable[[], int],
                 clock: Callable[[], float] = time.time,
                 on_result: Callable[[str, int], None] | None = None,
                 accepted_key: bytes | None = None, reuse_port: bool = False,
                 members_from: Callable[[], Iterable[str]] | None = None,
                 source_rate: float = SOURCE_RATE, source_burst: float = SOURCE_BURST
                 ) -> None:
        self.address, self._clock = address, clock
        # Node keys from the cluster key; a rollover's other key: accepted, never used to sign
        self.keys = NodeKeys(key, accepted_key)
        self._leader_revision = leader_revision
        self._reuse_port = reuse_port  # receiver processes share the port
        # Replay guards; the lock: forwarded heartbeats are checked from another thread.
        self._guard = ReplayGuard(max_skew)
        self._app_guard = ReplayGuard(max_skew)  # app reports count on their own
        self._guard_lock = threading.Lock()
        # Called first by drain(): brings in what receiver processes accepted so far.
        self.collect: Callable[[], None] = lambda: None
        self._queue: queue.SimpleQueue[list[Received | ReceivedApp]] = queue.SimpleQueue()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.accepted = 0
        self.send_errors = 0  # acks and probes the kernel refused (send buffer full)
        self.rejected: Counter[str] = Counter()  # reason -> count
        self._on_result = on_result or (lambda result, count: None)  # metrics, thread-safe
        # Called by forget(): receiver processes forget too (set by the ReceiverPool).
        self.on_forget: Callable[[str], None] = lambda node: None
        # The cluster's node names (None until first read: every name is heard).
        self.members: Collection[str] | None = None
        self.on_members: Callable[[frozenset[str]], None] = lambda names: None
        self._members_from = members_from
        self._members_wanted = threading.Event()
        self.budget = SourceBudget(source_rate, source_burst)
        self._home: dict[str, str] = {}  # node -> address its heartbeats last verified from

    def start(self) -> None:
        """Bind and serve in a thread; raises OSError if the address cannot be bound."""
        self._sock = bind(self.address, self._reuse_port)
        self.address = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self.serve, args=(self._sock,),
                                        name="heartbeat-server", daemon=True)
        self._thread.start()
        if self._members_from is not None:
            threading.Thread(target=self._follow_members, name="heartbeat-members",
                             daemon=True).start()

    def set_members(self, names: Iterable[str]) -> None:
        """The cluster's node names: a datagram naming another is refused (``member``)."""
        members = frozenset(names)
        if members != self.members:
            self.members = members
            self.on_members(members)

    def _follow_members(self) -> None:
        """Read ``members_from`` now, every MEMBERS_REFRESH_SEC, and soon after an unknown
        name; a failed read keeps the names read before."""
        assert self._members_from is not None
        while not self._stopping:
            try:
                names = frozenset(self._members_from())
                if not names:
                    raise ValueError("the list is empty")
                self.set_members(names)
            except Exception as exc:  # Slurm unreachable: the last list stands
                log.warning("cannot read the cluster's node names (%s): heartbeats are "
                            "checked against %s", exc,
                            "the last list" if self.members is not None else "no list")
            self._members_wanted.clear()
            if self._members_wanted.wait(MEMBERS_REFRESH_SEC):
                time.sleep(MEMBERS_RETRY_SEC)

    def serve(self, sock: socket.socket, go_on: Callable[[], bool] = lambda: True) -> None:
        """Read, check, queue and ack until stopped or ``go_on()`` is false (checked
        after every batch and on a receive timeout)."""
        self._sock = sock
        fd = sock.fileno()
        prefix, min_size, max_size = FRAME
        while True:
            try:  # up to 64 datagrams per call, the GIL released while it waits
                batch = recv_batch(fd, (), prefix, min_size, max_size, True)  # unverified
            except OSError:
                if self._stopping or not go_on():
                    return
                continue  # e.g. an ICMP error reported on the socket: keep serving
            if self._stopping or not go_on():
                return
            try:
                self.handle_batch(batch)
            except Exception:  # a bug must not end the acks (as asyncio's loop would not)
                log.exception("heartbeat batch of %d: unexpected error", len(batch))
            if len(batch) < MAX_BATCH:
                # Let datagrams gather: one wake-up per datagram cost more than the
                # datagram itself; an ack 2 ms later changes nothing for a 1 s heartbeat.
                time.sleep(COALESCE_SEC)

    def stop(self) -> None:
        """Stop serving."""
        sock, thread = self._sock, self._thread
        if sock is None:
            return
        self._stopping = True
        self._members_wanted.set()
        # A blocked recvfrom is not woken by close(): send it a datagram of our own.
        host, port = self.address[0], self.address[1]
        wake = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        with contextlib.suppress(OSError):
            sock.sendto(b"", (wake, port))
        if thread is not None:
            thread.join(timeout=5)
        sock.close()
        self._sock = None

    def _send(self, data: bytes, address: tuple[str, int]) -> None:
        """Send without ever blocking: a full send buffer loses the datagram, like a network."""
        sock = self._sock
        if sock is None:
            return
        try:
            sock.sendto(data, socket.MSG_DONTWAIT, address)
        except OSError:
            self.send_errors += 1

    def forget(self, node: str) -> None:
        """Forget the sequence numbers of ``node`` (its lease expired, it registered a new
        incarnation, it was declared DEAD): its next heartbeat starts afresh, whatever its
        incarnation. Receiver processes forget too."""
        with self._guard_lock:
            self._guard.forget(node)
            self._app_guard.forget(node)
        self.on_forget(node)

    def handle_batch(self, batch: list[tuple[bytes, tuple[str, int], int]]) -> None:
        """Datagrams from ``recv_batch`` (in the server thread, unverified): verify with the
        key of the node each names, check replay and skew, queue, then acknowledge them all
        with one ``sendmmsg``."""
        now, mono = self._clock(), time.monotonic()
        revision = self._leader_revision()
        queued: list[Received | ReceivedApp] = []
        acks: list[tuple[bytes, tuple[str, int], bytes]] = []
        rejected: list[str] = []
        check, ack, verified = self._guard.check_fields, revision > 0, self.keys.verified
        members, budget, home = self.members, self.budget, self._home

        def refuse(reason: str, source: str) -> None:
            rejected.append(reason)
            budget.charge(source, mono)
            if reason == "member":
                self._members_wanted.set()

        with self._guard_lock:  # one acquire per batch
            for data, addr, _ in batch:
                source = addr[0]
                if budget.exhausted(source, mono) and home.get(_name(data)) != source:
                    rejected.append("rate")
                    continue
                fields = parse_heartbeat(data)
                if fields is not None:  # the common case, without message objects
                    raw, incarnation, counter, sent_at, probe_reply = fields
                    node = raw.decode("ascii")
                    if members is not None and node not in members:
                        refuse("member", source)  # before any key work
                        continue
                    signer = verified(node, data, members is not None)  # nothing read is
                    if signer is None:                                  # used before this
                        refuse("signature", source)
                        continue
                    problem = check(node, incarnation, counter, sent_at, now)
                    if problem is not None:
                        refuse(problem, source)
                        continue
                    if home.get(node) != source:
                        home[node] = source
                    queued.append(Received(node, sent_at, now, addr, ack, probe_reply,
                                           incarnation, counter))
                    if ack:
                        acks.append((ack_body(raw, incarnation, counter, sent_at, revision, now),
                                     addr, signer))
                    continue
                try:
                    if members is not None and claimed_node(data) not in members:
                        refuse("member", source)
                        continue
                    msg = decode_from_node(data, self.keys)
                except BadDatagram as exc:
                    refuse(exc.reason, source)
                    continue
                if type(msg) is Heartbeat:  # parse_heartbeat takes every valid one
                    log.error("heartbeat from %s missed the fast path: %r", addr, msg)
                    rejected.append("field")
                elif type(msg) is AppReport:
                    problem = self._app_guard.check_fields(msg.node, msg.incarnation,
                                                           msg.counter, msg.sent_at, now)
                    if problem is not None:
                        refuse(f"app-{problem}", source)
                        continue
                    queued.append(ReceivedApp(msg.node, now, msg.ranks, msg.incarnation,
                                              msg.counter, msg.sent_at))
                else:
                    refuse("kind", source)  # acks and probes are never sent to a coordinator
        # Queued before the acks go out: whoever has seen an ack finds its heartbeat.
        self.deliver(queued, rejected)
        if acks and self._sock is not None:
            try:
                self.send_errors += sign_send(self._sock.fileno(), None, acks)
            except (OSError, ValueError) as exc:  # e.g. the socket closed under us
                self.send_errors += len(acks)
                log.warning("acks not sent: %s", exc)

    def deliver(self, queued: list[Received | ReceivedApp], rejected: list[str]) -> None:
        """Count and queue what a batch gave (a receiver process sends it to the coordinator
        instead)."""
        for reason in rejected:
            self.rejected[reason] += 1
            self._on_result(reason, 1)
        if queued:
            self.accepted += len(queued)
            self._on_result("accepted", len(queued))
            self._queue.put(queued)

    def accept_forwarded(self, records: list[Received | ReceivedApp],
                         rejected: list[str]) -> None:
        """What a receiver process accepted: checked again by this server's replay guards
        (a replay sent to another receiver's port hash must not pass), then queued."""
        now_ok: list[Received | ReceivedApp] = []
        with self._guard_lock:
            for r in records:
                if type(r) is Received:
                    problem = self._guard.check_fields(r.node, r.incarnation, r.counter,
                                                       r.sent_at, r.received_at)
                else:
                    problem = self._app_guard.check_fields(r.node, r.incarnation, r.counter,
                                                           r.sent_at, r.received_at)
                    problem = problem and f"app-{problem}"
                if problem is None:
                    now_ok.append(r)
                else:
                    rejected.append(problem)
        self.deliver(now_ok, rejected)

    def drain(self) -> list[Received | ReceivedApp]:
        """Every heartbeat and app report verified since the last call."""
        self.collect()
        out: list[Received | ReceivedApp] = []
        while True:
            try:
                out += self._queue.get_nowait()
            except queue.Empty:
                return out

    def send_probe(self, node: str, address: tuple[str, int], nonce: int) -> None:
        """Ask a node's agent to answer at once (thread-safe: one sendto on the socket),
        signed with that node's key."""
        self._send(encode(Probe(node, nonce, self._clock()), self.keys.key(node)), address)


def _name(data: bytes) -> str:
    """The node a datagram names, '' if none can be read (no key is used)."""
    try:
        return claimed_node(data)
    except BadDatagram:
        return ""


def bind(address: tuple[str, int], reuse_port: bool = False) -> socket.socket:
    """A UDP socket bound to ``address`` (a host name may resolve to IPv4 or IPv6);
    ``reuse_port``: shared with the other sockets of this user bound so (SO_REUSEPORT)."""
    error: OSError = OSError(f"cannot resolve {address[0]!r}")
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(
            address[0], address[1], type=socket.SOCK_DGRAM):
        sock = socket.socket(family, kind, proto)
        try:
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(sockaddr)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        return sock
    raise error
