"""Collectives of :mod:`raps_slurm.mpi` that move one block per process: ``Gather``,
``Scatter``, ``Allgather``, ``Alltoall``, their vector forms, and the prefix reductions
``Scan``/``Exscan`` and ``Reduce_scatter(_block)``.

Buffers are read as mpi4py reads them (:mod:`raps_slurm.mpi.buffers`): an explicit count
is the count per process. Gathers and scatters go between the root and each rank in
rank order, ``Allgather(v)`` is a gather to 0 and a broadcast, ``Alltoall(v)`` sends to
every rank then receives from each in rank order; ``Scan`` and ``Exscan`` run along the
ranks in order (rank ``r`` combines ``prefix op own``, so the order of every operation
is fixed), ``Reduce_scatter`` is a tree reduction to 0 then a scatter. No timing-
dependent decision anywhere: a replay computes the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raps_slurm.mpi.buffers import Buffer, as_buffer, as_vector
from raps_slurm.mpi.tree import (
    T_ALLTOALL,
    T_GATHER,
    T_REDUCE,
    T_SCAN,
    T_SCATTER,
    TreeComm,
    in_place,
    view,
)
from raps_slurm.mpi.types import OPS, Op, copy_array, reducible

SUM = OPS["SUM"]


def _join(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(parts)


class BlockCollectives(TreeComm):
    """Block and vector collectives, scans and reduce-scatters."""

    # --- one block per process -------------------------------------------------------

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """Every rank's buffer into block ``rank`` of ``root``'s ``recvbuf`` (IN_PLACE
        at the root: its block is there already)."""
        me, n = self._enter("Gather", root)
        if me != root:
            self._csend(root, as_buffer(sendbuf, "Gather").raw(), T_GATHER)
            return
        rb = as_buffer(recvbuf, "Gather", n, readonly=False)
        self._collect([rb.sub(r * rb.count, rb.count, "Gather") for r in range(n)],
                      sendbuf, me, root, "Gather")

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """Every rank's buffer into block ``rank`` (``counts``, ``displs``) of ``root``'s
        ``recvbuf``."""
        me, n = self._enter("Gatherv", root)
        if me != root:
            self._csend(root, as_buffer(sendbuf, "Gatherv").raw(), T_GATHER)
            return
        rv = as_vector(recvbuf, "Gatherv", n, readonly=False)
        self._collect([rv.block(r, "Gatherv") for r in range(n)], sendbuf, me, root,
                      "Gatherv")

    def _collect(self, blocks: list[Buffer], sendbuf: Any, me: int, root: int, call: str
                 ) -> None:
        for r, block in enumerate(blocks):
            if r != root:
                block.put(self._crecv(r, T_GATHER), call)
            elif not in_place(sendbuf):
                block.put(as_buffer(sendbuf, call).raw(), call)

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """Block ``rank`` of ``root``'s ``sendbuf`` into every rank's ``recvbuf``
        (IN_PLACE as the root's ``recvbuf``: its block stays where it is)."""
        me, n = self._enter("Scatter", root)
        if me != root:
            self._take(recvbuf, root, "Scatter")
            return
        sb = as_buffer(sendbuf, "Scatter", n)
        self._deal([sb.sub(r * sb.count, sb.count, "Scatter") for r in range(n)], recvbuf,
                   root, "Scatter")

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """Block ``rank`` (``counts``, ``displs``) of ``root``'s ``sendbuf`` into every
        rank's ``recvbuf``."""
        me, n = self._enter("Scatterv", root)
        if me != root:
            self._take(recvbuf, root, "Scatterv")
            return
        sv = as_vector(sendbuf, "Scatterv", n)
        self._deal([sv.block(r, "Scatterv") for r in range(n)], recvbuf, root, "Scatterv")

    def _take(self, recvbuf: Any, root: int, call: str) -> None:
        as_buffer(recvbuf, call, readonly=False).put(self._crecv(root, T_SCATTER), call)

    def _deal(self, blocks: list[Buffer], recvbuf: Any, root: int, call: str) -> None:
        for r, block in enumerate(blocks):
            if r != root:
                self._csend(r, block.raw(), T_SCATTER)
        if not in_place(recvbuf):
            as_buffer(recvbuf, call, readonly=False).put(bytes(blocks[root].raw()), call)

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """Every rank's buffer into block ``rank`` of every ``recvbuf`` (IN_PLACE: the
        block is there already)."""
        me, n = self._enter("Allgather")
        rb = as_buffer(recvbuf, "Allgather", n, readonly=False)
        self._everyone([rb.sub(r * rb.count, rb.count, "Allgather") for r in range(n)],
                       sendbuf, me, "Allgather")

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        """Every rank's buffer into block ``rank`` (``counts``, ``displs``) of every
        ``recvbuf``."""
        me, n = self._enter("Allgatherv")
        rv = as_vector(recvbuf, "Allgatherv", n, readonly=False)
        self._everyone([rv.block(r, "Allgatherv") for r in range(n)], sendbuf, me,
                       "Allgatherv")

    def _everyone(self, blocks: list[Buffer], sendbuf: Any, me: int, call: str) -> None:
        mine = bytes(blocks[me].raw()) if in_place(sendbuf) else \
            bytes(as_buffer(sendbuf, call).raw())
        if me != 0:
            self._csend(0, mine, T_GATHER)
        else:
            blocks[0].put(mine, call)
            for r in range(1, len(blocks)):
                blocks[r].put(self._crecv(r, T_GATHER), call)
        data = self._bcast_bytes(_join([b.raw() for b in blocks]) if me == 0 else None, 0)
        if me != 0:
            at = 0
            for b in blocks:
                b.put(data[at:at + b.nbytes], call)
                at += b.nbytes

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        """Block ``j`` of rank ``i``'s ``sendbuf`` into block ``i`` of rank ``j``'s
        ``recvbuf`` (IN_PLACE: ``recvbuf`` holds what to send)."""
        _, n = self._enter("Alltoall")
        rb = as_buffer(recvbuf, "Alltoall", n, readonly=False)
        rblocks = [rb.sub(r * rb.count, rb.count, "Alltoall") for r in range(n)]
        if in_place(sendbuf):
            sblocks: list[bytes | memoryview] = [bytes(b.raw()) for b in rblocks]
        else:
            sb = as_buffer(sendbuf, "Alltoall", n)
            sblocks = [sb.sub(r * sb.count, sb.count, "Alltoall").raw() for r in range(n)]
        self._exchange(sblocks, rblocks, "Alltoall")

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        """Block ``j`` (``counts``, ``displs``) of rank ``i``'s ``sendbuf`` into block
        ``i`` of rank ``j``'s ``recvbuf`` (IN_PLACE: ``recvbuf`` holds what to send)."""
        _, n = self._enter("Alltoallv")
        rv = as_vector(recvbuf, "Alltoallv", n, readonly=False)
        rblocks = [rv.block(r, "Alltoallv") for r in range(n)]
        if in_place(sendbuf):
            sblocks: list[bytes | memoryview] = [bytes(b.raw()) for b in rblocks]
        else:
            sv = as_vector(sendbuf, "Alltoallv", n)
            sblocks = [sv.block(r, "Alltoallv").raw() for r in range(n)]
        self._exchange(sblocks, rblocks, "Alltoallv")

    def _exchange(self, sblocks: list[bytes | memoryview], rblocks: list[Buffer], call: str
                  ) -> None:
        me = self.Get_rank()
        for r, block in enumerate(sblocks):
            if r != me:
                self._csend(r, block, T_ALLTOALL)
        own = bytes(sblocks[me])
        for r, rblock in enumerate(rblocks):
            rblock.put(own if r == me else self._crecv(r, T_ALLTOALL), call)

    # --- prefix reductions and reduce-scatter ------------------------------------------

    def _operands(self, sendbuf: Any, rb: Buffer, call: str) -> np.ndarray[Any, Any]:
        src = rb if in_place(sendbuf) else as_buffer(sendbuf, call)
        reducible(src.datatype, call)
        mine = copy_array(src.array)
        if mine.size != rb.array.size:
            raise ValueError(f"{call}: send count {mine.size} and receive count "
                             f"{rb.array.size} differ")
        return mine

    def Scan(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> None:
        """Rank ``r`` gets the reduction of ranks 0..r (IN_PLACE allowed)."""
        me, n = self._enter("Scan")
        rb = as_buffer(recvbuf, "Scan", readonly=False)
        mine = self._operands(sendbuf, rb, "Scan")
        if me > 0:
            prefix = np.frombuffer(self._crecv(me - 1, T_SCAN), dtype=mine.dtype).copy()
            op.apply_into(prefix, mine, mine)
        if me + 1 < n:
            self._csend(me + 1, view(mine), T_SCAN)
        rb.put(view(mine), "Scan")

    def Exscan(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> None:
        """Rank ``r`` > 0 gets the reduction of ranks 0..r-1; rank 0's ``recvbuf`` is
        left as it is (IN_PLACE allowed)."""
        me, n = self._enter("Exscan")
        rb = as_buffer(recvbuf, "Exscan", readonly=False)
        mine = self._operands(sendbuf, rb, "Exscan")
        if me > 0:
            prefix = np.frombuffer(self._crecv(me - 1, T_SCAN), dtype=mine.dtype).copy()
            rb.put(view(prefix), "Exscan")
            op.apply_into(prefix, mine, mine)
        if me + 1 < n:
            self._csend(me + 1, view(mine), T_SCAN)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> None:
        """Block ``rank`` of the element-wise reduction of every rank's ``sendbuf`` (one
        block per rank) into ``recvbuf`` (IN_PLACE: ``recvbuf`` holds every block, the
        result goes to its first)."""
        _, n = self._enter("Reduce_scatter_block")
        if in_place(sendbuf):
            whole = as_buffer(recvbuf, "Reduce_scatter_block", n, readonly=False)
            rb, sendbuf = whole, None
            counts = [whole.count] * n
            src = whole.sub(0, whole.count * n, "Reduce_scatter_block")
        else:
            rb = as_buffer(recvbuf, "Reduce_scatter_block", readonly=False)
            counts = [rb.count] * n
            src = as_buffer(sendbuf, "Reduce_scatter_block", n)
            src = src.sub(0, src.count * n, "Reduce_scatter_block")
        self._reduce_scatter(src, rb, counts, op, "Reduce_scatter_block")

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None,
                       op: Op = SUM) -> None:
        """Block ``rank`` (``recvcounts[rank]`` elements) of the element-wise reduction
        of every rank's ``sendbuf`` into ``recvbuf``; ``recvcounts`` None: each rank's
        receive count, gathered."""
        _, n = self._enter("Reduce_scatter")
        rb = as_buffer(recvbuf, "Reduce_scatter", readonly=False)
        if recvcounts is None:
            recvcounts = self.allgather(rb.count)
        counts = [int(c) for c in recvcounts]
        if len(counts) != n:
            raise ValueError(f"Reduce_scatter: {len(counts)} receive counts for {n} ranks")
        if in_place(sendbuf):
            src = rb.sub(0, sum(counts), "Reduce_scatter")
        else:
            src = as_buffer(sendbuf, "Reduce_scatter")
            src = src.sub(0, sum(counts), "Reduce_scatter")
        self._reduce_scatter(src, rb, counts, op, "Reduce_scatter")

    def _reduce_scatter(self, src: Buffer, rb: Buffer, counts: list[int], op: Op, call: str
                        ) -> None:
        me, n = self.Get_rank(), self.Get_size()
        reducible(src.datatype, call)
        got = self._run(self._array_steps(copy_array(src.array), op, 0, T_REDUCE))
        per = rb.datatype.offsets.size  # base elements per element
        if me == 0:
            at = 0
            for r in range(n):
                part = view(got[at:at + counts[r] * per])
                at += counts[r] * per
                if r == 0:
                    rb.put(part, call)
                else:
                    self._csend(r, part, T_SCATTER)
        else:
            rb.put(self._crecv(0, T_SCATTER), call)
