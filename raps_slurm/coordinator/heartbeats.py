"""The coordinator's UDP side: receive and verify heartbeats, acknowledge, send probes.

An asyncio datagram endpoint runs in its own thread so that a slow etcd or Slurm call
in the main loop never delays an acknowledgement (a late ack shortens the agent's
``valid_until``). Verified heartbeats are queued for the main loop, which owns the
detector. Only a coordinator that leads by its own clock acknowledges: an ack is a
promise that the node may go on until ``sent_at + miss window``, and a deposed leader
must not make it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import typing
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


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, server: HeartbeatServer) -> None:
        self.server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A datagram endpoint's transport (its class is private to asyncio).
        self.server.transport = typing.cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.server.handle(data, addr)


class HeartbeatServer:
    """Receives on ``address``; ``leader_revision()`` > 0 while this coordinator may ack."""

    def __init__(self, address: tuple[str, int], key: bytes, max_skew: float,
                 leader_revision: Callable[[], int],
                 clock: Callable[[], float] = time.time,
                 on_result: Callable[[str], None] | None = None) -> None:
        self.address, self._key, self._clock = address, key, clock
        self._leader_revision = leader_revision
        self._guard = ReplayGuard(max_skew)
        self._app_guard = ReplayGuard(max_skew)  # app reports count on their own
        self._queue: queue.SimpleQueue[Received | ReceivedApp] = queue.SimpleQueue()
        self.transport: asyncio.DatagramTransport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.accepted = 0
        self.rejected: Counter[str] = Counter()  # reason -> count
        self._on_result = on_result or (lambda result: None)  # metrics, thread-safe

    def start(self) -> None:
        """Bind and serve in a thread; raises OSError if the address cannot be bound."""
        self._thread = threading.Thread(target=self._run, name="heartbeat-server", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(loop.create_datagram_endpoint(
                lambda: _Protocol(self), local_addr=self.address))
        except OSError as exc:
            self._error = exc
            self._ready.set()
            return
        assert self.transport is not None
        self.address = self.transport.get_extra_info("sockname")[:2]
        self._ready.set()
        loop.run_forever()
        self.transport.close()
        loop.close()

    def stop(self) -> None:
        """Stop serving."""
        if self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def handle(self, data: bytes, addr: tuple[str, int]) -> None:
        """One datagram (in the server thread): verify, check replay/skew, ack, queue."""
        try:
            msg = decode(data, self._key)
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
        if revision > 0 and self.transport is not None:
            ack = Ack(msg.node, msg.incarnation, msg.counter, msg.sent_at, revision, now)
            self.transport.sendto(encode(ack, self._key), addr)
        self._queue.put(Received(msg.node, msg.sent_at, now, addr, revision > 0,
                                 msg.probe_reply))

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
        """Ask a node's agent to answer at once (thread-safe)."""
        if self.loop is None or self.transport is None:
            return
        data = encode(Probe(node, nonce, self._clock()), self._key)
        transport = self.transport
        self.loop.call_soon_threadsafe(transport.sendto, data, address)
