"""Communicators, requests and statuses of :mod:`raps_slurm.mpi`: point-to-point.

A communicator is a context id (point-to-point messages carry it; its collectives use
``id + 1``, so the two never match each other) and the world ranks of its members.
Lower-case methods move pickled Python objects, capitalised ones buffers
(:mod:`raps_slurm.mpi.types`). Sends never wait for the receiver (the runtime logs and
queues them), so ``isend``/``Isend`` requests are complete at once.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

from raps_slurm.mpi.buffers import Buffer, as_buffer
from raps_slurm.mpi.engine import ANY_SOURCE, ANY_TAG, OBJ, PROC_NULL, RAW, Msg, Recv
from raps_slurm.mpi.types import (
    BYTE,
    Datatype,
    MPIException,
    Namespace,
    unsupported,
)
from raps_slurm.mpi.world import World, world

if TYPE_CHECKING:
    from raps_slurm.mpi.collective import Intracomm

UNDEFINED = -32766


Exception = MPIException


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
        live = _live(requests, "Waitany")
        if not live:
            return UNDEFINED, None
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
        live = _live(requests, "Testany")
        if not live:
            return UNDEFINED, True, None
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
        live = _live(requests, "Waitsome" if block else "Testsome")
        if not live:
            return None, None
        sends = [i for i in live if requests[i].recv is None]
        if sends:
            # complete at once, and no timing in it: these alone, no decision recorded
            chosen = sends
        else:
            # at most 126 positions fit a determinant (two 63-bit masks); later ones are
            # left for the next call
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
            if got is None:
                return [], []
            chosen = _masked(pos, got)
        objs = [requests[i]._finish(statuses[n] if statuses is not None else None)
                for n, i in enumerate(chosen)]
        return chosen, objs


def _live(requests: list[Request], call: str) -> list[int]:
    live = [i for i, r in enumerate(requests) if r.active]
    if any(requests[i].collective for i in live):
        raise unsupported(f"MPI.Request.{call} over a non-blocking collective's request "
                          "(Wait, Test, Waitall or Testall it)")
    return live


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


IDENT, CONGRUENT, SIMILAR, UNEQUAL = 0, 1, 2, 3
# attribute keys (Open MPI's values) and what they give
KEY_TAG_UB, KEY_IO, KEY_WTIME_IS_GLOBAL, KEY_APPNUM, KEY_UNIVERSE_SIZE = 0, 2, 3, 4, 6
TAG_UB_VALUE = 2**31 - 1  # the envelope's tag is a signed 32-bit integer


class Group(metaclass=Namespace):
    """A group: world ranks in order (``Comm.Get_group``)."""

    def __init__(self, ranks: list[int] | None = None) -> None:
        self._ranks = list(ranks or [])

    def Get_size(self) -> int:
        """Number of ranks."""
        return len(self._ranks)

    def Get_rank(self) -> int:
        """This process's rank in the group (UNDEFINED if not in it)."""
        me = world().rank
        return self._ranks.index(me) if me in self._ranks else UNDEFINED

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self.Get_size()

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.Get_rank()

    def Incl(self, ranks: list[int]) -> Group:
        """The ranks listed, in that order."""
        return Group([self._ranks[self._check(r)] for r in ranks])

    def Excl(self, ranks: list[int]) -> Group:
        """All but the ranks listed."""
        drop = {self._check(r) for r in ranks}
        return Group([w for i, w in enumerate(self._ranks) if i not in drop])

    def _check(self, r: int) -> int:
        if not 0 <= r < len(self._ranks):
            raise ValueError(f"MPI.Group: rank {r}: expected 0..{len(self._ranks) - 1}")
        return r

    @staticmethod
    def Translate_ranks(group1: Group, ranks1: list[int] | None, group2: Group
                        ) -> list[int]:
        """The rank in ``group2`` of each of ``ranks1`` in ``group1`` (UNDEFINED if
        absent)."""
        picked = group1._ranks if ranks1 is None else [group1._ranks[group1._check(r)]
                                                        for r in ranks1]
        return [group2._ranks.index(w) if w in group2._ranks else UNDEFINED for w in picked]

    def Translate_ranks_to(self, ranks: list[int], other: Group) -> list[int]:
        """``Translate_ranks(self, ranks, other)``."""
        return Group.Translate_ranks(self, ranks, other)

    @staticmethod
    def compare_ranks(a: list[int], b: list[int], same: int) -> int:
        """``same`` for the same ranks in order, SIMILAR in another order, else UNEQUAL."""
        if a == b:
            return same
        return SIMILAR if sorted(a) == sorted(b) else UNEQUAL

    @staticmethod
    def Compare(group1: Group, group2: Group) -> int:
        """``IDENT`` (same ranks, same order), ``SIMILAR`` or ``UNEQUAL``."""
        return Group.compare_ranks(group1._ranks, group2._ranks, IDENT)

    def Free(self) -> None:
        """Nothing to release."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported(f"MPI.Group.{name}")


class Comm(metaclass=Namespace):
    """An intracommunicator (point-to-point here, collectives in :class:`Collectives`)."""

    _ctx_id: int
    _ranks: list[int] | None
    _name: str
    _freed: bool

    def __new__(cls, comm: Comm | None = None) -> Comm:
        """A new handle of ``comm`` (as ``MPI.Intracomm(comm)`` and subclasses calling
        ``super().__new__(cls, comm)``), the same communicator; none: a null one."""
        self = object.__new__(cls)
        if comm is None:
            self._ctx_id, self._ranks, self._name, self._freed = -1, [], "MPI_COMM_NULL", True
        elif isinstance(comm, Comm):
            self._ctx_id, self._ranks = comm._ctx_id, comm._ranks
            self._name, self._freed = comm._name, comm._freed
        else:
            raise TypeError(f"MPI.{cls.__name__}: expected a communicator, got "
                            f"{type(comm).__name__}")
        return self

    def __init__(self, comm: Comm | None = None) -> None:
        """Made in ``__new__`` (a subclass may define ``__init__`` freely)."""

    @classmethod
    def _make(cls, ctx_id: int, ranks: list[int] | None, name: str = "") -> Any:
        """A communicator of context ``ctx_id`` over world ``ranks`` (None: every rank of
        the world, resolved when the world starts)."""
        self = object.__new__(cls)
        self._ctx_id, self._ranks, self._name, self._freed = ctx_id, ranks, name, False
        return self

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Comm):
            return other._ctx_id == self._ctx_id
        return NotImplemented  # COMM_NULL answers for itself

    def __hash__(self) -> int:
        return hash(self._ctx_id)

    def __bool__(self) -> bool:
        return self._ctx_id != -1

    # --- attributes, comparison, groups ------------------------------------------------

    def Get_attr(self, keyval: int) -> Any:
        """A predefined attribute: ``TAG_UB``, ``IO``, ``WTIME_IS_GLOBAL``, ``APPNUM``,
        ``UNIVERSE_SIZE`` (None for another key)."""
        # IO: ANY_SOURCE, every rank may do I/O; clocks are not synchronised
        return {KEY_TAG_UB: TAG_UB_VALUE, KEY_IO: ANY_SOURCE, KEY_WTIME_IS_GLOBAL: 0,
                KEY_APPNUM: 0, KEY_UNIVERSE_SIZE: self._w.size}.get(keyval)

    @staticmethod
    def Compare(comm1: Comm, comm2: Comm) -> int:
        """``IDENT`` (the same communicator), ``CONGRUENT`` (the same ranks in the same
        order), ``SIMILAR`` (in another order) or ``UNEQUAL``; called as mpi4py's
        ``MPI.Comm.Compare(comm1, comm2)`` (or ``comm.Compare(comm1, comm2)``)."""
        for c in (comm1, comm2):
            if not isinstance(c, Comm):
                raise TypeError(f"MPI.Comm.Compare: expected two communicators, got "
                                f"{type(c).__name__}")
        if comm1._ctx_id == comm2._ctx_id:
            return IDENT
        return Group.compare_ranks(comm1._members(), comm2._members(), CONGRUENT)

    def Get_group(self) -> Group:
        """The group of its ranks."""
        return Group(list(self._members()))

    @property
    def group(self) -> Group:
        """The group of its ranks."""
        return self.Get_group()

    # --- identity --------------------------------------------------------------------

    @property
    def _w(self) -> World:
        w = world()
        if self._freed:
            raise Exception(f"{self._name or 'communicator'} was freed")
        return w

    def _members(self) -> list[int]:
        if self._ranks is None:
            self._ranks = list(range(world().size))
        return self._ranks

    def Get_rank(self) -> int:
        """This rank's number in the communicator."""
        return self._members().index(self._w.rank)

    def Get_size(self) -> int:
        """Number of ranks."""
        return len(self._members())

    @property
    def rank(self) -> int:
        """This rank's number."""
        return self.Get_rank()

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self.Get_size()

    def Get_name(self) -> str:
        """The communicator's name."""
        return self._name

    def Set_name(self, name: str) -> None:
        """Name it."""
        self._name = name

    def Is_intra(self) -> bool:
        """Always an intracommunicator."""
        return True

    def Is_inter(self) -> bool:
        """Never an intercommunicator."""
        return False

    def _world_rank(self, r: int, what: str) -> int:
        m = self._members()
        if not 0 <= r < len(m):
            raise ValueError(f"{what} {r}: expected a rank in 0..{len(m) - 1}")
        return m[r]

    def _comm_rank(self, world_rank: int) -> int:
        return self._members().index(world_rank)

    # --- receiving -------------------------------------------------------------------

    def _post(self, source: int, tag: int, call: str) -> Recv:
        w = self._w
        w.check_may_communicate(call)
        src = ANY_SOURCE if source == ANY_SOURCE else self._world_rank(source, "source")
        return w.engine.post(self._ctx_id, src, tag)

    def _deliver(self, m: Msg, buf: Buffer | None, status: Status | None) -> Any:
        if status is not None:
            status.source, status.tag, status.nbytes = self._comm_rank(m.src), m.tag, len(m.data)
        if buf is None:
            if m.kind != OBJ:
                return bytes(m.data)
            return pickle.loads(m.data)
        if m.kind != RAW:
            raise Exception("a buffer receive (Recv) matched an object message (send): use "
                            "recv for messages sent with send")
        buf.put(m.data, "receive")
        return None

    def _null_status(self, status: Status | None) -> None:
        if status is not None:
            status.source, status.tag, status.nbytes = PROC_NULL, ANY_TAG, 0

    def recv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: Status | None = None) -> Any:
        """Receive an object."""
        if source == PROC_NULL:
            self._null_status(status)
            return None
        r = self._post(source, tag, "recv")
        return self._deliver(self._w.engine.wait(r), None, status)

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: Status | None = None) -> None:
        """Receive into a buffer."""
        if source == PROC_NULL:
            self._null_status(status)
            return
        b = as_buffer(buf, "Recv", readonly=False)
        r = self._post(source, tag, "Recv")
        self._deliver(self._w.engine.wait(r), b, status)

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Post a receive of an object."""
        if source == PROC_NULL:
            return Request(self)
        return Request(self, self._post(source, tag, "irecv"))

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG
              ) -> Request:
        """Post a receive into a buffer."""
        if source == PROC_NULL:
            return Request(self)
        b = as_buffer(buf, "Irecv", readonly=False)
        return Request(self, self._post(source, tag, "Irecv"), b)

    def probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
              status: Status | None = None) -> bool:
        """Wait for a matching message, leaving it to be received."""
        self._probe(source, tag, status, block=True, call="probe")
        return True

    Probe = probe

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: Status | None = None) -> bool:
        """Whether a matching message is there (a recorded decision)."""
        return self._probe(source, tag, status, block=False, call="iprobe")

    Iprobe = iprobe

    def _probe(self, source: int, tag: int, status: Status | None, *, block: bool,
               call: str) -> bool:
        if source == PROC_NULL:
            self._null_status(status)
            return True
        w = self._w
        w.check_may_communicate(call)
        src = ANY_SOURCE if source == ANY_SOURCE else self._world_rank(source, "source")
        m = w.engine.probe(self._ctx_id, src, tag, block)
        if m is None:
            return False
        if status is not None:
            status.source, status.tag, status.nbytes = self._comm_rank(m.src), m.tag, len(m.data)
        return True

    # --- sending ---------------------------------------------------------------------

    def _send(self, kind: int, data: bytes | memoryview, dest: int, tag: int, call: str) -> None:
        if dest == PROC_NULL:
            return
        if tag < 0:
            raise ValueError(f"{call}: tag {tag}: expected a tag >= 0")
        w = self._w
        w.check_may_communicate(call)
        w.engine.send(self._world_rank(dest, "dest"), self._ctx_id, tag, kind, data)

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send an object (never waits for the receiver)."""
        self._send(OBJ, pickle.dumps(obj, protocol=5), dest, tag, "send")

    ssend = bsend = send

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Send a buffer (copied: the caller may reuse it at once)."""
        if dest != PROC_NULL:  # mpi4py reads no buffer for PROC_NULL
            self._send(RAW, as_buffer(buf, "Send").raw(), dest, tag, "Send")

    Ssend = Bsend = Rsend = Send

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        """Send an object; the request is complete at once."""
        self.send(obj, dest, tag)
        return Request(self)

    issend = ibsend = isend

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Send a buffer; the request is complete at once."""
        self.Send(buf, dest, tag)
        return Request(self)

    Issend = Ibsend = Irsend = Isend

    def Send_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:
        """A persistent send: each ``Start`` sends what ``buf`` holds then."""
        as_buffer(buf, "Send_init")  # a bad specification fails here, as in mpi4py

        def start(r: Request) -> None:
            self.Send(buf, dest, tag)
        return Prequest(self, start)

    Ssend_init = Bsend_init = Rsend_init = Send_init

    def Recv_init(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG
                  ) -> Prequest:
        """A persistent receive into ``buf``: each ``Start`` posts it."""
        b = as_buffer(buf, "Recv_init", readonly=False)

        def start(r: Request) -> None:
            if source != PROC_NULL:
                r.recv, r.buf = self._post(source, tag, "Recv_init"), b
        return Prequest(self, start)

    def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = ANY_SOURCE, recvtag: int = ANY_TAG,
                 status: Status | None = None) -> Any:
        """Send an object and receive one."""
        self.send(sendobj, dest, sendtag)
        return self.recv(None, source, recvtag, status)

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0,
                 recvbuf: Any = None, source: int = ANY_SOURCE, recvtag: int = ANY_TAG,
                 status: Status | None = None) -> None:
        """Send a buffer and receive into another."""
        self.Send(sendbuf, dest, sendtag)
        self.Recv(recvbuf, source, recvtag, status)

    def Sendrecv_replace(self, buf: Any, dest: int, sendtag: int = 0,
                         source: int = ANY_SOURCE, recvtag: int = ANY_TAG,
                         status: Status | None = None) -> None:
        """Send a buffer and receive into the same one."""
        b = as_buffer(buf, "Sendrecv_replace")
        self._send(RAW, bytes(b.raw()), dest, sendtag, "Sendrecv_replace")
        self.Recv(buf, source, recvtag, status)

    # --- communicators (creation in collective.Intracomm) -----------------------------

    def Dup(self, info: Any = None) -> Comm:
        """Same ranks, a message space of its own. Here for ``MPI.Comm.Dup(comm)``, as
        mpi4py has it on Comm; every communicator is an Intracomm, which makes it."""
        return self._intra("Dup").Dup(info)

    Clone = Dup

    def Split(self, color: int = 0, key: int = 0) -> Any:
        """Ranks with the same ``color`` in a new communicator (see ``Intracomm.Split``)."""
        return self._intra("Split").Split(color, key)

    def _intra(self, call: str) -> Intracomm:
        from raps_slurm.mpi.collective import Intracomm

        if not isinstance(self, Intracomm):
            raise unsupported(f"MPI.Comm.{call} of a {type(self).__name__}")
        return self

    def Free(self) -> None:
        """Release it (using it afterwards raises)."""
        self._freed = True

    def Abort(self, errorcode: int = 0) -> None:
        """Stop this rank at once with ``errorcode`` (a failure under the launcher)."""
        from raps_slurm.mpi.MPI import Abort

        Abort(errorcode)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported(f"MPI.{type(self).__name__}.{name}")

    def __repr__(self) -> str:
        return f"<raps_slurm.mpi communicator {self._name or hex(self._ctx_id)}>"


class _NullComm:
    """COMM_NULL."""

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        # a null handle made by ``MPI.Intracomm()`` is COMM_NULL too
        return isinstance(other, _NullComm) or (isinstance(other, Comm) and not other)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "<MPI.COMM_NULL>"


COMM_NULL: Any = _NullComm()
