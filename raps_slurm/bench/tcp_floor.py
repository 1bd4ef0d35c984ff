"""Python's own floor for ``rapsctl bench mpi``: the same ping-pong over plain TCP.

Two processes of this interpreter on 127.0.0.1, blocking sockets with TCP_NODELAY and
preallocated buffers, ``sendall`` and ``recv_into``: no framing, MAC, log or thread
hand-off. What RAPS adds to a message is the gap between its figure and this one; what
Python itself costs against Open MPI is the gap between this one and Open MPI's (whose
ranks poll rather than sleep in the kernel).
"""

from __future__ import annotations

import os
import socket
import time


def _fill(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the echo process went away")
        got += n


def pingpong(nbytes: int, round_trips: int, warmup: int) -> float:
    """Seconds of ``round_trips`` round trips of ``nbytes`` (after ``warmup`` untimed)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    total = warmup + round_trips
    pid = os.fork()
    if pid == 0:  # the echo side: receive, send back, round after round
        code = 1
        try:
            srv.close()
            c = socket.create_connection(("127.0.0.1", port))
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = memoryview(bytearray(nbytes))
            for _ in range(total):
                _fill(c, buf)
                c.sendall(buf)
            code = 0
        finally:
            os._exit(code)
    s: socket.socket | None = None
    try:
        srv.settimeout(30)
        s, _ = srv.accept()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(nbytes))
        for _ in range(warmup):
            s.sendall(buf)
            _fill(s, buf)
        start = time.perf_counter()
        for _ in range(round_trips):
            s.sendall(buf)
            _fill(s, buf)
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
    bytes (us) and, per ``sizes`` key, bandwidth (MB/s, both directions counted)."""
    n = iterations * latency_factor
    out = {"lat_8B": pingpong(8, n, warmup * latency_factor) / n / 2 * 1e6}
    for key, nbytes in sizes.items():
        out[key] = 2 * nbytes * iterations / pingpong(nbytes, iterations, warmup) / 1e6
    return out
