"""Compute pi in the usual mpi4py style: rank 0 broadcasts the number of intervals, each
rank integrates 4/(1+x^2) over its share of the midpoints, and ``reduce`` adds the
partial sums at rank 0, which prints pi. The order in which MPI adds the partial sums is
the library's choice: two MPI libraries agree to rounding, not bit for bit, so the line
says ``rounded``. The program then fixes the order itself (it gathers the partial sums
and adds them exactly, ``math.fsum``): that line, ``exact``, is the same bits under any
MPI library.

    mpirun -n 4 python examples/mpi_pi.py
    python -m raps_slurm.runtime.local -n 4 --mpi4py -- python examples/mpi_pi.py
"""

from __future__ import annotations

import argparse
import math

from mpi4py import MPI


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--intervals", type=int, default=200_000)
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = comm.bcast(a.intervals if rank == 0 else None, root=0)
    h = 1.0 / n
    part = 0.0
    for i in range(rank, n, size):
        x = h * (i + 0.5)
        part += 4.0 / (1.0 + x * x)
    part *= h
    pi = comm.reduce(part, op=MPI.SUM, root=0)
    parts = comm.gather(part, root=0)
    if rank == 0:
        assert pi is not None and parts is not None
        exact = math.fsum(parts)
        print("rounded pi", repr(pi), flush=True)
        print("exact pi", repr(exact), "error below 1e-9:", abs(exact - math.pi) < 1e-9,
              flush=True)


if __name__ == "__main__":
    main()
