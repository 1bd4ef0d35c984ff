"""raps-run's side of the control channel: the listener its node supervisors connect to,
and one :class:`RankHandle` per started rank, with the ``poll``/``send_signal``/``kill``/
``wait`` face of ``subprocess.Popen`` backed by the supervisors' reports.

The listener bounds what it accepts (:class:`raps_slurm.wire.gate.Gate`): at most
:data:`HANDSHAKES` connections in their handshake at once, :data:`PER_SOURCE` of them
from one address, each for at most :data:`AUTH_SEC`; when all are taken a new one
evicts the oldest unauthenticated connection of the address holding the most, so
strangers that connect and say nothing cannot keep a supervisor out (it retries until
it gets through). Hellos come only from nodes raps-run started a step on. Each refusal
is counted by kind (``busy``, ``evicted``, ``source``, ``timeout``, ``auth``,
``malformed``, ``unexpected``, ...) and said at most once per kind and 10 s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

from raps_slurm.launcher.channel import AUTH_SEC, ENV_ADDRESS, ENV_KEY, Channel, accept
from raps_slurm.logquota import LogQuota
from raps_slurm.wire.framing import FrameError
from raps_slurm.wire.gate import Gate

# A rank whose supervisor's connection dropped (its node died, its step ended) counts as
# exited at that moment with this code, as ``Popen`` reports a SIGKILLed process.
LOST_EXIT = -9
HANDSHAKES = 32  # connections authenticating at once (an authenticated one holds no slot)
PER_SOURCE = 16  # of those, from one address

log = logging.getLogger("raps.run")


def _stderr_logger() -> None:
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("raps-run: %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


class RankHandle:
    """One incarnation (rank, epoch) on ``node``; ``returncode`` None while it runs."""

    def __init__(self, ctl: ControlServer, node: str, rank: int, epoch: int) -> None:
        self._ctl, self.node, self.rank, self.epoch = ctl, node, rank, epoch
        self.pid: int | None = None
        self.returncode: int | None = None
        self.cpus: list[int] = []
        # The supervisor found the node's agent out of reach when the rank failed.
        self.agent_lost = False

    def poll(self) -> int | None:
        """The exit code once the rank ended (or was killed or lost), else None."""
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Have the supervisor signal the rank (nothing if it ended or has not started)."""
        if self.returncode is None:
            self._ctl.command(self.node, {"op": "signal", "rank": self.rank,
                                          "epoch": self.epoch, "signum": int(signum)})

    def kill(self) -> None:
        """Have the supervisor SIGKILL the rank; from now on it counts as exited (-9), as a
        killed local process would, whatever the supervisor reports later."""
        if self.returncode is None:
            self._ctl.command(self.node, {"op": "kill", "rank": self.rank, "epoch": self.epoch})
            self._ctl.ended(self, LOST_EXIT)

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, waiting up to ``timeout``; subprocess.TimeoutExpired."""
        with self._ctl.cond:
            if not self._ctl.cond.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class _Link:
    """One authenticated supervisor."""

    def __init__(self, chan: Channel, pid: int, cpus: list[int]) -> None:
        self.chan, self.pid, self.cpus = chan, pid, cpus
        self.handles: dict[tuple[int, int], RankHandle] = {}
        self.alive = True


class ControlServer:
    """The listener and the supervisors linked to it (thread-safe)."""

    def __init__(self, host: str, key: bytes | None = None, backlog: int = 128) -> None:
        _stderr_logger()
        self.key = key or os.urandom(32)
        self.cond = threading.Condition()
        self.links: dict[str, _Link] = {}
        self.expected: set[str] = set()
        self.pending: dict[str, list[tuple[RankHandle, dict[str, Any]]]] = {}
        self.refused: Counter[str] = Counter()
        self._quota = LogQuota(log, 10.0)
        self._gate = Gate(HANDSHAKES, self._gate_refused, per_source=PER_SOURCE,
                          deadline=AUTH_SEC)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(backlog)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="control-accept",
                                        daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """``host:port`` as supervisors are told (``[v6]:port`` for IPv6)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """What a supervisor step needs in its environment."""
        return {ENV_ADDRESS: self.address, ENV_KEY: self.key.hex()}

    # -- what raps-run asks -------------------------------------------------------------

    def expect(self, node: str) -> None:
        """A step with a supervisor on ``node`` was started: accept its hello."""
        with self.cond:
            self.expected.add(node)

    def linked(self, node: str) -> bool:
        """Whether ``node``'s supervisor is connected."""
        with self.cond:
            link = self.links.get(node)
            return link is not None and link.alive

    def start(self, node: str, rank: int, epoch: int, argv: list[str], env: dict[str, str],
              slot: int, slots: int, label: bool = False) -> RankHandle:
        """Have ``node``'s supervisor start the rank, now or once it connects (``label``:
        each line of its output starts with ``RANK: ``)."""
        h = RankHandle(self, node, rank, epoch)
        msg = {"op": "start", "rank": rank, "epoch": epoch, "argv": argv, "env": env,
               "slot": slot, "slots": slots, "label": label}
        with self.cond:
            link = self.links.get(node)
            if link is None or not link.alive:
                self.pending.setdefault(node, []).append((h, msg))
                return h
            link.handles[(rank, epoch)] = h
        self.command(node, msg)
        return h

    def waiting(self, node: str) -> int:
        """How many starts wait for ``node``'s supervisor to connect."""
        with self.cond:
            return len(self.pending.get(node, []))

    def give_up(self, node: str, code: int) -> list[RankHandle]:
        """``node``'s supervisor will not come (its step ended first): the starts waiting
        for it end with ``code``."""
        with self.cond:
            waiting = self.pending.pop(node, [])
            self.expected.discard(node)
        for h, _ in waiting:
            self.ended(h, code)
        return [h for h, _ in waiting]

    def command(self, node: str, msg: dict[str, Any]) -> bool:
        """Send one command; False (and the link counted lost) when it cannot be sent."""
        with self.cond:
            link = self.links.get(node)
        if link is None or not link.alive:
            return False
        try:
            link.chan.send(msg)
        except FrameError as exc:
            self._lost(node, link, f"send failed: {exc}")
            return False
        return True

    def ended(self, h: RankHandle, code: int) -> None:
        """Record that ``h`` ended (first word wins)."""
        with self.cond:
            if h.returncode is None:
                h.returncode = code
                self.cond.notify_all()

    def close(self) -> None:
        """Tell every supervisor to exit and stop listening."""
        with self.cond:
            self._closed = True
            links = list(self.links.items())
        for _, link in links:
            if link.alive:
                with contextlib.suppress(FrameError):
                    link.chan.send({"op": "exit"}, timeout=2.0)
        self._sock.close()

    # -- the listener -------------------------------------------------------------------

    def _refuse(self, kind: str, detail: str) -> None:
        with self.cond:
            self.refused[kind] += 1
            total = self.refused[kind]
        self._quota.log(kind, logging.WARNING, "control: refused a connection (%s, %d so "
                        "far): %s", kind, total, detail)

    def _gate_refused(self, kind: str) -> None:
        self._refuse(kind, {"busy": f"{HANDSHAKES} connections authenticating",
                            "evicted": "the oldest unauthenticated one, for a newer one",
                            "source": f"its address had {PER_SOURCE} authenticating",
                            "timeout": f"not authenticated within {AUTH_SEC:g} s"}
                     .get(kind, kind))

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed
            with self.cond:
                closed = self._closed
            if closed:
                sock.close()
                self._refuse("busy", f"{peer[0]}: raps-run is closing")
                continue
            if not self._gate.admit(sock, peer[0]):
                sock.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(sock, peer[0]), daemon=True,
                                 name=f"control-{peer[0]}").start()
            except RuntimeError:  # no thread could be started: the slot goes back
                self._gate.leave(sock)
                sock.close()
                self._refuse("busy", f"{peer[0]}: no thread to serve it")

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            chan = self._authenticate(sock, peer)
        finally:
            self._gate.leave(sock)  # authenticated or not, it holds no slot from here
        if chan is not None:
            self._link(chan, peer)

    def _authenticate(self, sock: socket.socket, peer: str
                      ) -> tuple[Channel, dict[str, Any]] | None:
        """The handshake and the hello, within the slot; None (counted) if refused."""
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            chan = accept(sock, self.key, AUTH_SEC)
            hello = chan.recv(idle_timeout=AUTH_SEC)
        except (FrameError, OSError) as exc:
            sock.close()
            if not self._gate.evicted(sock):  # else the gate counted it
                kind = exc.kind if isinstance(exc, FrameError) else "closed"
                self._refuse(kind, f"{peer}: {exc}")
            return None
        return chan, hello

    def _link(self, authenticated: tuple[Channel, dict[str, Any]], peer: str) -> None:
        chan, hello = authenticated
        node, pid, cpus = chan.node, hello.get("pid"), hello.get("cpus")
        old: _Link | None = None
        starts: list[tuple[RankHandle, dict[str, Any]]] = []
        link = _Link(chan, pid if isinstance(pid, int) else 0,
                     [c for c in cpus if isinstance(c, int)] if isinstance(cpus, list) else [])
        with self.cond:
            ok = (hello.get("op") == "hello" and hello.get("node") == node
                  and node in self.expected)
            if ok:
                old = self.links.get(node)
                self.links[node] = link
                self.expected.discard(node)
                starts = self.pending.pop(node, [])
                for h, _ in starts:
                    link.handles[(h.rank, h.epoch)] = h
        if not ok:
            chan.close()
            self._refuse("unexpected", f"{peer}: hello from {node!r}, no step started there")
            return
        if old is not None and old.alive:
            self._lost(node, old, "replaced by a new supervisor")
        log.info("supervisor on %s connected (pid %s, %d CPUs)", node, link.pid, len(link.cpus))
        for h, msg in starts:
            if h.returncode is None:
                self.command(node, msg)
        self._read(node, link)

    def _read(self, node: str, link: _Link) -> None:
        while True:
            try:
                msg = link.chan.recv()
            except FrameError as exc:
                with self.cond:
                    closing = self._closed
                self._lost(node, link, "raps-run closed it" if closing else str(exc))
                return
            op, key = msg.get("op"), (msg.get("rank"), msg.get("epoch"))
            with self.cond:
                h = link.handles.get(key)  # type: ignore[arg-type]
                if h is None:
                    continue
                if op == "started" and isinstance(msg.get("pid"), int):
                    h.pid = msg["pid"]
                    h.cpus = [c for c in msg.get("cpus") or [] if isinstance(c, int)]
                    self.cond.notify_all()
                elif op == "exited" and isinstance(msg.get("code"), int):
                    del link.handles[key]  # type: ignore[arg-type]
                    if h.returncode is None:
                        h.agent_lost = msg.get("agent") is False
                        h.returncode = msg["code"]
                        self.cond.notify_all()

    def _lost(self, node: str, link: _Link, why: str) -> None:
        with self.cond:
            if not link.alive:
                return
            link.alive = False
            if self.links.get(node) is link:
                del self.links[node]
            gone = [h for h in link.handles.values() if h.returncode is None]
            for h in gone:
                h.returncode = LOST_EXIT
            link.handles.clear()
            closing = self._closed
            self.cond.notify_all()
        link.chan.close()
        if not closing:
            ranks = ", ".join(str(h.rank) for h in sorted(gone, key=lambda h: h.rank)) or "none"
            log.info("supervisor on %s lost (%s): its running ranks (%s) count as exited %d",
                     node, why, ranks, LOST_EXIT)

    def wait_started(self, handles: list[RankHandle], timeout: float) -> bool:
        """True once every handle has a pid or ended, within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            return self.cond.wait_for(
                lambda: all(h.pid is not None or h.returncode is not None for h in handles),
                max(0.0, deadline - time.monotonic()))
