"""Collectives in the usual mpi4py style, object and buffer forms, with integer data so
that any MPI library prints the same: bcast, scatter, gather, allgather, alltoall,
reduce/allreduce with SUM, PROD, MAX, MIN, LAND, LOR, BAND, BOR, MAXLOC, MINLOC, their
buffer forms with IN_PLACE, and a Split communicator. Rank 0 prints every result.

    mpirun -n 4 python examples/mpi_collectives.py
    python -m raps_slurm.runtime.local -n 4 --mpi4py -- python examples/mpi_collectives.py
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    out: list[tuple[str, object]] = []
    cfg = comm.bcast({"n": 6, "name": "demo"} if rank == 0 else None, root=0)
    out.append(("bcast", cfg))
    part = comm.scatter([[i] * (i + 1) for i in range(size)] if rank == 0 else None, root=0)
    out.append(("gather", comm.gather(sum(part) + rank, root=0)))
    out.append(("allgather", comm.allgather(rank * rank)))
    out.append(("alltoall", comm.alltoall([rank * 100 + j for j in range(size)])))
    for name in ("SUM", "PROD", "MAX", "MIN", "LAND", "LOR", "BAND", "BOR"):
        op = getattr(MPI, name)
        out.append((f"allreduce {name}", comm.allreduce(rank + 1, op=op)))
        out.append((f"reduce {name}", comm.reduce(rank + 3, op=op, root=0)))
    # A root other than 0: the last rank reduces, then tells rank 0.
    last = comm.reduce(rank * 2 + 1, op=MPI.SUM, root=size - 1)
    if rank == size - 1:
        comm.send(last, dest=0, tag=9)
    if rank == 0:
        out.append(("reduce SUM at the last rank", comm.recv(source=size - 1, tag=9)))
    out.append(("MAXLOC", comm.allreduce(((rank * 7) % size, rank), op=MPI.MAXLOC)))
    out.append(("MINLOC", comm.allreduce(((rank * 5) % size, rank), op=MPI.MINLOC)))
    comm.barrier()

    n = cfg["n"]
    a = np.arange(n, dtype=np.int64) * (rank + 1)
    b = np.zeros(n, dtype=np.int64)
    comm.Allreduce([a, MPI.LONG], [b, MPI.LONG], op=MPI.SUM)
    out.append(("Allreduce SUM", b.tolist()))
    c = a.copy()
    comm.Allreduce(MPI.IN_PLACE, c, op=MPI.MAX)
    out.append(("Allreduce IN_PLACE MAX", c.tolist()))
    d = np.array([rank + 1, 2 * rank + 1], dtype=np.int32)
    if rank == 0:
        comm.Reduce(MPI.IN_PLACE, d, op=MPI.PROD, root=0)
        out.append(("Reduce IN_PLACE PROD", d.tolist()))
    else:
        comm.Reduce(d, None, op=MPI.PROD, root=0)
    bits = np.array([1 << rank, 0xFF ^ (1 << rank)], dtype=np.int32)
    band = np.zeros(2, dtype=np.int32)
    comm.Allreduce(bits, band, op=MPI.BAND)
    out.append(("Allreduce BAND", band.tolist()))
    buf = np.arange(3, dtype=np.float64) if rank == 0 else np.zeros(3)
    comm.Bcast([buf, MPI.DOUBLE], root=0)
    out.append(("Bcast", buf.tolist()))
    send = np.full(2, rank, dtype=np.int32)
    recv = np.zeros(2 * size, dtype=np.int32) if rank == 0 else None
    comm.Gather(send, recv, root=0)
    out.append(("Gather", recv.tolist() if recv is not None else None))
    mine = np.zeros(2, dtype=np.int32)
    comm.Scatter(np.arange(2 * size, dtype=np.int32) * 3 if rank == 0 else None, mine, root=0)
    out.append(("Scatter", comm.gather(mine.tolist(), root=0)))
    every = np.zeros(size, dtype=np.int64)
    every[rank] = rank * 11
    comm.Allgather(MPI.IN_PLACE, every)
    out.append(("Allgather IN_PLACE", every.tolist()))
    s = np.array([rank * 10 + j for j in range(size)], dtype=np.int32)
    r = np.zeros(size, dtype=np.int32)
    comm.Alltoall(s, r)
    out.append(("Alltoall", comm.gather(r.tolist(), root=0)))

    sub = comm.Split(color=rank % 2, key=-rank)
    out.append(("Split", comm.gather((sub.Get_rank(), sub.Get_size(),
                                      sub.allreduce(rank)), root=0)))
    sub.Free()
    dup = comm.Dup()
    out.append(("Dup", dup.allreduce(1)))
    dup.Free()
    if rank == 0:
        for name, value in out:
            print(name, value)


if __name__ == "__main__":
    main()
