"""Collectives of :mod:`raps_slurm.mpi` on fixed trees, and communicator creation.

Every collective runs over the communicator's collective context (``id + 1``: a
program's point-to-point messages never match them) as point-to-point messages with
named sources, so none of them takes a timing-dependent decision (:mod:`.tree`).
Broadcasts and reductions use a binomial tree rooted at ``root`` (reductions: each node
combines its own partial result with its children's in increasing order, ``own op
child``); ``allreduce`` is a reduce to rank 0 and a broadcast (``Allreduce`` of a buffer
on a power-of-two size: recursive halving then doubling), ``allgather`` a gather to 0
and a broadcast. Block, vector and prefix collectives are in :mod:`.blocks`, the
non-blocking ones in :mod:`.nonblocking`. The order of every floating-point operation is
fixed by the communicator's size alone: a replay computes bit-identical results.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import numpy as np

from raps_slurm.mpi.blocks import BlockCollectives
from raps_slurm.mpi.buffers import Buffer, as_buffer
from raps_slurm.mpi.comm import COMM_NULL, PLACE_MIN, Exception
from raps_slurm.mpi.nonblocking import NonBlocking
from raps_slurm.mpi.requests import UNDEFINED
from raps_slurm.mpi.tree import (
    T_ALLREDUCE,
    T_ALLTOALL,
    T_GATHER,
    T_REDUCE,
    T_SCATTER,
    dumps,
    in_place,
    view,
)
from raps_slurm.mpi.types import OPS, Op, copy_array, reducible

SUM = OPS["SUM"]


def derived_id(parent: int, n: int, color: int) -> int:
    """The context id of the ``n``-th communicator made from ``parent`` (with ``color``):
    the same on every member, even, never 0-3 (the world's and self's)."""
    h = hashlib.blake2b(f"{parent}/{n}/{color}".encode(), digest_size=8).digest()
    return (int.from_bytes(h, "big") & ~1) | 4


class Intracomm(BlockCollectives, NonBlocking):
    """A communicator with collectives (``COMM_WORLD`` is one)."""

    # --- object collectives ----------------------------------------------------------

    def barrier(self) -> None:
        """Wait until every rank has entered."""
        self._enter("barrier")
        self._reduce_tree(None, lambda a, b: None, lambda _: b"", lambda _: None, 0)
        self._bcast_bytes(b"", 0)

    Barrier = barrier

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        """``root``'s object on every rank."""
        me, _ = self._enter("bcast", root)
        return pickle.loads(self._bcast_bytes(dumps(obj) if me == root else None, root))

    def reduce(self, sendobj: Any, op: Op = SUM, root: int = 0) -> Any:
        """The reduction at ``root`` (None elsewhere)."""
        self._enter("reduce", root)
        return self._reduce_tree(sendobj, op, dumps, pickle.loads, root)

    def allreduce(self, sendobj: Any, op: Op = SUM) -> Any:
        """The reduction on every rank."""
        me, _ = self._enter("allreduce")
        got = self._reduce_tree(sendobj, op, dumps, pickle.loads, 0)
        return pickle.loads(self._bcast_bytes(dumps(got) if me == 0 else None, 0))

    def gather(self, sendobj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's object, in rank order, at ``root``."""
        me, n = self._enter("gather", root)
        if me != root:
            self._csend(root, dumps(sendobj), T_GATHER)
            return None
        return [sendobj if r == root else pickle.loads(self._crecv(r, T_GATHER))
                for r in range(n)]

    def scatter(self, sendobj: Any = None, root: int = 0) -> Any:
        """Item ``rank`` of ``root``'s sequence."""
        me, n = self._enter("scatter", root)
        if me != root:
            return pickle.loads(self._crecv(root, T_SCATTER))
        items = list(sendobj) if sendobj is not None else []
        if len(items) != n:
            raise ValueError(f"scatter: {len(items)} items for {n} ranks")
        for r in range(n):
            if r != root:
                self._csend(r, dumps(items[r]), T_SCATTER)
        return items[root]

    def allgather(self, sendobj: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank."""
        me, _ = self._enter("allgather")
        got = self.gather(sendobj, 0)
        return list(pickle.loads(self._bcast_bytes(dumps(got) if me == 0 else None, 0)))

    def alltoall(self, sendobj: Any) -> list[Any]:
        """Item ``j`` of rank ``i``'s sequence becomes item ``i`` on rank ``j``."""
        me, n = self._enter("alltoall")
        items = list(sendobj)
        if len(items) != n:
            raise ValueError(f"alltoall: {len(items)} items for {n} ranks")
        for r in range(n):
            if r != me:
                self._csend(r, dumps(items[r]), T_ALLTOALL)
        return [items[me] if r == me else pickle.loads(self._crecv(r, T_ALLTOALL))
                for r in range(n)]

    # --- buffer collectives ----------------------------------------------------------

    def Bcast(self, buf: Any, root: int = 0) -> None:
        """``root``'s buffer into every rank's."""
        me, _ = self._enter("Bcast", root)
        b = as_buffer(buf, "Bcast", readonly=me == root)
        # The root's buffer as it is: every send copies what it sends.
        data = self._bcast_bytes(b.raw() if me == root else None, root)
        if me != root:
            b.put(data, "Bcast")

    def _reduce_arrays(self, sendbuf: Any, recvbuf: Any, op: Op, root: int, call: str
                       ) -> tuple[np.ndarray[Any, Any] | None, Buffer | None]:
        me, _ = self._enter(call, max(root, 0))
        rb = as_buffer(recvbuf, call, readonly=False) if me == root or root < 0 else None
        if in_place(sendbuf) and rb is not None:
            reducible(rb.datatype, call)
            mine = copy_array(rb.array)
        else:
            sb = as_buffer(sendbuf, call)
            reducible(sb.datatype, call)
            mine = copy_array(sb.array)
            if rb is not None and rb.count != (mine.size // max(rb.datatype.offsets.size, 1)):
                raise ValueError(f"{call}: send count {mine.size} and receive count "
                                 f"{rb.count} differ")
        return self._run(self._array_steps(mine, op, max(root, 0), T_REDUCE)), rb

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM, root: int = 0
               ) -> None:
        """Element-wise reduction into ``root``'s ``recvbuf`` (IN_PLACE at the root)."""
        got, rb = self._reduce_arrays(sendbuf, recvbuf, op, root, "Reduce")
        if got is not None and rb is not None:
            rb.put(view(got), "Reduce")

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> None:
        """Element-wise reduction into every rank's ``recvbuf`` (IN_PLACE allowed)."""
        me, n = self._enter("Allreduce")
        rb = as_buffer(recvbuf, "Allreduce", readonly=False)
        src = rb if in_place(sendbuf) else as_buffer(sendbuf, "Allreduce")
        reducible(src.datatype, "Allreduce")
        if n & (n - 1) == 0 and src.array.size >= n > 1:
            if rb.datatype.contiguous and src.array.size == rb.array.size \
                    and src.array.dtype == rb.array.dtype and rb.array.dtype.fields is None:
                out = rb.array
                # Reduced in the receive buffer itself (MPI leaves it undefined until the
                # call returns): no copy of the array and no result to copy back. Not a
                # structured type: its padding bytes are sent, and copy_array fixes them.
                if src is not rb:
                    out[...] = src.array
                self._halving_doubling(out, op, me, n)
                return
            mine = copy_array(src.array).reshape(-1)
            rb.put(view(self._halving_doubling(mine, op, me, n)), "Allreduce")
            return
        got, _ = self._reduce_arrays(sendbuf, recvbuf, op, -1, "Allreduce")
        data = self._bcast_bytes(view(got) if got is not None else None, 0)
        rb.put(data, "Allreduce")

    def _halving_doubling(self, mine: np.ndarray[Any, Any], op: Op, me: int, n: int
                          ) -> np.ndarray[Any, Any]:
        """Allreduce on a power-of-two size: a reduce-scatter by recursive halving, then
        an allgather by recursive doubling (each rank sends about twice its array in
        all, where the binomial reduce and broadcast send the whole array at every
        step). Rank ``me`` meets ``me ^ d`` for d = n/2 .. 1, keeps the lower half of its
        part if ``me & d`` is 0, and combines ``lower rank op higher rank``: the order of
        every operation is fixed by the size alone, as for the trees."""
        dtype = mine.dtype
        lo, hi = 0, mine.size
        parts: list[tuple[int, int]] = []
        d = n >> 1
        while d:
            partner, mid = me ^ d, lo + (hi - lo) // 2
            (klo, khi), (glo, ghi) = ((mid, hi), (lo, mid)) if me & d else ((lo, mid), (mid, hi))
            self._csend(partner, view(mine[glo:ghi]), T_ALLREDUCE)
            theirs = np.frombuffer(self._crecv(partner, T_ALLREDUCE), dtype=dtype)
            if theirs.size != khi - klo:
                raise Exception(f"Allreduce: rank {partner} sent {theirs.size} elements "
                                f"where {khi - klo} were expected")
            ours = mine[klo:khi]
            if me < partner:
                op.apply_into(ours, theirs, ours)
            else:
                op.apply_into(theirs, ours, ours)
            parts.append((lo, hi))
            lo, hi = klo, khi
            d >>= 1
        d = 1
        while d < n:
            partner = me ^ d
            plo, phi = parts.pop()
            olo, ohi = (hi, phi) if lo == plo else (plo, lo)  # the partner's half
            block = view(mine[olo:ohi])
            # Posted first, with the half it fills as its buffer: a large half is read
            # straight there (Comm.Recv's way), not copied from a buffer of its own.
            r = self._post_c(partner, T_ALLREDUCE)
            if r.msg is None and len(block) >= PLACE_MIN:
                r.into = block
            self._csend(partner, view(mine[lo:hi]), T_ALLREDUCE)
            m = self._w.engine.wait(r)
            if len(m.data) != len(block):
                raise Exception(f"Allreduce: rank {partner} sent {len(m.data)} bytes where "
                                f"{len(block)} were expected")
            if not m.placed:
                block[:] = m.data
            lo, hi = plo, phi
            d <<= 1
        return mine

    # --- communicators ---------------------------------------------------------------

    def _derive(self, color: int, key: int, call: str) -> Any:
        w = self._w
        n = w.children.get(self._ctx_id, 0)
        w.children[self._ctx_id] = n + 1
        if w.replaying_setup():
            if w.created >= len(w.saved_comms):
                raise RuntimeError(f"{call}: this rank was restored from a checkpoint; call "
                                   "raps_slurm.mpi.restore() before creating communicators "
                                   "its checkpoint does not know")
            ctx_id, ranks = w.saved_comms[w.created]
            w.created += 1
            return Intracomm._make(ctx_id, ranks) if ranks is not None else COMM_NULL
        members: list[int] | None
        if call == "Dup":
            members = list(self._members())
        else:
            pairs = self.allgather((color, key))
            if color == UNDEFINED:
                members = None
            else:
                mine = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == color)
                members = [self._world_rank(r, "rank") for _, r in mine]
        ctx_id = derived_id(self._ctx_id, n, color)
        w.saved_comms.append((ctx_id, members))
        w.created += 1
        return Intracomm._make(ctx_id, members) if members is not None else COMM_NULL

    def Dup(self, info: Any = None) -> Intracomm:
        """Same ranks, a message space of its own (no communication needed)."""
        return self._derive(-3, 0, "Dup")  # type: ignore[no-any-return]

    Clone = Dup

    def Split(self, color: int = 0, key: int = 0) -> Any:
        """Ranks with the same ``color`` in a new communicator, ordered by ``key`` then
        rank; ``UNDEFINED`` gets ``COMM_NULL``."""
        return self._derive(color, key, "Split")
