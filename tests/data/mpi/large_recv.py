"""Large messages received into numpy buffers, as a RAPS rank reads them straight into the
waiting receive's buffer: a ping-pong of 1 MiB (Recv, and Irecv then Wait), a message
into a larger buffer, and two receives that both match one message (the first posted
takes it). Rank 0 prints what rank 1 saw. ``--die 1:STEP`` makes rank 1 exit (code 17)
at ping STEP of its first epoch: relaunched, it receives the pings again, replayed.

    mpirun -n 2 python tests/data/mpi/large_recv.py
    python -m raps_slurm.runtime.local -n 2 --mpi4py -- python tests/data/mpi/large_recv.py

Under RAPS, rank 1 also says on stderr how many messages it read in place."""

from __future__ import annotations

import argparse
import os
import sys
import zlib

import numpy as np
from mpi4py import MPI

N = 1 << 17  # doubles: 1 MiB
PINGS = 8


def data(k: int, n: int = N) -> np.ndarray:
    return np.arange(n, dtype="d") * (k + 1)


def crc(a: np.ndarray) -> int:
    return zlib.crc32(a.tobytes())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--die", default="1:-1", help="1:STEP (rank 1 only: rank 0 prints)")
    a = p.parse_args()
    die = int(a.die.removeprefix("1:"))
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if rank == 0:
        back = np.empty(N, "d")
        for k in range(PINGS):
            comm.Send(data(k), dest=1, tag=k)
            comm.Recv(back, source=1, tag=100 + k)
            print("pong", k, crc(back) == crc(data(k) * 2), flush=True)
        comm.Send(data(20, N // 2), dest=1, tag=20)  # into a larger buffer
        comm.Send(data(21), dest=1, tag=21)          # the receive posted first takes it
        comm.Send(data(22), dest=1, tag=21)          # then the other one
        print(comm.recv(source=1, tag=99), flush=True)
    elif rank == 1:
        buf = np.empty(N, "d")
        for k in range(PINGS):
            if k == die and os.environ.get("RAPS_EPOCH", "1") == "1":
                os._exit(17)
            st = MPI.Status()
            if k % 2:
                comm.Irecv(buf, source=0, tag=k).Wait(st)
            else:
                comm.Recv(buf, source=0, tag=k, status=st)
            if st.Get_count(MPI.DOUBLE) != N or crc(buf) != crc(data(k)):
                raise SystemExit(f"ping {k}: {st.Get_count(MPI.DOUBLE)} doubles, wrong bytes")
            comm.Send(buf * 2, dest=0, tag=100 + k)
        big = np.full(N, -1.0)
        st = MPI.Status()
        comm.Recv(big, source=0, tag=20, status=st)
        larger = (st.Get_count(MPI.DOUBLE), crc(big[:N // 2]) == crc(data(20, N // 2)),
                  bool((big[N // 2:] == -1.0).all()))
        first, second = np.zeros(N), np.zeros(N)
        req = comm.Irecv(first, source=0, tag=MPI.ANY_TAG)
        comm.Recv(second, source=0, tag=21)
        req.Wait()
        order = (crc(first) == crc(data(21)), crc(second) == crc(data(22)))
        comm.send(f"larger {larger} order {order}", dest=0, tag=99)
        if MPI.__name__.startswith("raps_slurm"):
            from raps_slurm.mpi.world import world

            placed = world().ctx.stats()["messages_read_in_place"]
            print(f"read in place: {placed}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
