"""Who reads a rank's incoming connections: the application thread while it waits for a
message, else a background thread.

A message handed from a reader thread to the waiting application costs a thread wake-up
and a GIL hand-off (some 45 us on the machines measured, ten times Python's own TCP
round trip: docs/benchmarks.md). So the thread that waits reads itself: it polls every
connection and takes in whole frames until what it waits for has come. Reading must
never wait for the application, though (two ranks sending each other large messages
would block each other in TCP), so the background thread takes reading back once the
application has been out of its waits for :data:`HANDOFF` seconds. A send that finds
its socket full does not hand reading over (waking the background thread and taking
the lock back cost some 130 us a round trip on two cores): the sending thread reads its
incoming connections itself until the socket takes more (:meth:`Pump.stalled`).
Reading is non-blocking (:meth:`FrameReader.poll`): one connection whose frame stalls
half way delays no other; its deadline closes it.

One lock says who reads; the background thread gives it up when woken through a socket
pair that is part of what it polls.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from raps_slurm.wire import framing, pool

HANDOFF = 0.01  # s out of its waits before the application's reading goes back
IDLE_POLL = 0.5  # s between deadline checks while nothing comes
BURST = 64  # frames of one connection per pass, so that one peer cannot starve others
MISSED_SKIP = 8  # waits that do not spin once spins keep finding nothing
MISS_STREAK = 3  # spins in a row that found nothing before waits stop spinning: one
# alone is mostly the peer (or this rank) preempted for a moment, and where waking a
# sleeping thread is slow (a virtual machine whose idle vCPU the host deschedules:
# 65-200 us) the waits that then slept made the peer's spins miss in turn


@dataclass(eq=False)
class Conn:
    """One authenticated incoming connection."""

    cid: int
    sock: socket.socket
    reader: framing.FrameReader
    src: int
    epoch: int = 0  # the source's, bound by the handshake
    fd: int = -1  # while the pump polls it


class Pump:
    """Reads the connections :meth:`add` gives it: ``on_body(conn, body, owned)`` for each
    whole frame (an exception it raises ends the connection), ``on_end(conn, exc)`` once
    when a connection ends, with why."""

    def __init__(self, on_body: Callable[[Conn, memoryview, bool], None],
                 on_end: Callable[[Conn, BaseException], None],
                 spin: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._on_body, self._on_end, self._clock = on_body, on_end, clock
        self.spin = spin  # s a wait polls before it sleeps (:meth:`_spun`)
        self._skip = 0
        self._missed = 0  # spins in a row that found nothing
        self.spins_missed = 0
        # epoll itself, not the selectors module: a spinning wait polls it thousands of
        # times a second, and the module's wrapping costs a microsecond a call.
        self._ep = select.epoll()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._fds: dict[int, Conn | None] = {self._wake_r.fileno(): None}
        self._ep.register(self._wake_r.fileno(), select.EPOLLIN)
        self._lock = threading.Lock()  # held by the thread reading
        self._cv = threading.Condition()  # guards the fields below
        self._new: list[Conn] = []
        self._app = False  # the application thread reads
        self._app_in = 0  # ... and is in so many waits (or full sends) now
        self._app_left = 0.0
        self._closed = False
        self._conns: dict[int, Conn] = {}  # the reading thread's alone
        # large frames' buffers, reused once released (read under the reading lock only)
        self.buffers = pool.BufferPool()
        self._ready: set[Conn] = set()  # may hold whole frames the socket does not show
        self._next_sweep = 0.0
        self.frames_app = 0  # frames read on the application's thread
        self.frames_background = 0
        # Frames handled and connections ended, counted once their handler returned: a
        # waiter that saw nothing new at count n must not sleep once it moved past n.
        self.events = 0
        self._thread = threading.Thread(target=self._background, name="raps-read",
                                        daemon=True)
        self._thread.start()

    def add(self, conn: Conn) -> None:
        """Read ``conn`` from now on (its handshake is done; bytes its reader buffered
        count)."""
        with self._cv:
            if self._closed:
                closed = True
            else:
                closed = False
                self._new.append(conn)
        if closed:
            with contextlib.suppress(OSError):
                conn.sock.close()
            return
        self._wake()

    def wait(self, timeout: float, since: int | None = None) -> None:
        """Read on this (the application's) thread until a frame came or ``timeout``
        passed; may return early (a new connection). Call it holding none of the rank's
        locks: the frames' handler takes them. ``since``: the :attr:`events` count when
        the caller last looked at what the handlers deliver; if the background thread
        handled anything after that, it returns at once (without it, a frame handled
        between the caller's look and this call would wait for the next one)."""
        with self._cv:
            if self._closed:
                closed = True
            else:
                closed = False
                claim = not self._app
                self._app = True
                self._app_in += 1
        if closed:
            time.sleep(timeout)  # nothing will come: the caller's deadline decides
            return
        try:
            if claim:
                self._wake()  # the background thread leaves its poll and the lock
            if self._lock.acquire(timeout=timeout):
                try:
                    if since is not None and self.events != since:
                        return
                    if not self._spun():
                        self._pass(timeout, app=True)
                finally:
                    self._lock.release()
        finally:
            with self._cv:
                self._app_in -= 1
                self._app_left = self._clock()

    def stalled(self, sock: socket.socket) -> None:
        """A send on this thread found ``sock`` full: return once it may take more. The
        peer may be sending to this rank just as well and wait for it to read, so while
        the application reads (it waited last, within :data:`HANDOFF`) this thread reads
        the incoming connections meanwhile, sleeping until a frame comes or ``sock``
        drains; else the background thread reads and this one only waits. No spin: the
        peer needs the CPU to drain ``sock`` (a spin cost a quarter of the bandwidth
        between ranks of one host, whose Unix socket wakes a writer 50 times per 8 MiB).
        OSError if ``sock`` was closed meanwhile (a handler dropped it)."""
        out = select.poll()
        out.register(sock.fileno(), select.POLLOUT)
        with self._cv:
            reads = self._app and not self._closed and self._lock.acquire(blocking=False)
            if reads:
                self._app_in += 1  # the background thread leaves reading to us meanwhile
        if not reads:
            out.poll(int(IDLE_POLL * 1000))
            return
        try:
            out.register(self._ep.fileno(), select.POLLIN)  # a frame for us came
            while True:
                self._pass(0.0, app=True)
                if sock.fileno() < 0:
                    raise OSError("connection closed while its send waited")
                # sleep only with nothing buffered left to read: the poll sees sockets
                wait = 0 if self._ready else int(IDLE_POLL * 1000)
                if any(fd == sock.fileno() for fd, _ in out.poll(wait)):
                    return
        finally:
            self._lock.release()
            with self._cv:
                self._app_in -= 1
                self._app_left = self._clock()

    def _spun(self) -> bool:
        """Poll without sleeping for up to ``spin`` s: True if a frame came. Waking a
        sleeping thread costs tens of microseconds, more than a short message's round
        trip; but :data:`MISS_STREAK` spins in a row that found nothing mean messages
        take longer here (or ranks share cores), so the next waits sleep at once."""
        if self.spin <= 0:
            return False
        if self._skip:
            self._skip -= 1
            return False
        end = self._clock() + self.spin
        while self._clock() < end:
            if self._pass(0.0, app=True):
                self._missed = 0
                return True
        self.spins_missed += 1
        self._missed += 1
        if self._missed >= MISS_STREAK:
            self._skip = MISSED_SKIP
        return False

    def poll(self) -> None:
        """Take in what has come, without waiting, when this (the application's) thread
        reads; else the background thread does it anyway."""
        with self._cv:
            if not self._app or self._closed:
                return
        if self._lock.acquire(blocking=False):
            try:
                self._pass(0.0, app=True)
            finally:
                self._lock.release()

    def release(self) -> None:
        """Reading goes to the background thread now (before a send that may wait for
        the peer: the peer may be sending to us just as well)."""
        with self._cv:
            if self._app:
                self._app = False
                self._cv.notify_all()

    def close(self) -> None:
        """Stop reading and close every connection (no ``on_end``: the rank is going)."""
        with self._cv:
            self._closed = True
            new, self._new = self._new, []
            self._cv.notify_all()
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)
        for c in [*list(self._conns.values()), *new]:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                c.sock.close()
        # The poller and the wake-up pair go once no pass can be using them.
        if self._lock.acquire(timeout=2.0):
            try:
                self._ep.close()
                self._wake_r.close()
                self._wake_w.close()
            finally:
                self._lock.release()

    # --- internals -------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_w.send(b"w")

    def _background(self) -> None:
        while True:
            with self._cv:
                while self._app and not self._closed:
                    idle = self._clock() - self._app_left
                    if not self._app_in and idle >= HANDOFF:
                        self._app = False  # out of its waits: reading must not wait for it
                        break
                    self._cv.wait(HANDOFF if self._app_in else HANDOFF - idle)
                if self._closed:
                    return
            with self._lock:
                with self._cv:
                    if self._app:
                        continue
                self._pass(IDLE_POLL, app=False)

    def _pass(self, timeout: float, *, app: bool) -> int:
        """One round of reading (the lock held): new connections, then a poll of up to
        ``timeout`` s, then every connection that can have a whole frame."""
        new: list[Conn] = []
        if self._new or self._closed:  # a glance first: a pass per message, seldom news
            with self._cv:
                new, self._new = self._new, []
        closed = self._closed
        for c in new:
            if closed:
                with contextlib.suppress(OSError):
                    c.sock.close()
                continue
            self._conns[c.cid] = c
            c.fd = c.sock.fileno()
            self._ep.register(c.fd, select.EPOLLIN)
            self._fds[c.fd] = c
            self._ready.add(c)  # the handshake may have buffered its first frames
        if closed:
            return 0
        events = self._ep.poll(0.0 if self._ready else timeout, len(self._fds))
        n = 0
        if events or self._ready:  # a spinning wait's passes mostly find nothing
            todo, self._ready = self._ready, set()
            for fd, _ in events:
                ready = self._fds.get(fd)
                if ready is None:
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                else:
                    todo.add(ready)
            for c in todo:
                n += self._drain(c, app)
        now = self._clock()
        if now >= self._next_sweep:
            self._next_sweep = now + IDLE_POLL
            for c in [c for c in self._conns.values() if c.reader.overdue(now)]:
                self._drain(c, app)  # raises its timeout
        return n

    def _drain(self, c: Conn, app: bool) -> int:
        n = 0
        try:
            while n < BURST:
                if n and not c.reader.pending():
                    return n  # nothing buffered: the poller says when the socket has more
                body = c.reader.poll()
                if body is None:
                    return n
                n += 1
                if app:
                    self.frames_app += 1
                else:
                    self.frames_background += 1
                self._on_body(c, body, c.reader.owned)
                self.events += 1
            self._ready.add(c)  # more may be buffered: the next pass goes on
        except Exception as exc:  # whatever it was, this connection ends
            self._end(c, exc)
        return n

    def _end(self, c: Conn, exc: BaseException) -> None:
        if self._conns.pop(c.cid, None) is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._ep.unregister(c.fd)
            self._fds.pop(c.fd, None)
        self._ready.discard(c)
        with contextlib.suppress(OSError):
            c.sock.close()
        self._on_end(c, exc)
        self.events += 1
