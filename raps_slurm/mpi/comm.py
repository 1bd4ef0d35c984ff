"""Communicators of :mod:`raps_slurm.mpi`: point-to-point, attributes, comparison
(requests and statuses: :mod:`.requests`, groups: :mod:`.groups`).

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
from raps_slurm.mpi.groups import CONGRUENT, IDENT, Group
from raps_slurm.mpi.requests import Prequest, Request, Status
from raps_slurm.mpi.types import MPIException, Namespace, unsupported
from raps_slurm.mpi.world import World, world
from raps_slurm.runtime.transport import READ_BUFFER
from raps_slurm.wire import datapath

if TYPE_CHECKING:
    from raps_slurm.mpi.collective import Intracomm

Exception = MPIException


# attribute keys (Open MPI's values) and what they give
KEY_TAG_UB, KEY_IO, KEY_WTIME_IS_GLOBAL, KEY_APPNUM, KEY_UNIVERSE_SIZE = 0, 2, 3, 4, 6
# A receive buffer smaller is never read into as the message comes: its message's frame
# fits a connection's read buffer (framing and envelope take far less than 4 KiB).
PLACE_MIN = READ_BUFFER - 4096
TAG_UB_VALUE = 2**31 - 1  # the envelope's tag is a signed 32-bit integer


def _may_read_into(r: Recv, b: Buffer) -> None:
    """A large message for ``r`` may be read straight into ``b`` while ``r`` is waited
    for alone (engine.Engine._into) when ``b`` is its bytes as they are: a contiguous
    type over contiguous memory, of :data:`PLACE_MIN` bytes or more."""
    if b.count * b.datatype.size >= PLACE_MIN and r.msg is None \
            and b.datatype.contiguous and b.flat.flags.c_contiguous:  # the size first: cheap
        r.into = b.raw()


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
        if not (m.placed and datapath.address(m.data) == datapath.address(buf.raw())):
            buf.put(m.data, "receive")  # else read into ``buf`` already (Recv.into)
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
        _may_read_into(r, b)
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
        r = self._post(source, tag, "Irecv")
        _may_read_into(r, b)
        return Request(self, r, b)

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
