"""Non-blocking collectives: ``Ibarrier``, ``Ibcast``, ``Ireduce``, ``Iallreduce``,
completed by ``Wait``, by ``Waitall`` and by a ``Test`` loop that does other work
meanwhile (integer reductions: the same under any order). Rank 0 prints what every
rank got.

    mpirun -n 3 python examples/mpi4py/nonblocking.py
    python -m raps_slurm.runtime.local -n 3 --mpi4py -- python examples/mpi4py/nonblocking.py

``--die RANK:STEP`` makes RANK exit (code 17) at STEP in its first epoch.
"""

import argparse
import os

import numpy as np
from mpi4py import MPI


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--die", default=None, help="RANK:STEP")
    die_rank, die_at = (int(x) for x in (p.parse_args().die or "-1:-1").split(":"))
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    lines = []
    for step in range(4):
        if rank == die_rank and step == die_at and os.environ.get("RAPS_EPOCH", "1") == "1":
            os._exit(17)
        data = np.arange(5, dtype="l") * (rank + 1) + step
        total = np.zeros(5, dtype="l")
        top = np.zeros(5, dtype="l")
        b = np.arange(3, dtype="i") + 10 * step if rank == size - 1 else np.zeros(3, "i")
        reqs = [comm.Iallreduce(data, total, op=MPI.SUM),
                comm.Ireduce([data, MPI.LONG], [top, MPI.LONG] if rank == 0 else None,
                             op=MPI.MAX, root=0),
                comm.Ibcast(b, root=size - 1)]
        work = 0
        if step % 2:
            while not MPI.Request.Testall(reqs):
                work += 1          # the program's own work while they complete
        else:
            MPI.Request.Waitall(reqs)
        inplace = data.copy()
        comm.Iallreduce(MPI.IN_PLACE, inplace, op=MPI.BXOR).Wait()
        bar = comm.Ibarrier()
        while not bar.Test():
            work += 1
        lines.append(f"rank {rank} step {step}: {total.tolist()} "
                     f"{top.tolist() if rank == 0 else None} {b.tolist()} {inplace.tolist()} "
                     f"worked {work >= 0}")
    every = comm.gather(lines, root=0)
    if rank == 0:
        for part in every:
            print("\n".join(part))


if __name__ == "__main__":
    main()
