"""Threaded TCP servers with a bound: at most ``cap`` connections served at once.

Every admitted connection has one thread, so ``cap`` bounds the threads as well. A
connection still reading its first request (before its peer proved who it is) is
*waiting*; when every slot is taken, a new connection evicts the oldest waiting one,
whose thread wakes at once (its socket is shut down) and frees the slot. Hundreds of
connections that send nothing, or one byte now and then, therefore cannot lock a
legitimate peer out: its request takes milliseconds, theirs never end and are the
first to go. A new connection is refused only when every slot holds a peer past its
first request. The owner counts each refusal by kind: ``busy`` (no slot) and
``evicted``. Deadlines on the requests themselves are the owner's (see
:func:`raps_slurm.framing.recv_into`).
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

EVICT_WAIT = 1.0  # seconds the accept loop waits for an evicted connection's slot


class Gate:
    """The slots of one server; ``count(kind)`` is called for each refusal."""

    def __init__(self, cap: int, count: Callable[[str], None]) -> None:
        if cap < 1:
            raise ValueError(f"connection cap {cap}: at least 1")
        self.cap = cap
        self._count = count
        self._slots = threading.BoundedSemaphore(cap)
        self._lock = threading.Lock()
        self._waiting: dict[socket.socket, None] = {}  # oldest first
        self._evicted: set[socket.socket] = set()
        self._exiting: list[threading.Thread] = []  # slot freed, thread not yet ended
        self._held = 0

    def admit(self, sock: socket.socket) -> bool:
        """A slot for ``sock`` (in the accept loop), evicting the oldest waiting
        connection when all are taken; False (counted ``busy``) if none is free."""
        if not self._slots.acquire(blocking=False):
            with self._lock:
                victim = next(iter(self._waiting), None)
                if victim is not None:
                    del self._waiting[victim]
                    self._evicted.add(victim)
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
            self._waiting[sock] = None
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
