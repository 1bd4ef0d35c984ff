"""A rank's receives: the next message from one source, or from the first of several,
waiting as long as the source makes progress (:class:`~raps_slurm.runtime.context.Context`
inherits them; the semantics are in its docstring)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from raps_slurm.runtime.frames import ALIGN, DATA, HEADER, PROGRESS
from raps_slurm.runtime.inbox import Placed
from raps_slurm.runtime.links import AWAIT_MAX
from raps_slurm.runtime.msglog import MessagingError
from raps_slurm.runtime.sending import Sending

# (the payload's bytes buffered so far, its length) -> (k, target): the payload after
# its first k bytes goes straight into ``target`` (None: the usual way)
Into = Callable[[memoryview, int], "tuple[int, memoryview] | None"]


class Receiving(Sending):
    """The receiving half of :class:`~raps_slurm.runtime.context.Context`."""

    # while a receive waits: per source, where a large message from it may be read
    _into: dict[int, Into]

    def try_recv(self, src: int) -> bytes | None:
        """The next message from ``src`` if it has arrived, else None (never waits)."""
        msg = self.try_recv_buffer(src)
        return msg if msg is None or isinstance(msg, bytes) else bytes(msg)

    def try_recv_buffer(self, src: int) -> bytes | memoryview | Placed | None:
        """:meth:`try_recv`, but a large message comes as a view of the buffer it was read
        into (no copy; the MPI layer copies it once, into the application's array)."""
        if not 0 <= src < self.size or src == self.rank:
            raise ValueError(f"source {src}: expected another rank in 0..{self.size - 1}")
        self._start()
        with self._mu:
            self._raise_error()
            return self.inbox.pop(src)

    def recv_any(self, sources: list[int], timeout: float | None = None
                 ) -> tuple[int, bytes]:
        """The next message from whichever of ``sources`` has one first (the lowest rank
        when several have): ``(src, payload)``. Which one is timing: a caller that lets it
        decide what it sends records the choice (:meth:`record`)."""
        src, msg = self.recv_any_buffer(sources, timeout)
        return src, msg if isinstance(msg, bytes) else bytes(msg)

    def recv_any_buffer(self, sources: list[int], timeout: float | None = None,
                        into: dict[int, Into] | None = None
                        ) -> tuple[int, bytes | memoryview | Placed]:
        """:meth:`recv_any`, a large message as a view (:meth:`try_recv_buffer`).
        ``into``: per source, :meth:`recv_buffer`'s ``into`` for a large message from it
        that begins to come while this waits (one per source and wait; it is returned
        by this call or a later one)."""
        if not sources or any(not 0 <= s < self.size or s == self.rank for s in sources):
            raise ValueError(f"sources {sources}: expected other ranks in 0..{self.size - 1}")
        if len(sources) == 1:
            return sources[0], self._recv(sources[0], timeout, (into or {}).get(sources[0]))
        self._start()
        wait = self.s.recv_timeout if timeout is None else timeout
        start = self._clock()
        waiting = False
        with self._mu:
            try:
                while True:
                    if self._error is not None:
                        raise self._error
                    for src in sources:
                        msg = self.inbox.pop(src)
                        if msg is not None:
                            for s in sources:
                                self._blocked.pop(s, None)
                            if waiting:
                                self.port.blocked(None)
                            return src, msg
                    if not waiting:  # not hung: waiting for a peer (the lowest one is named)
                        self.port.blocked(sources[0])
                        waiting = True
                        if into:
                            self._into = {s: into[s] for s in sources if s in into}
                    now = self._clock()
                    for s in sources:
                        self._blocked.setdefault(s, now)
                    left = start + wait - now
                    if left < AWAIT_MAX:  # else the wait is AWAIT_MAX whatever peers did
                        left = self._since(start, sources, timeout) + wait - now
                    if left <= 0:
                        err = MessagingError(f"rank {self.rank} waited {wait:.0f}s for a "
                                             f"message from any of ranks {sources}")
                        break
                    self._await(left)
            finally:
                if self._into:
                    self._into = {}
        self.port.escalate(str(err))
        raise err

    def recv_buffer(self, src: int, timeout: float | None = None, into: Into | None = None
                    ) -> bytes | memoryview | Placed:
        """:meth:`recv`, a large message as a view (:meth:`try_recv_buffer`). ``into``:
        while this waits, a large message from ``src`` that begins to come may be read
        straight where ``into`` says (then it comes as a :class:`Placed`): the receive
        costs no copy after the kernel's. Asked only of a frame that is the next to
        deliver from ``src``, on a connection that said HELLO, under
        ``frame_mac: control``; never of a duplicate."""
        return self._recv(src, timeout, into)

    def recv(self, src: int, timeout: float | None = None) -> bytes:
        """The next message from rank ``src``, in order; MessagingError after ``timeout``."""
        msg = self._recv(src, timeout)
        return msg if isinstance(msg, bytes) else bytes(msg)

    def _recv(self, src: int, timeout: float | None, into: Into | None = None
              ) -> bytes | memoryview | Placed:
        if not 0 <= src < self.size or src == self.rank:
            raise ValueError(f"source {src}: expected another rank in 0..{self.size - 1}")
        self._start()
        wait = self.s.recv_timeout if timeout is None else timeout
        start = self._clock()
        waiting = False
        with self._mu:
            try:
                while True:
                    if self._error is not None:
                        raise self._error
                    msg = self.inbox.pop(src)
                    if msg is not None:
                        self._blocked.pop(src, None)
                        if waiting:
                            self.port.blocked(None)
                        return msg
                    if not waiting:
                        # A rank waiting for a peer is not hung: the detector blames it.
                        self.port.blocked(src)
                        waiting = True
                        if into is not None:
                            self._into = {src: into}
                    now = self._clock()
                    self._blocked.setdefault(src, now)
                    left = start + wait - now
                    if left < AWAIT_MAX:  # else the wait is AWAIT_MAX whatever peers did
                        left = self._since(start, (src,), timeout) + wait - now
                    if left <= 0:
                        want = self.inbox.delivered(src) + 1
                        err = MessagingError(f"rank {self.rank} waited {wait:.0f}s for seq "
                                             f"{want} from rank {src}")
                        break
                    self._await(left)
            finally:
                if self._into:
                    self._into = {}
        self.port.escalate(str(err))
        raise err

    def _place(self, src: int, epoch: int, cid: int, buffered: memoryview, n: int
               ) -> tuple[int, memoryview] | None:
        """Where a large frame from ``src`` that begins on connection ``cid`` goes
        (transport.Place): where the waiting receive's ``into`` for ``src`` says, when
        it is the next DATA frame to deliver from ``src`` and ``into`` takes it."""
        placers = self._into
        want = placers.get(src)
        if want is None or len(buffered) < HEADER.size:
            return None
        kind, fsrc, dst, seq, fepoch, length, _crc = HEADER.unpack_from(buffered)
        gap = n - HEADER.size - length
        if kind != DATA or fsrc != src or dst != self.rank or fepoch != epoch \
                or not 0 <= gap < ALIGN:
            return None  # the frame's own checks refuse it once whole
        at = HEADER.size + gap
        with self._mu:
            if self._into is not placers or placers.get(src) is not want \
                    or self._hello_cids.get(cid) != src \
                    or not self.inbox.can_place(src, seq, fepoch):
                return None
            got = want(buffered[at:], length)
            if got is None:
                return None
            del placers[src]  # one frame per source and wait
            self.inbox.placing(src, seq, cid)
        return at + got[0], got[1]

    def _since(self, start: float, sources: Iterable[int], timeout: float | None) -> float:
        """Where a receive's wait counts from (``_mu`` held): its start, or the sources'
        last progress after it unless the caller gave a timeout of its own."""
        return start if timeout is not None else max(start, self.heard_at(sources))

    def _relay_progress(self) -> None:
        """While this rank waits for peers that progress, tell the peers it is connected
        to how long ago that progress was (PROGRESS): their receives waiting on this rank
        then wait as long as the chain moves (a neighbour's neighbour re-executing).

        The age only grows from hop to hop, never refreshed by a relay: in a real
        deadlock (nobody progresses) every wait still ends after ``recv_timeout``. A rank
        relays an origin at most once per ``recv_timeout / 64`` (0.05-5 s), so a chain
        of waits longer than about 64 ranks may still time out."""
        now = self._clock()
        with self._mu:
            if not self._blocked:
                return
            origin = self.heard_at(self._blocked)
            period = max(0.05, min(5.0, self.s.recv_timeout / 64))
            if now - origin >= self.s.recv_timeout or origin - self._relayed < period:
                return
            self._relayed = origin
            waiting = set(self._blocked)
        with self._out_lock:
            peers = [d for d in self._out if d not in waiting]
        age_ms = min(int((now - origin) * 1000), 2**63 - 1)
        for dst in peers:
            self._control(dst, PROGRESS, age_ms)

    def heard_at(self, sources: Iterable[int]) -> float:
        """When the last progress came from any of ``sources`` (``_mu`` held; 0: never)."""
        return max((self._heard[s][2] for s in sources if s in self._heard), default=0.0)
