"""Statuses and requests of :mod:`raps_slurm.mpi`: what a receive reports, non-blocking
and persistent operations, and the calls that complete many (``Waitall`` ... ``Testsome``).

A send request is complete at once (sends never wait for the receiver); a receive
request completes when its posted receive matches. Every outcome that depends on timing
(``Test``, ``Testany``, ``Testall``, ``Waitany``, ``Waitsome``, ``Testsome``) is a
recorded decision of the engine (:mod:`raps_slurm.mpi.engine`), so a re-executed rank
takes the same ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raps_slurm.mpi.buffers import Buffer
from raps_slurm.mpi.engine import ANY_SOURCE, ANY_TAG, Recv
from raps_slurm.mpi.types import BYTE, Datatype, MPIException, Namespace, unsupported
from raps_slurm.mpi.world import world

if TYPE_CHECKING:
    from raps_slurm.mpi.comm import Comm

UNDEFINED = -32766


class Status(metaclass=Namespace):
    """Source, tag and size of a received (or probed) message."""

    def __init__(self) -> None:
        self.source, self.tag, self.error, self.nbytes = ANY_SOURCE, ANY_TAG, 0, 0

    def Get_source(self) -> int:
        """Rank of the sender in the communicator."""
        return self.source

    def Get_tag(self) -> int:
        """The message's tag."""
        return self.tag

    def Get_error(self) -> int:
        """Always 0 (errors raise)."""
        return self.error

    def Get_count(self, datatype: Datatype = BYTE) -> int:
        """Elements of ``datatype`` in the message (UNDEFINED if not a whole number)."""
        if not isinstance(datatype, Datatype):
            raise TypeError(f"MPI.Status.Get_count: expected an MPI datatype, got "
                            f"{type(datatype).__name__}")
        size = datatype.size
        if not size:
            return 0
        n, r = divmod(self.nbytes, size)
        return UNDEFINED if r else n

    Get_elements = Get_count

    def Is_cancelled(self) -> bool:
        """Cancellation is not supported: never."""
        return False

    def Set_source(self, source: int) -> None:
        """Set the source."""
        self.source = source

    def Set_tag(self, tag: int) -> None:
        """Set the tag."""
        self.tag = tag

    def Set_error(self, error: int) -> None:
        """Set the error."""
        self.error = error

    @property
    def count(self) -> int:
        """Bytes in the message."""
        return self.nbytes

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported(f"MPI.Status.{name}")


