"""Python's own floor for ``rapsctl bench mpi``: the same ping-pong over plain TCP.

Two processes of this interpreter on 127.0.0.1, blocking sockets with TCP_NODELAY and
preallocated buffers, ``sendall`` and ``recv_into``: no framing, MAC, log or thread
hand-off. What RAPS adds to a message is the gap between its figure and this one; what
Python itself costs against Open MPI is the gap between this one and Open MPI's (whose
ranks poll rather than sleep in the kernel).

With ``handoff`` each side reads on a thread of its own that hands every message to the
main thread through a condition variable, as the RAPS runtime's reader threads did
until the waiting thread read its own connections: the gap between the two latencies is
what that hand-off alone costs.

With ``logged`` each message gets the work RAPS's design requires of it, and nothing
else (no framing, sequence, thread, lock, log store or disk): the sender checksums it
(CRC-32C, which the log records), copies it into new memory that it keeps (the log holds
every message until a checkpoint covers it, and the application may change its buffer
after a send), and MACs it with keyed blake3 in pieces as it sends it; the receiver MACs
each piece as it comes and checks the tag. That ping-pong's figures are the most a
message logged and authenticated this way can reach in Python on this machine.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from raps_slurm.runtime.msglog import checksum
from raps_slurm.wire.framing import STREAM_PIECE, TAG_SIZE, FrameMac, send_views
from raps_slurm.wire.pool import unfilled


def _fill(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the echo process went away")
        got += n


class _Handoff:
    """A reader thread that hands each ``nbytes`` message to :meth:`get`."""

    def __init__(self, sock: socket.socket, nbytes: int) -> None:
        self.sock, self.nbytes = sock, nbytes
        self.got: collections.deque[bytes] = collections.deque()
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = memoryview(bytearray(self.nbytes))
        try:
            while True:
                _fill(self.sock, buf)
                with self.cond:
                    self.got.append(bytes(buf))
                    self.cond.notify()
        except OSError:
            return

    def get(self) -> None:
        with self.cond:
            while not self.got:
                self.cond.wait(5)
            self.got.popleft()


class _Logged:
    """One side of a logged ping-pong (the module docstring): :meth:`send` and
    :meth:`receive` ``buf`` with the work each message needs."""

    def __init__(self, sock: socket.socket, key: bytes, side: bytes) -> None:
        self.sock = sock
        self.out = FrameMac(key, "blake3", side)
        self.back = FrameMac(key, "blake3", b"e" if side == b"s" else b"s")
        self.log: list[Any] = []
        self.tag = memoryview(bytearray(TAG_SIZE))

    def send(self, buf: memoryview) -> None:
        checksum(buf)
        kept = unfilled(len(buf))
        memoryview(kept)[:] = buf
        self.log.append(kept)
        h = self.out.hasher()
        for i in range(0, len(buf), STREAM_PIECE):
            piece = buf[i:i + STREAM_PIECE]
            h.update(piece)
            if i + STREAM_PIECE < len(buf):
                self.sock.sendall(piece)
        send_views(self.sock, [piece, memoryview(self.out.finish(h))])

    def receive(self, buf: memoryview) -> None:
        h = self.back.hasher()
        for i in range(0, len(buf), STREAM_PIECE):
            piece = buf[i:i + STREAM_PIECE]
            _fill(self.sock, piece)
            h.update(piece)
        _fill(self.sock, self.tag)
        self.back.verify(h, self.tag)


def _ends(sock: socket.socket, buf: memoryview, handoff: bool, logged: tuple[bytes, bytes]
          | None) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(send, receive)`` of ``buf`` on ``sock``; ``logged``: (key, this side's label)."""
    if logged is not None:
        side = _Logged(sock, *logged)
        return lambda: side.send(buf), lambda: side.receive(buf)
    if handoff:
        return lambda: sock.sendall(buf), _Handoff(sock, len(buf)).get
    return lambda: sock.sendall(buf), lambda: _fill(sock, buf)


def pingpong(nbytes: int, round_trips: int, warmup: int, handoff: bool = False,
             logged: bool = False) -> float:
    """Seconds of ``round_trips`` round trips of ``nbytes`` (after ``warmup`` untimed);
    ``handoff``: messages are read on a thread; ``logged``: each message gets the work of
    a logged, authenticated one (the module docstring)."""
    key = os.urandom(32) if logged else b""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    # The echo side's address is known before it connects: a connection from anyone
    # else on this host is closed, not timed.
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.bind(("127.0.0.1", 0))
    echo = c.getsockname()
    total = warmup + round_trips
    pid = os.fork()
    if pid == 0:  # the echo side: receive, send back, round after round
        code = 1
        try:
            srv.close()
            c.connect(("127.0.0.1", port))
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = memoryview(bytearray(nbytes))
            send, receive = _ends(c, buf, handoff, (key, b"e") if logged else None)
            for _ in range(total):
                receive()
                send()
            code = 0
        finally:
            os._exit(code)
    c.close()
    s: socket.socket | None = None
    try:
        srv.settimeout(30)
        while True:
            s, peer = srv.accept()
            if peer[:2] == echo:
                break
            s.close()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(nbytes))
        send, receive = _ends(s, buf, handoff, (key, b"s") if logged else None)
        for _ in range(warmup):
            send()
            receive()
        start = time.perf_counter()
        for _ in range(round_trips):
            send()
            receive()
        return time.perf_counter() - start
    finally:
        srv.close()
        if s is not None:
            s.close()  # an echo side still waiting reads the end and exits
        _, status = os.waitpid(pid, 0)
        if status:
            raise ConnectionError(f"the echo process ended with status {status}")


def figures(iterations: int, warmup: int, latency_factor: int, sizes: dict[str, int]
            ) -> dict[str, float]:
    """The MPI benchmark's ping-pong figures for plain TCP: half round-trip latency at 8
    bytes (us), read directly and through a reader thread, and, per ``sizes`` key,
    bandwidth (MB/s, both directions counted), plain and logged (key + ``_logged``).
    No logged latency: these ranks sleep in the kernel, where RAPS's poll a while, and on
    a virtual machine the wake-up (20-45 us on the project's test machine) would hide the
    few microseconds the work adds to a small message."""
    n = iterations * latency_factor
    out = {"lat_8B": pingpong(8, n, warmup * latency_factor) / n / 2 * 1e6,
           "lat_8B_thread": pingpong(8, n, warmup * latency_factor, handoff=True) / n / 2 * 1e6}
    for key, nbytes in sizes.items():
        out[key] = 2 * nbytes * iterations / pingpong(nbytes, iterations, warmup) / 1e6
        out[f"{key}_logged"] = 2 * nbytes * iterations / pingpong(
            nbytes, iterations, warmup, logged=True) / 1e6
    return out
