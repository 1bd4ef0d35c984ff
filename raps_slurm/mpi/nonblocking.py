"""Non-blocking collectives of :mod:`raps_slurm.mpi`: ``Ibarrier``, ``Ibcast``,
``Ireduce``, ``Iallreduce``.

Each runs the same binomial trees as the blocking calls (the same order of operations,
so the same bits), written as a schedule that stops at each receive. It moves only at
points a replay reproduces: the call itself runs the schedule to its first receive (the
sends before it), ``Wait`` runs it to the end, and ``Test`` takes every step whose
message has arrived and records how far it got as a determinant (a restored rank's
``Test`` waits until the schedule is that far); ``Testany``, ``Waitany``, ``Testsome``
and ``Waitsome`` move it through that same ``Test``. It does not move inside other calls:
a program that needs it to (a rank waiting in ``Recv`` on a peer that first needs this
rank's part of the collective) waits for ever, where Open MPI's progress engine would
move it. Each non-blocking collective on a communicator gets a tag of its own (the
n-th one on every rank, as MPI orders collectives), so several may be pending at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raps_slurm.mpi.buffers import Buffer, as_buffer
from raps_slurm.mpi.engine import Recv
from raps_slurm.mpi.requests import Request, Status
from raps_slurm.mpi.tree import Schedule, TreeComm, in_place, view
from raps_slurm.mpi.types import OPS, Op, copy_array, reducible
from raps_slurm.mpi.world import world

SUM = OPS["SUM"]
T_NONBLOCKING = 1 << 16  # tags from here: one per non-blocking collective


class CollRequest(Request):
    """A pending non-blocking collective (see the module docstring)."""

    collective = True

    def __init__(self, comm: TreeComm, schedule: Schedule,
                 finish: Any = None) -> None:
        super().__init__(comm)
        self._schedule, self._finisher = schedule, finish
        self._stage, self._ended, self._result = 0, False, None
        self._at: Recv | None = None
        self._step(None)

    def _step(self, data: bytes | memoryview | None) -> None:
        try:
            self._at = self._schedule.send(data)  # type: ignore[arg-type]
        except StopIteration as stop:
            self._at, self._ended, self._result = None, True, stop.value
        self._stage += 1

    def _advance(self, block: bool, upto: int | None = None) -> None:
        eng = world().engine
        while not self._ended and (upto is None or self._stage < upto):
            assert self._at is not None
            if self._at.msg is None:
                if not block:
                    return
                eng.wait(self._at)
            assert self._at.msg is not None
            self._step(self._at.msg.data)

    def _done(self) -> bool:
        return self._ended

    def _wait(self) -> None:
        if self.active:
            self._advance(block=True)

    def _finish(self, status: Status | None) -> Any:
        if self.active and self._ended:
            self.active = False
            if self._finisher is not None:
                self._finisher(self._result)
        if status is not None:
            status.source, status.tag, status.nbytes = -1, -1, 0  # ANY_SOURCE/ANY_TAG
        return None

    def test(self, status: Status | None = None) -> tuple[bool, Any]:
        """(completed, None): takes the steps whose messages arrived (recorded)."""
        if not self.active or self._ended:  # ended in the call or an earlier step: no timing
            return True, self._finish(status)

        def outcome() -> tuple[int, int, int] | None:
            before = self._stage
            self._advance(block=False)
            return None if self._stage == before else (1, self._stage, int(self._ended))
        got = world().engine.decision(
            outcome, lambda rep: self._advance(block=True, upto=rep[1]))
        if got is None or not got[2]:
            return False, None
        return True, self._finish(status)

    def Free(self) -> None:
        """Not for a pending collective."""
        if self.active:
            raise ValueError("MPI.Request.Free of a pending non-blocking collective: Wait "
                             "for it")


class NonBlocking(TreeComm):
    """``Ibarrier``, ``Ibcast``, ``Ireduce``, ``Iallreduce``."""

    _nb_count = 0

    def _nb_tag(self) -> int:
        # every member counts the same calls in the same order (the handle's own
        # counter is shared by every handle of the communicator through the world)
        w = self._w
        n = w.children.get(-self._ctx_id - 1, 0)
        w.children[-self._ctx_id - 1] = n + 1
        return T_NONBLOCKING + n % (1 << 30)

    def _operand(self, sendbuf: Any, rb: Buffer | None, call: str) -> np.ndarray[Any, Any]:
        src = rb if in_place(sendbuf) and rb is not None else as_buffer(sendbuf, call)
        reducible(src.datatype, call)
        return copy_array(src.array)

    def Ibarrier(self) -> Request:
        """A barrier that completes in Wait/Test."""
        self._enter("Ibarrier")
        tag = self._nb_tag()

        def steps() -> Schedule:
            yield from self._reduce_steps(None, lambda a, b: None, lambda _: b"",
                                          lambda _: None, 0, tag)
            yield from self._bcast_steps(b"" if self.Get_rank() == 0 else None, 0, tag)
        return CollRequest(self, steps())

    def Ibcast(self, buf: Any, root: int = 0) -> Request:
        """``root``'s buffer into every rank's, by Wait/Test (the root's is read now)."""
        me, _ = self._enter("Ibcast", root)
        b = as_buffer(buf, "Ibcast", readonly=me == root)
        data = bytes(b.raw()) if me == root else None
        done = None if me == root else (lambda d: b.put(d, "Ibcast"))
        return CollRequest(self, self._bcast_steps(data, root, self._nb_tag()), done)

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM, root: int = 0) -> Request:
        """``Reduce`` that completes in Wait/Test."""
        me, _ = self._enter("Ireduce", root)
        rb = as_buffer(recvbuf, "Ireduce", readonly=False) if me == root else None
        mine = self._operand(sendbuf, rb, "Ireduce")
        done = None if rb is None else (lambda got: rb.put(view(got), "Ireduce"))
        return CollRequest(self, self._array_steps(mine, op, root, self._nb_tag()), done)

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> Request:
        """``Allreduce`` (as a reduce to 0 and a broadcast) that completes in Wait/Test."""
        self._enter("Iallreduce")
        rb = as_buffer(recvbuf, "Iallreduce", readonly=False)
        mine = self._operand(sendbuf, rb, "Iallreduce")
        tag = self._nb_tag()

        def steps() -> Schedule:
            got = yield from self._array_steps(mine, op, 0, tag)
            return (yield from self._bcast_steps(None if got is None else view(got), 0, tag))
        return CollRequest(self, steps(), lambda data: rb.put(data, "Iallreduce"))