class Request(metaclass=Namespace):
    """A non-blocking operation: a send (complete at once) or a posted receive."""

    collective = False  # a non-blocking collective's request (raps_slurm.mpi.nonblocking)

    def __init__(self, comm: Comm | None, recv: Recv | None = None,
                 buf: Buffer | None = None, value: Any = None) -> None:
        self.comm, self.recv, self.buf, self.value = comm, recv, buf, value
        self.active = recv is not None or comm is not None
        self.status: Status | None = None

    def _done(self) -> bool:
        return self.recv is None or self.recv.msg is not None

    def _finish(self, status: Status | None) -> Any:
        """Deliver a completed receive (buffer or object) and the status."""
        if self.recv is not None and self.recv.msg is not None and self.status is None:
            assert self.comm is not None
            st = self.status = Status()
            self.value = self.comm._deliver(self.recv.msg, self.buf, st)
        self.active = False
        if status is not None and self.status is not None:
            _copy_status(self.status, status)
        return self.value

    def _wait(self) -> None:
        if self.active and self.recv is not None and self.recv.msg is None:
            world().engine.wait(self.recv)

    def Wait(self, status: Status | None = None) -> bool:
        """Wait for completion."""
        self._wait()
        self._finish(status)
        return True

    def wait(self, status: Status | None = None) -> Any:
        """Wait for completion; the received object (None for a send)."""
        self._wait()
        return self._finish(status)

    def Test(self, status: Status | None = None) -> bool:
        """Whether it completed (a recorded decision for a receive)."""
        return self.test(status)[0]

    def test(self, status: Status | None = None) -> tuple[bool, Any]:
        """(completed, object)."""
        if self.recv is None or not self.active:
            return True, self._finish(status)
        got = world().engine.decision(lambda: (1, 0, 0) if self._done() else None,
                                      lambda _: self._wait())
        if got is None:
            return False, None
        return True, self._finish(status)

    def Free(self) -> None:
        """Forget a request: only a completed or send request."""
        if self.recv is not None and self.recv.msg is None:
            raise unsupported("MPI.Request.Free of a pending receive")
        self.active = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported(f"MPI.Request.{name}")

    # --- many requests ---------------------------------------------------------------

    @staticmethod
    def Waitall(requests: list[Request], statuses: list[Status] | None = None
                ) -> bool:
        """Wait for all."""
        Request.waitall(requests, statuses)
        return True

    @staticmethod
    def waitall(requests: list[Request], statuses: list[Status] | None = None) -> list[Any]:
        """Wait for all; their objects."""
        recvs = [r.recv for r in requests if r.active and r.recv is not None]
        if len(recvs) > 1 and not any(r.collective for r in requests):
            # as they come, not in the list's order: a large message for a receive other
            # than the one waited for is read into its buffer too (a collective's request
            # progresses only in its own wait, so a list with one keeps the list's order)
            world().engine.wait_all(recvs)
        out = []
        for i, r in enumerate(requests):
            r._wait()
            out.append(r._finish(statuses[i] if statuses is not None else None))
        return out

    @staticmethod
    def Waitany(requests: list[Request], status: Status | None = None) -> int:
        """Wait for one; its index (UNDEFINED if none is active). A recorded decision."""
        return Request.waitany(requests, status)[0]

    @staticmethod
    def waitany(requests: list[Request], status: Status | None = None) -> tuple[int, Any]:
        """Wait for one: (index, object)."""
        live = _live(requests)
        if not live:
            return UNDEFINED, None
        if any(requests[i].collective for i in live):
            return _waitany_collectives(requests, live, status)
        for i in live:
            if requests[i].recv is None:  # a send is complete: no timing in it
                return i, requests[i]._finish(status)
        eng = world().engine

        def first() -> tuple[int, int, int]:
            eng.wait_any([requests[i].recv for i in live])  # type: ignore[misc]
            return 1, next(i for i in live if requests[i]._done()), 0
        got = eng.decision(first, lambda rep: requests[rep[1]]._wait())
        assert got is not None
        return got[1], requests[got[1]]._finish(status)

    @staticmethod
    def Testall(requests: list[Request], statuses: list[Status] | None = None
                ) -> bool:
        """Whether all completed (then they are finished). A recorded decision."""
        return Request.testall(requests, statuses)[0]

    @staticmethod
    def testall(requests: list[Request], statuses: list[Status] | None = None
                ) -> tuple[bool, list[Any] | None]:
        """(all completed, their objects)."""
        # a collective's request progresses (and records it) in its own Test
        if not all([r.Test() for r in requests if r.active and r.collective]):
            return False, None
        pending = [r for r in requests if r.active and r.recv is not None]
        if pending:
            def wait_all(_: Any) -> None:
                for r in pending:
                    r._wait()
            got = world().engine.decision(
                lambda: (1, 0, 0) if all(r._done() for r in pending) else None, wait_all)
            if got is None:
                return False, None
        return True, Request.waitall(requests, statuses)

    @staticmethod
    def Testany(requests: list[Request], status: Status | None = None
                ) -> tuple[int, bool]:
        """(index or UNDEFINED, flag). A recorded decision."""
        i, flag, _ = Request.testany(requests, status)
        return i, flag

    @staticmethod
    def testany(requests: list[Request], status: Status | None = None
                ) -> tuple[int, bool, Any]:
        """(index or UNDEFINED, flag, object)."""
        live = _live(requests)
        if not live:
            return UNDEFINED, True, None
        if any(requests[i].collective for i in live):
            one = _any_pass(requests, live, status)
            return (UNDEFINED, False, None) if one is None else (one[0], True, one[1])
        for i in live:
            if requests[i].recv is None:
                return i, True, requests[i]._finish(status)

        def first() -> tuple[int, int, int] | None:
            done = [i for i in live if requests[i]._done()]
            return (1, done[0], 0) if done else None
        got = world().engine.decision(first, lambda rep: requests[rep[1]]._wait())
        if got is None:
            return UNDEFINED, False, None
        return got[1], True, requests[got[1]]._finish(status)

    @staticmethod
    def Waitsome(requests: list[Request], statuses: list[Status] | None = None
                 ) -> list[int] | None:
        """Wait for at least one; the indices of those completed (None if none is
        active). A recorded decision."""
        return Request._some(requests, statuses, block=True)[0]

    @staticmethod
    def waitsome(requests: list[Request], statuses: list[Status] | None = None
                 ) -> tuple[list[int] | None, list[Any] | None]:
        """(indices, objects) of the completed ones (None, None if none is active)."""
        return Request._some(requests, statuses, block=True)

    @staticmethod
    def Testsome(requests: list[Request], statuses: list[Status] | None = None
                 ) -> list[int] | None:
        """The indices of those completed now (maybe none; None if none is active). A
        recorded decision."""
        return Request._some(requests, statuses, block=False)[0]

    @staticmethod
    def testsome(requests: list[Request], statuses: list[Status] | None = None
                 ) -> tuple[list[int] | None, list[Any] | None]:
        """(indices, objects) of the completed ones."""
        return Request._some(requests, statuses, block=False)

    @staticmethod
    def _some(requests: list[Request], statuses: list[Status] | None, *, block: bool
              ) -> tuple[list[int] | None, list[Any] | None]:
        live = _live(requests)
        if not live:
            return None, None
        sends = [i for i in live if requests[i].recv is None and not requests[i].collective]
        if sends:
            # complete at once, and no timing in it: these alone, no decision recorded
            chosen = sends
        elif any(requests[i].collective for i in live):
            chosen = _some_collectives(requests, live, block)
        else:
            chosen = _some_recvs(requests, live, block)
        objs = [requests[i]._finish(statuses[n] if statuses is not None else None)
                for n, i in enumerate(chosen)]
        return chosen, objs


