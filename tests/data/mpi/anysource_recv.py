"""Large messages received with ``ANY_SOURCE`` into one buffer: under RAPS the first
source whose large message begins to come while rank 0 waits has it read straight into
the receive's buffer (the receive is claimed for that source; the match is recorded as
any ``ANY_SOURCE`` match). Each round, ranks 1 and 2 send rank 0 a message of the same
tag once it says go: 1 MiB from both in even rounds; 1 MiB from rank 1 and 8 doubles from
rank 2 in odd ones (the small one, whole first, goes to the next receive). Rank 0 prints
what it received, sorted by source, once all rounds are done. ``--die R:ROUND`` makes
rank R exit (code 17) at that round of its first epoch: relaunched, it runs again from
the start, replayed (rank 0's receives then match the sources its lost run recorded).

    mpirun -n 3 python tests/data/mpi/anysource_recv.py
    python -m raps_slurm.runtime.local -n 3 --mpi4py -- python tests/data/mpi/anysource_recv.py

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
SMALL = 8
ROUNDS = 6


def data(k: int, src: int, n: int = N) -> np.ndarray:
    return np.arange(n, dtype="d") * (k + 1) + src


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--die", default="-1:-1", help="RANK:ROUND")
    who, when = (int(x) for x in p.parse_args().die.split(":"))
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    lines = []
    for k in range(ROUNDS):
        if rank == who and k == when and os.environ.get("RAPS_EPOCH", "1") == "1":
            os._exit(17)
        if rank == 0:
            buf = np.zeros(N)
            for dst in (1, 2):
                comm.send("go", dest=dst, tag=50 + k)
            got = []
            for _ in range(2):
                st = MPI.Status()
                comm.Recv(buf, source=MPI.ANY_SOURCE, tag=k, status=st)
                src, n = st.Get_source(), st.Get_count(MPI.DOUBLE)
                ok = zlib.crc32(buf[:n].tobytes()) == zlib.crc32(data(k, src, n).tobytes())
                got.append((src, n, ok))
            lines.append(f"round {k} {sorted(got)}")
        else:
            comm.recv(source=0, tag=50 + k)
            time.sleep(0.02)  # rank 0 waits in its receive by now
            small = rank == 2 and k % 2 == 1
            comm.Send(data(k, rank, SMALL if small else N), dest=0, tag=k)
    if lines:
        print("\n".join(lines), flush=True)
    if rank == 0 and MPI.__name__.startswith("raps_slurm"):
        from raps_slurm.mpi.world import world

        placed = world().ctx.stats()["messages_read_in_place"]
        print(f"read in place: {placed}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
