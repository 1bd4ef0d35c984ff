"""Vector collectives and prefix reductions: ``Gatherv``, ``Scatterv``, ``Allgatherv``,
``Alltoallv`` with counts and displacements, and in place; ``Scan``, ``Exscan``,
``Reduce_scatter_block`` and ``Reduce_scatter`` (integer operations: the same under any
reduction order). Rank 0 prints what every rank got. Run and crash it as common.py says.
"""

import numpy as np
from common import crash_knob, print_all
from mpi4py import MPI


def main() -> None:
    maybe_die = crash_knob()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = [r + 1 for r in range(size)]
    displs = [sum(counts[:r]) + r for r in range(size)]  # a gap after each block
    total = displs[-1] + counts[-1] + 1
    lines = []
    for step in range(3):
        maybe_die(rank, step)
        mine = np.arange(rank + 1, dtype="i") + 100 * rank + step
        got = []
        g = np.full(total, -1, dtype="i")
        comm.Gatherv(mine, [g, counts, displs, MPI.INT] if rank == 0 else None, root=0)
        got.append(g)
        g = np.full(total, -1, dtype="i")
        comm.Allgatherv([mine, MPI.INT], [g, (counts, displs), MPI.INT])
        got.append(g)
        g = np.full(sum(counts), -1, dtype="i")
        comm.Allgatherv(mine, [g, counts])
        got.append(g)
        s = np.arange(total, dtype="d") * (step + 1)
        r = np.full(rank + 2, -1.0)
        comm.Scatterv([s, counts, displs, MPI.DOUBLE], [r, rank + 1, MPI.DOUBLE],
                      root=size - 1)
        got.append(r)
        send = np.arange(size * size, dtype="i") + 1000 * rank
        recv = np.full(size * size, -1, dtype="i")
        scounts = [(rank + j) % size + 1 for j in range(size)]
        rcounts = [(j + rank) % size + 1 for j in range(size)]
        comm.Alltoallv([send, (scounts, [j * size for j in range(size)]), MPI.INT],
                       [recv, (rcounts, [j * size for j in range(size)]), MPI.INT])
        got.append(recv)
        # IN_PLACE: the root's own block (every rank's, for Allgatherv and Alltoallv) is
        # already where it belongs
        g = np.full(total, -1, dtype="i")
        g[displs[rank]:displs[rank] + counts[rank]] = mine
        comm.Gatherv(MPI.IN_PLACE if rank == 1 % size else mine,
                     [g, (counts, displs), MPI.INT], root=1 % size)
        got.append(g)
        g = np.full(total, -1, dtype="i")
        g[displs[rank]:displs[rank] + counts[rank]] = mine
        comm.Allgatherv(MPI.IN_PLACE, [g, counts, displs, MPI.INT])
        got.append(g)
        r = np.full(rank + 1, -1.0)
        comm.Scatterv([s, counts, displs, MPI.DOUBLE],
                      MPI.IN_PLACE if rank == 0 else [r, MPI.DOUBLE], root=0)
        got.append(r)
        sym = np.arange(size * (size + 1), dtype="i") + 1000 * rank
        symc = [2] * size  # in place: what rank i sends rank j is what j sends i
        comm.Alltoallv(MPI.IN_PLACE, [sym, (symc, [j * (size + 1) for j in range(size)]),
                                      MPI.INT])
        got.append(sym)
        x = np.array([rank + 1, 2 * rank + step, -rank], dtype="l")
        y = np.zeros(3, dtype="l")
        comm.Scan(x, y, op=MPI.SUM)
        got.append(y)
        comm.Scan(x, y, op=MPI.MAX)
        got.append(y)
        z = np.full(3, -7, dtype="l")
        comm.Exscan([x, MPI.LONG], [z, MPI.LONG], op=MPI.SUM)
        got.append(z if rank > 0 else np.zeros(0))
        w = x.copy()
        comm.Scan(MPI.IN_PLACE, w, op=MPI.PROD)
        got.append(w)
        blocks = np.arange(2 * size, dtype="i") * (rank + 1) + step
        rb = np.zeros(2, dtype="i")
        comm.Reduce_scatter_block(blocks, rb, op=MPI.SUM)
        got.append(rb)
        inplace = blocks.copy()
        comm.Reduce_scatter_block(MPI.IN_PLACE, [inplace, 2, MPI.INT], op=MPI.BOR)
        got.append(inplace[:2])
        rc = np.zeros(rank + 1, dtype="i")
        comm.Reduce_scatter(np.arange(sum(counts), dtype="i") + rank, rc, counts, op=MPI.SUM)
        got.append(rc)
        lines.extend(f"rank {rank} step {step} got {i}: {a.tolist()}" for i, a in enumerate(got))
    print_all(comm, lines)


if __name__ == "__main__":
    main()
