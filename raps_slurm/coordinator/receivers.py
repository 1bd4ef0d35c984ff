"""More cores for heartbeats: receiver processes on the coordinator's UDP port.

With ``coordinator.heartbeat_receivers`` = N > 1 the coordinator binds its heartbeat
port with SO_REUSEPORT and starts N - 1 receiver processes bound the same way; the
kernel hashes each agent's address to one of the N sockets. A receiver verifies,
checks replays and acknowledges as the coordinator's own receiver thread does
(``HeartbeatServer``), and sends what it accepted to the coordinator through a pipe
*before* it acknowledges. The coordinator reads the pipes in a thread and, in full,
before each detector step (``HeartbeatServer.drain``): an acknowledged heartbeat is
always seen before a verdict could depend on it, as with its own receiver.

Acks need leadership: the coordinator publishes (leader revision, valid until) on its
monotonic clock, which is the host's, in shared memory after every loop step; a
receiver acks only while that says it leads, and a deposed leader's receivers stop at
the same instant as its own thread. The coordinator's replay guard checks every
forwarded heartbeat again: a receiver only knows the nodes hashed to it, and a replay
sent from another source port would land elsewhere. When the coordinator forgets a
node's sequence numbers (``HeartbeatServer.forget``), every receiver is told through a
second pipe and forgets too. The cluster's node names (``HeartbeatServer.members``)
reach the receivers the same way: the coordinator writes them to a file of its own and
sends a NUL byte, on which a receiver reads the file again (a name never contains one);
a receiver started later reads it at once. Each receiver keeps its own per-source
budget, of the coordinator's rate and burst. A receiver that dies is started
again; its agents are meanwhile hashed to the other sockets by the kernel. A receiver
exits when its coordinator is gone.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from raps_slurm.coordinator.heartbeats import HeartbeatServer, Received, ReceivedApp, bind

log = logging.getLogger("raps.coordinator")

RESTART_AFTER_SEC = 5.0  # a receiver that died is started again at most this often
READY_TIMEOUT_SEC = 30.0  # a receiver's start: a new interpreter and its imports
READY = b""  # a receiver's first message: it is bound
MEMBERS = b"\0"  # on the forgets pipe: read the cluster's node names again
_TIMEOUT = struct.pack("ll", 1, 0)  # a receiver's socket wakes every second to check its parent


class ReceiverPool:
    """``count - 1`` receiver processes beside ``server`` (started, bound, with SO_REUSEPORT)."""

    def __init__(self, server: HeartbeatServer, count: int, key: bytes,
                 accepted_key: bytes | None, max_skew: float) -> None:
        self.server, self.count = server, count
        self._args = (key, accepted_key, max_skew)
        self._ctx = multiprocessing.get_context("spawn")
        # (revision, valid_until): written by the coordinator, read by every receiver.
        self._leader: Any = self._ctx.Array("d", 2)  # a synchronized array of 2 doubles
        self._procs: list[BaseProcess | None] = [None] * (count - 1)
        self._conns: list[Connection | None] = [None] * (count - 1)
        self._forgets: list[Connection | None] = [None] * (count - 1)  # to each receiver
        self._started_at = [0.0] * (count - 1)
        self._lock = threading.Lock()  # one reader of the pipes at a time
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        fd, self._members_path = tempfile.mkstemp(prefix="raps-members-")
        os.close(fd)  # empty: no list yet, every name is heard
        self.forwarded = 0  # heartbeats and app reports the receivers sent (before the guard)

    def start(self) -> None:
        """Start every receiver, then the thread that reads their pipes."""
        for i in range(self.count - 1):
            self._spawn(i)
        for i, conn in enumerate(self._conns):  # each says it is bound, or failed to
            try:
                ready = conn is not None and conn.poll(READY_TIMEOUT_SEC) and (
                    conn.recv_bytes() == READY)
            except (EOFError, OSError):
                ready = False
            if not ready:
                self.stop()
                raise OSError(f"heartbeat receiver {i + 1} did not start (see its log above)")
        self.server.collect = self.collect
        self.server.on_forget = self.forget
        self.server.on_members = self.members
        if self.server.members is not None:
            self.members(frozenset(self.server.members))
        self._thread = threading.Thread(target=self._read_loop, name="receiver-pipes",
                                        daemon=True)
        self._thread.start()

    def _spawn(self, i: int) -> None:
        ours, theirs = self._ctx.Pipe(duplex=False)
        forgets_in, forgets_out = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(
            target=_receiver_main, name=f"raps-receiver-{i + 1}",
            args=(self.server.address, *self._args, self._leader, theirs, os.getpid(),
                  forgets_in, self._members_path, self.server.budget.rate,
                  self.server.budget.burst),
            daemon=True)
        proc.start()
        theirs.close()
        forgets_in.close()
        # Never blocks the coordinator: a receiver too busy to read loses a forget (its
        # guard then waits for the next one); a name fits one atomic pipe write.
        os.set_blocking(forgets_out.fileno(), False)
        old = self._forgets[i]
        if old is not None:
            old.close()
        self._procs[i], self._conns[i], self._forgets[i] = proc, ours, forgets_out
        self._started_at[i] = time.monotonic()
        os.write(self._wake_w, b"x")  # the reader thread picks up the new pipe

    def forget(self, node: str) -> None:
        """Tell every receiver to forget ``node``'s sequence numbers."""
        for conn in self._forgets:
            if conn is not None:
                # full (BlockingIOError) or the receiver is gone
                with contextlib.suppress(OSError):
                    conn.send_bytes(node.encode("ascii"))

    def members(self, names: frozenset[str]) -> None:
        """The cluster's node names changed: written to the file, every receiver told."""
        tmp = f"{self._members_path}.new"
        with open(tmp, "w", encoding="ascii") as f:
            f.write("".join(f"{n}\n" for n in sorted(names)) or "\n")
        os.replace(tmp, self._members_path)
        for conn in self._forgets:
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send_bytes(MEMBERS)

    def publish(self, revision: int, valid_until: float) -> None:
        """This coordinator leads with ``revision`` until ``valid_until`` (monotonic);
        revision 0: it does not lead."""
        with self._leader.get_lock():
            self._leader[0], self._leader[1] = float(revision), valid_until

    def collect(self) -> None:
        """Bring in everything the receivers sent so far; start a dead one again."""
        with self._lock:
            for i, conn in enumerate(self._conns):
                if conn is not None:
                    self._read_all(i, conn)
        now = time.monotonic()
        for i, proc in enumerate(self._procs):
            if (proc is not None and proc.exitcode is not None and not self._stopping
                    and now - self._started_at[i] >= RESTART_AFTER_SEC):
                log.error("heartbeat receiver %d exited with %s: starting it again", i + 1,
                          proc.exitcode)
                conn = self._conns[i]
                if conn is not None:
                    conn.close()
                self._spawn(i)

    def _read_all(self, i: int, conn: Connection) -> None:
        """Every message pending on ``conn`` (with the lock held)."""
        try:
            while conn.poll(0):
                data = conn.recv_bytes()
                if data == READY:  # a restarted receiver is bound
                    continue
                records, rejected = pickle.loads(data)
                self.forwarded += len(records)
                self.server.accept_forwarded(records, rejected)
        except (EOFError, OSError):
            conn.close()
            self._conns[i] = None  # its receiver is gone: collect() starts another

    def _read_loop(self) -> None:
        while not self._stopping:
            conns: list[Any] = [c for c in self._conns if c is not None]
            try:
                # poll(2), not select(2): a descriptor above 1023 (a busy leader
                # restarting a receiver) is a ValueError for select, and this loop spun.
                ready = wait([*conns, self._wake_r], 1.0)
            except (OSError, ValueError):
                continue  # a pipe closed meanwhile: look again
            if self._wake_r in ready:
                os.read(self._wake_r, 64)
            with self._lock:
                for i, conn in enumerate(self._conns):
                    if conn is not None and conn in ready:
                        self._read_all(i, conn)

    def stop(self) -> None:
        """Stop the receivers (SIGTERM, then SIGKILL) and the reader thread."""
        self._stopping = True
        os.write(self._wake_w, b"x")
        for proc in self._procs:
            if proc is not None and proc.exitcode is None:
                proc.terminate()
        for proc in self._procs:
            if proc is not None:
                proc.join(timeout=5)
                if proc.exitcode is None:
                    proc.kill()
                    proc.join(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)
        for conn in (*self._conns, *self._forgets):
            if conn is not None:
                conn.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with contextlib.suppress(OSError):
            os.unlink(self._members_path)