def _some_recvs(requests: list[Request], live: list[int], block: bool) -> list[int]:
    """The receive requests of ``live`` that completed (``block``: at least one), one
    recorded decision. At most 126 positions fit a determinant (two 63-bit masks): later
    ones are left for the next call."""
    pos = live[:126]
    eng = world().engine

    def masks() -> tuple[int, int, int] | None:
        if block:
            eng.wait_any([requests[i].recv for i in pos])  # type: ignore[misc]
        done = [k for k, i in enumerate(pos) if requests[i]._done()]
        if not done:
            return None
        return (1, sum(1 << k for k in done if k < 63),
                sum(1 << (k - 63) for k in done if k >= 63))

    def wait_for(rep: tuple[int, int, int]) -> None:
        for i in _masked(pos, rep):
            requests[i]._wait()
    got = eng.decision(masks, wait_for)
    return [] if got is None else _masked(pos, got)


def _some_collectives(requests: list[Request], live: list[int], block: bool) -> list[int]:
    """``Testsome`` (``Waitsome``: until one completes) over receives and non-blocking
    collectives: the collectives already ended, those that end as they take the steps
    whose messages arrived (each one's progress recorded as in its own ``Test``), and
    the receives that completed (one recorded decision), in index order."""
    eng = world().engine
    while True:
        colls = [i for i in live if requests[i].collective]
        chosen = {i for i in colls if requests[i]._done()}
        chosen.update(i for i in colls if i not in chosen and requests[i].test()[0])
        recvs = [i for i in live if not requests[i].collective]
        if recvs:
            chosen.update(_some_recvs(requests, recvs, block=False))
        if chosen or not block:
            return sorted(chosen)
        pending = [r.recv if not r.collective else r._at for r in (requests[i] for i in live)]
        eng.wait_any([p for p in pending if p is not None])


def _live(requests: list[Request]) -> list[int]:
    return [i for i, r in enumerate(requests) if r.active]


def _any_pass(requests: list[Request], live: list[int], status: Status | None
              ) -> tuple[int, Any] | None:
    """One ``Testany`` over requests among which are non-blocking collectives: (index,
    object) of the one it completes, or None. A send, then a collective already ended
    (no timing in either); else each pending collective in index order takes the steps
    whose messages arrived, its progress a recorded decision as in its own ``Test``
    (a step may send, and a re-executed rank must send at the same points); else the
    receives, one recorded decision as in a ``Testany`` of receives alone."""
    for i in live:
        if requests[i].recv is None and not requests[i].collective:
            return i, requests[i]._finish(status)
    colls = [i for i in live if requests[i].collective]
    for i in colls:
        if requests[i]._done():
            return i, requests[i]._finish(status)
    for i in colls:
        if requests[i].test(status)[0]:
            return i, None
    recvs = [i for i in live if not requests[i].collective]
    if not recvs:
        return None

    def first() -> tuple[int, int, int] | None:
        done = [i for i in recvs if requests[i]._done()]
        return (1, done[0], 0) if done else None
    got = world().engine.decision(first, lambda rep: requests[rep[1]]._wait())
    return None if got is None else (got[1], requests[got[1]]._finish(status))


def _waitany_collectives(requests: list[Request], live: list[int], status: Status | None
                         ) -> tuple[int, Any]:
    """``Waitany`` over requests among which are non-blocking collectives: ``Testany``
    passes (each outcome recorded, so a re-executed rank makes the same passes), waiting
    between two until a receive request or a collective's next receive is matched."""
    eng = world().engine
    while True:
        got = _any_pass(requests, live, status)
        if got is not None:
            return got
        pending = [r.recv if not r.collective else r._at for r in (requests[i] for i in live)]
        eng.wait_any([p for p in pending if p is not None])


def _masked(pos: list[int], rep: tuple[int, int, int]) -> list[int]:
    return [i for k, i in enumerate(pos) if (rep[1] >> k if k < 63 else rep[2] >> (k - 63)) & 1]


class Prequest(Request):
    """A persistent request (``Send_init``/``Recv_init``): inactive until ``Start``,
    inactive again once completed, reusable."""

    def __init__(self, comm: Comm, start: Any) -> None:
        super().__init__(comm)
        self.active = False
        self._start = start

    def Start(self) -> None:
        """Start it: a send reads its buffer now; a receive is posted now."""
        if self.active:
            raise MPIException("MPI.Prequest.Start of a request still active")
        self.recv, self.buf, self.value, self.status = None, None, None, None
        self._start(self)
        self.active = True

    @staticmethod
    def Startall(requests: list[Prequest]) -> None:
        """Start each, in order."""
        for r in requests:
            r.Start()


def _copy_status(src: Status, dst: Status) -> None:
    dst.source, dst.tag, dst.error, dst.nbytes = src.source, src.tag, src.error, src.nbytes
