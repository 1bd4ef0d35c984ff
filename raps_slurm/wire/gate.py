"""Threaded TCP servers with a bound: at most ``cap`` connections served at once.

Every admitted connection has one thread, so ``cap`` bounds the threads as well. A
connection still reading its first request (before its peer proved who it is) is
*waiting*; when every slot is taken, a new connection evicts the oldest waiting one,
whose thread wakes at once (its socket is shut down) and frees the slot. Hundreds of
connections that send nothing, or one byte now and then, therefore cannot lock a
legitimate peer out: its request takes milliseconds, theirs never end and are the
first to go. A new connection is refused only when every slot holds a peer past its
first request.

Per source (the peer's IP address): the connection evicted is the oldest waiting one of
the source that holds the most waiting slots, so a flood from one host evicts its own
connections before anyone else's. With ``per_source`` a source holds at most that many
waiting slots (its oldest goes when it opens another), and with ``deadline`` a
connection still waiting that long is shut down at the next admission, so a slow peer
holds a slot a bounded time whatever the owner's own read timeouts. The owner counts
each refusal by kind: ``busy`` (no slot), ``evicted`` (for a newer connection),
``source`` (its source's limit) and ``timeout`` (past the deadline). Deadlines on the
requests themselves are the owner's (see :func:`raps_slurm.wire.framing.recv_into`).
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

EVICT_WAIT = 1.0  # seconds the accept loop waits for an evicted connection's slot


def source_of(sock: socket.socket) -> str:
    """The peer's address without its port ('' for a unix socket or a closed one)."""
    try:
        peer = sock.getpeername()
    except OSError:
        return ""
    return str(peer[0]) if isinstance(peer, tuple) else ""


class Gate:
    """The slots of one server; ``count(kind)`` is called for each refusal.
    ``per_source``: waiting slots one source may hold (0: no limit); ``deadline``:
    seconds a connection may stay waiting (0: no limit)."""

    def __init__(self, cap: int, count: Callable[[str], None], *, per_source: int = 0,
                 deadline: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if cap < 1:
            raise ValueError(f"connection cap {cap}: at least 1")
        if per_source < 0 or deadline < 0:
            raise ValueError(f"per_source {per_source}, deadline {deadline}: at least 0")
        self.cap, self.per_source, self.deadline = cap, per_source, deadline
        self._count, self._clock = count, clock
        self._slots = threading.BoundedSemaphore(cap)
        self._lock = threading.Lock()
        # waiting connection -> (admitted at, source), oldest first
        self._waiting: dict[socket.socket, tuple[float, str]] = {}
        self._evicted: set[socket.socket] = set()
        self._exiting: list[threading.Thread] = []  # slot freed, thread not yet ended
        self._held = 0

    def _heaviest(self) -> socket.socket | None:
        """The oldest waiting connection of the source holding the most waiting slots
        (with the lock held)."""
        held = Counter(src for _, src in self._waiting.values())
        if not held:
            return None
        top = max(held.values())
        return next(s for s, (_, src) in self._waiting.items() if held[src] == top)

    def _evict(self, sock: socket.socket) -> None:
        """Mark ``sock`` evicted (with the lock held); the caller shuts it down."""
        del self._waiting[sock]
        self._evicted.add(sock)

    def admit(self, sock: socket.socket, source: str | None = None) -> bool:
        """A slot for ``sock`` from ``source`` (default: its peer's address), in the
        accept loop: connections past the deadline and the source's oldest beyond its
        limit go first, then, when all slots are taken, the oldest waiting connection
        of the heaviest source; False (counted ``busy``) if no slot can be had."""
        src = source_of(sock) if source is None else source
        now = self._clock()
        gone: list[tuple[socket.socket, str]] = []
        with self._lock:
            if self.deadline:
                gone += [(s, "timeout") for s, (at, _) in self._waiting.items()
                         if now - at >= self.deadline]
            for s, _ in gone:
                self._evict(s)
            if self.per_source:
                mine = [s for s, (_, other) in self._waiting.items() if other == src]
                if len(mine) >= self.per_source:
                    self._evict(mine[0])
                    gone.append((mine[0], "source"))
        for s, kind in gone:
            self._count(kind)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        if not self._slots.acquire(blocking=False):
            if not gone:  # no slot is on its way back: make one
                with self._lock:
                    victim = self._heaviest()
                    if victim is not None:
                        self._evict(victim)
                if victim is None:
                    self._count("busy")
                    return False
                self._count("evicted")
                with contextlib.suppress(OSError):
                    victim.shutdown(socket.SHUT_RDWR)
            if not self._slots.acquire(timeout=EVICT_WAIT):
                self._count("busy")
                return False
        with self._lock:
            self._waiting[sock] = (now, src)
            self._held += 1
            exiting, self._exiting = self._exiting, []
        # A thread frees its slot a few instructions before it ends: wait for those, so
        # that the threads alive never outnumber the cap either.
        for thread in exiting:
            thread.join(EVICT_WAIT)
        return True

    def settled(self, sock: socket.socket) -> None:
        """``sock`` is past its first request (its peer proved itself): not evictable."""
        with self._lock:
            self._waiting.pop(sock, None)

    def evicted(self, sock: socket.socket) -> bool:
        """Was ``sock`` evicted (its end is counted already)?"""
        with self._lock:
            return sock in self._evicted

    def leave(self, sock: socket.socket, thread: threading.Thread | None = None) -> None:
        """``sock``'s connection ends: its slot is free. ``thread``, if given, is the
        serving thread, about to end; the next admission waits for it."""
        with self._lock:
            self._waiting.pop(sock, None)
            self._evicted.discard(sock)
            self._held -= 1
            if thread is not None:
                self._exiting.append(thread)
        self._slots.release()

    def in_use(self) -> int:
        """Connections admitted and not yet ended (waiting or not)."""
        with self._lock:
            return self._held

    def waiting(self) -> int:
        """Connections admitted and still waiting (evictable)."""
        with self._lock:
            return len(self._waiting)


class BoundedServer(socketserver.ThreadingTCPServer):
    """A threading TCP server that runs ``serve(sock)`` for each connection ``gate``
    admits and closes the others at once."""

    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    request_queue_size = 1024  # a burst of connections waits in the kernel, not refused

    def __init__(self, address: tuple[str, int], serve: Callable[[socket.socket], None],
                 gate: Gate) -> None:
        self.gate, self._serve = gate, serve
        super().__init__(address, socketserver.BaseRequestHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.gate.admit(request):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except RuntimeError:  # no thread could be started: the slot goes back
            self.gate.leave(request)
            self.shutdown_request(request)

    def finish_request(self, request: Any, client_address: Any) -> None:
        self._serve(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.gate.leave(request, threading.current_thread())
