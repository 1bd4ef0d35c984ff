"""Large messages from two sources completed by one ``Waitall``, the second source's
arriving while the first's is still awaited: under RAPS both are read straight into their
receives' buffers (the wait takes messages as they come, not in the list's order). Rank 0
prints what it received. ``--die 1:ROUND`` makes rank 1 exit (code 17) at that round of
its first epoch: relaunched, it sends its messages again.

    mpirun -n 3 python tests/data/mpi/waitall_recv.py
    python -m raps_slurm.runtime.local -n 3 --mpi4py -- python tests/data/mpi/waitall_recv.py

Under RAPS, rank 0 also says on stderr how many messages it read in place."""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

N = 1 << 17  # doubles: 1 MiB
ROUNDS = 6


def data(k: int, src: int) -> np.ndarray:
    return np.arange(N, dtype="d") * (k + 1) + src


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--die", default="1:-1", help="1:ROUND (rank 1 only)")
    die = int(p.parse_args().die.removeprefix("1:"))
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    for k in range(ROUNDS):
        if rank == 0:
            first, second = np.zeros(N), np.zeros(N)
            reqs = [comm.Irecv(first, source=1, tag=k), comm.Irecv(second, source=2, tag=k)]
            comm.send("go", dest=2, tag=50 + k)  # rank 2 sends first, then tells rank 1
            statuses = [MPI.Status(), MPI.Status()]
            MPI.Request.Waitall(reqs, statuses)
            ok = [zlib.crc32(got.tobytes()) == zlib.crc32(data(k, src).tobytes())
                  for got, src in ((first, 1), (second, 2))]
            print("round", k, ok, [(s.Get_source(), s.Get_count(MPI.DOUBLE)) for s in statuses],
                  flush=True)
        elif rank == 2:
            comm.recv(source=0, tag=50 + k)
            time.sleep(0.02)  # rank 0 is in its Waitall by now
            comm.Send(data(k, 2), dest=0, tag=k)
            comm.send("after", dest=1, tag=60 + k)
        else:
            if k == die and os.environ.get("RAPS_EPOCH", "1") == "1":
                os._exit(17)
            comm.recv(source=2, tag=60 + k)
            comm.Send(data(k, 1), dest=0, tag=k)
    if rank == 0 and MPI.__name__.startswith("raps_slurm"):
        from raps_slurm.mpi.world import world

        placed = world().ctx.stats()["messages_read_in_place"]
        print(f"read in place: {placed}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
