"""A ring in the usual mpi4py style: a token goes round ``--laps`` times with the lap as
its tag (each rank adds its rank); then every rank swaps a numpy block with its
neighbours through ``Sendrecv`` and ``[buf, MPI.DOUBLE]``. Rank 0 prints the results.

    mpirun -n 4 python examples/mpi_ring.py
    python -m raps_slurm.runtime.local -n 4 --mpi4py -- python examples/mpi_ring.py
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--laps", type=int, default=5)
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    token = 0
    for lap in range(a.laps):
        if rank == 0:
            comm.send(token, dest=right, tag=lap)
            token = comm.recv(source=left, tag=lap)
        else:
            token = comm.recv(source=left, tag=lap)
            comm.send(token + rank, dest=right, tag=lap)
    # Tags out of order: two messages to the right, received in the other order.
    comm.send(f"second from {rank}", dest=right, tag=200)
    comm.send(f"first from {rank}", dest=right, tag=100)
    st = MPI.Status()
    first = comm.recv(source=left, tag=100, status=st)
    second = comm.recv(source=left, tag=200)
    block = np.arange(4, dtype=np.float64) + 10 * rank
    got = np.empty(4, dtype=np.float64)
    comm.Sendrecv([block, MPI.DOUBLE], dest=right, sendtag=7,
                  recvbuf=[got, MPI.DOUBLE], source=left, recvtag=7)
    ints = np.full(3, rank, dtype=np.int32)
    back = np.empty(3, dtype=np.int32)
    req = comm.Irecv([back, MPI.INT], source=right, tag=8)
    comm.Isend([ints, MPI.INT], dest=left, tag=8).Wait()
    req.Wait()
    rows = comm.gather((rank, first, second, st.Get_tag(), got.tolist(), back.tolist()), root=0)
    if rank == 0:
        print("token", token)
        for row in rows or []:
            print("rank", *row)


if __name__ == "__main__":
    main()
