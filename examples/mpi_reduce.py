"""A reduction test in the usual mpi4py style: floating-point sums, products, maxima and
minima, on Python objects and on numpy buffers, with ``reduce``/``allreduce`` and
``Reduce``/``Allreduce`` (IN_PLACE too), and ``MAXLOC``/``MINLOC`` on ``DOUBLE_INT``
pairs. Each line says whether its value can depend on the MPI library's order of
operations: ``exact`` lines (integers, max/min, and sums the program orders itself by
gathering and adding in rank order) are the same bits under any MPI; ``rounded`` lines
(floating-point sums and products in MPI's order) agree to rounding. Rank 0 prints.

    mpirun -n 4 python examples/mpi_reduce.py
    python -m raps_slurm.runtime.local -n 4 --mpi4py -- python examples/mpi_reduce.py
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(1234 + rank)
    v = rng.standard_normal(1000)
    out: list[tuple[str, str, object]] = []
    # Sums whose order the program fixes: gather, then add in rank order.
    parts = comm.allgather(float(v.sum()))
    ordered = 0.0
    for x in parts:
        ordered += x
    out.append(("exact", "ordered sum", repr(ordered)))
    blocks = np.empty((size, v.size)) if rank == 0 else None
    comm.Gather(v, blocks, root=0)
    if rank == 0:
        assert blocks is not None
        acc = blocks[0].copy()
        for r in range(1, size):
            acc += blocks[r]
        out.append(("exact", "ordered Gather sum", repr(float(acc.sum()))))
    # Sums and products in MPI's order.
    out.append(("rounded", "allreduce SUM", comm.allreduce(float(v.sum()), op=MPI.SUM)))
    out.append(("rounded", "reduce PROD", comm.reduce(1.0 + abs(float(v[0])), op=MPI.PROD)))
    total = np.zeros_like(v)
    comm.Allreduce([v, MPI.DOUBLE], [total, MPI.DOUBLE], op=MPI.SUM)
    out.append(("rounded", "Allreduce SUM", float(total.sum())))
    mine = v[:8].copy()
    comm.Allreduce(MPI.IN_PLACE, [mine, MPI.DOUBLE], op=MPI.SUM)
    out.append(("rounded", "Allreduce IN_PLACE SUM", float(mine.sum())))
    # Max and min: exact under any order.
    out.append(("exact", "allreduce MAX", repr(comm.allreduce(float(v.max()), op=MPI.MAX))))
    hi = np.zeros_like(v)
    comm.Allreduce(v, hi, op=MPI.MAX)
    out.append(("exact", "Allreduce MAX", repr(float(hi.sum()))))
    lo = np.zeros_like(v) if rank == 0 else None
    comm.Reduce(v, lo, op=MPI.MIN, root=0)
    if rank == 0:
        assert lo is not None
        out.append(("exact", "Reduce MIN", repr(float(lo.sum()))))
    # MPI.DOUBLE_INT is a C struct {double; int}: numpy's aligned layout (16 bytes)
    pairs = np.zeros(3, dtype=np.dtype([("v", np.float64), ("i", np.int32)], align=True))
    pairs["v"], pairs["i"] = v[:3].round(1), rank
    best = np.zeros_like(pairs)
    comm.Allreduce([pairs, MPI.DOUBLE_INT], [best, MPI.DOUBLE_INT], op=MPI.MAXLOC)
    out.append(("exact", "Allreduce MAXLOC", [(float(x), int(i)) for x, i in best]))
    comm.Allreduce([pairs, MPI.DOUBLE_INT], [best, MPI.DOUBLE_INT], op=MPI.MINLOC)
    out.append(("exact", "Allreduce MINLOC", [(float(x), int(i)) for x, i in best]))
    out.append(("exact", "allreduce MAXLOC", comm.allreduce((round(float(v[0]), 1), rank),
                                                          op=MPI.MAXLOC)))
    isum = comm.allreduce(int(v[0] * 1e6), op=MPI.SUM)
    out.append(("exact", "allreduce int SUM", isum))
    if rank == 0:
        for kind, name, value in out:
            print(kind, name, value, flush=True)


if __name__ == "__main__":
    main()