def _receiver_main(address: tuple[str, int], key: bytes, accepted_key: bytes | None,
                   max_skew: float, leader: Any,
                   conn: Connection, parent: int, forgets: Connection,
                   members_path: str, source_rate: float, source_burst: float) -> None:
    """Entry of a receiver process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator stops us with SIGTERM
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def leader_revision() -> int:
        with leader.get_lock():
            revision, valid_until = leader[0], leader[1]
        return int(revision) if time.monotonic() < valid_until else 0

    server = _Forwarding(conn, address, key, max_skew, leader_revision,
                         accepted_key=accepted_key, source_rate=source_rate,
                         source_burst=source_burst)
    sock = bind(address, reuse_port=True)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEOUT)
    _read_members(server, members_path)
    conn.send_bytes(READY)

    def go_on() -> bool:
        try:
            while forgets.poll(0):  # what the coordinator forgot, we forget
                message = forgets.recv_bytes()
                if message == MEMBERS:
                    _read_members(server, members_path)
                else:
                    server.forget(message.decode("ascii"))
        except (EOFError, OSError):
            return False  # the coordinator is gone
        return os.getppid() == parent

    server.serve(sock, go_on=go_on)


def _read_members(server: HeartbeatServer, path: str) -> None:
    """The node names the coordinator wrote (an empty file: none known yet)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("cannot read the cluster's node names from %s: %s", path, exc)
        return
    if text:
        server.set_members(n for n in text.split("\n") if n)


class _Forwarding(HeartbeatServer):
    """A receiver process's server: what it accepts goes to the coordinator's pipe."""

    def __init__(self, conn: Connection, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._conn = conn

    def deliver(self, queued: list[Received | ReceivedApp], rejected: list[str]) -> None:
        if queued or rejected:
            # Blocking: the coordinator has it before the acks of this batch go out.
            self._conn.send_bytes(pickle.dumps((queued, rejected), pickle.HIGHEST_PROTOCOL))
