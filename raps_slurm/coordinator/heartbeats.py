"""The coordinator's UDP side: receive and verify heartbeats, acknowledge, send probes.

A thread of its own reads the socket so that a slow etcd or Slurm call in the main loop
never delays an acknowledgement (a late ack shortens the agent's ``valid_until``).
Verified heartbeats are queued for the main loop, which owns the detector. Only a
coordinator that leads by its own clock acknowledges: an ack is a promise that the node
may go on until ``sent_at + miss window``, and a deposed leader must not make it.

The thread blocks in ``recvfrom`` on a plain socket: an asyncio endpoint cost about twice
the CPU per datagram (55-60 µs against 22-32 µs with its ack: an epoll round and a loop
iteration for each one), which capped a coordinator near 15,000 nodes against 25,000 now
(``rapsctl bench heartbeats``, docs/benchmarks.md). The receive buffer is
enlarged so that the main loop holding the GIL for a while (a large etcd read) delays
heartbeats instead of dropping them.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from raps_slurm.errors import BadDatagram
from raps_slurm.heartbeat import (
    Ack,
    AppReport,
    Heartbeat,
    Probe,
    RankProgress,
    ReplayGuard,
    decode,
    encode,
)

log = logging.getLogger("raps.coordinator")


@dataclass(frozen=True)
class Received:
    """One verified heartbeat, as the detector needs it."""

    node: str
    sent_at: float
    received_at: float
    address: tuple[str, int]
    acked: bool
    probe_reply: bool


@dataclass(frozen=True)
class ReceivedApp:
    """One verified app report: the ranks of ``node`` that heartbeated since its last one."""

    node: str
    received_at: float
    ranks: tuple[RankProgress, ...]


# Receive buffer asked for; Linux grants at most twice net.core.rmem_max (4 MiB here, so
# 8 MiB: ~10,000 heartbeats). The default 208 KiB holds ~15 ms of them at 20,000/s.
RECEIVE_BUFFER = 8 << 20


class HeartbeatServer:
    """Receives on ``address``; ``leader_revision()`` > 0 while this coordinator may ack."""

    def __init__(self, address: tuple[str, int], key: bytes, max_skew: float,
                 leader_revision: Callable[[], int],
                 clock: Callable[[], float] = time.time,
                 on_result: Callable[[str], None] | None = None,
                 accepted_key: bytes | None = None) -> None:
        self.address, self._key, self._clock = address, key, clock
        self._also = accepted_key  # a rollover's other key: accepted, never used to sign
        self._leader_revision = leader_revision
        self._guard = ReplayGuard(max_skew)
        self._app_guard = ReplayGuard(max_skew)  # app reports count on their own
        self._queue: queue.SimpleQueue[Received | ReceivedApp] = queue.SimpleQueue()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.accepted = 0
        self.send_errors = 0  # acks and probes the kernel refused (send buffer full)
        self.rejected: Counter[str] = Counter()  # reason -> count
        self._on_result = on_result or (lambda result: None)  # metrics, thread-safe

    def start(self) -> None:
        """Bind and serve in a thread; raises OSError if the address cannot be bound."""
        self._sock = _bind(self.address)
        self.address = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._run, args=(self._sock,),
                                        name="heartbeat-server", daemon=True)
        self._thread.start()

    def _run(self, sock: socket.socket) -> None:
        receive, handle = sock.recvfrom, self.handle  # bound once: this runs per datagram
        while True:
            try:
                data, addr = receive(2048)
            except OSError:
                if self._stopping:
                    return
                continue  # e.g. an ICMP error reported on the socket: keep serving
            if self._stopping:
                return
            try:
                handle(data, addr)
            except Exception:  # a bug must not end the acks (as asyncio's loop would not)
                log.exception("heartbeat from %s: unexpected error", addr)

    def stop(self) -> None:
        """Stop serving."""
        sock, thread = self._sock, self._thread
        if sock is None:
            return
        self._stopping = True
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

    def handle(self, data: bytes, addr: tuple[str, int]) -> None:
        """One datagram (in the server thread): verify, check replay/skew, ack, queue."""
        try:
            msg = decode(data, self._key, self._also)
        except BadDatagram as exc:
            self._reject(exc.reason)
            return
        now = self._clock()
        if isinstance(msg, AppReport):
            problem = self._app_guard.check(
                Heartbeat(msg.node, msg.incarnation, msg.counter, msg.sent_at), now)
            if problem is not None:
                self._reject(f"app-{problem}")
                return
            self.accepted += 1
            self._on_result("accepted")
            self._queue.put(ReceivedApp(msg.node, now, msg.ranks))
            return
        if not isinstance(msg, Heartbeat):
            self._reject("kind")  # acks and probes are never sent to a coordinator
            return
        problem = self._guard.check(msg, now)
        if problem is not None:
            self._reject(problem)
            return
        self.accepted += 1
        self._on_result("accepted")
        revision = self._leader_revision()
        # Queued before the ack goes out: whoever has seen the ack finds the heartbeat.
        self._queue.put(Received(msg.node, msg.sent_at, now, addr, revision > 0,
                                 msg.probe_reply))
        if revision > 0:
            ack = Ack(msg.node, msg.incarnation, msg.counter, msg.sent_at, revision, now)
            self._send(encode(ack, self._key), addr)

    def _reject(self, reason: str) -> None:
        self.rejected[reason] += 1
        self._on_result(reason)

    def drain(self) -> list[Received | ReceivedApp]:
        """Every heartbeat and app report verified since the last call."""
        out: list[Received | ReceivedApp] = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def send_probe(self, node: str, address: tuple[str, int], nonce: int) -> None:
        """Ask a node's agent to answer at once (thread-safe: one sendto on the socket)."""
        self._send(encode(Probe(node, nonce, self._clock()), self._key), address)


def _bind(address: tuple[str, int]) -> socket.socket:
    """A UDP socket bound to ``address`` (a host name may resolve to IPv4 or IPv6)."""
    error: OSError = OSError(f"cannot resolve {address[0]!r}")
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(
            address[0], address[1], type=socket.SOCK_DGRAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        return sock
    raise error
