"""Timing-dependent decisions in the usual mpi4py style: each round, rank 0 waits with
``Iprobe(ANY_SOURCE)`` for the first worker's message, posts an ``irecv`` per worker and
takes the answers in whatever order they come (``Request.waitany`` on even rounds,
``Request.testany`` polling on odd ones), and tells each worker its place in that order
(and +100 to the one it probed first). Each worker keeps what it is told, rank 0 the
orders it saw. The places differ from run to run, their total does not: rank 0 prints
it, and whether what the workers were told agrees with the orders it kept. Under RAPS a
rank 0 that is relaunched must take the same decisions again, or its orders would
disagree with what its peers were told before it failed. ``--die RANK:ROUND`` makes
RANK exit at that round in its first epoch.

    mpirun -n 4 python examples/mpi_waitany.py
    python -m raps_slurm.runtime.local -n 4 --restarts 1 --mpi4py -- \\
        python examples/mpi_waitany.py --die 0:5
"""

from __future__ import annotations

import argparse
import os
import time

from mpi4py import MPI

try:  # the checkpoint API (absent under plain mpi4py)
    from raps_slurm import mpi as raps
except ImportError:
    raps = None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--die", default=None, help="RANK:ROUND")
    a = p.parse_args()
    die_rank, die_at = (int(x) for x in a.die.split(":")) if a.die else (-1, -1)
    first_epoch = os.environ.get("RAPS_EPOCH", "1") == "1"
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    workers = list(range(1, size))
    st = (raps.restore() if raps else None) or {"round": 0, "told": [], "orders": []}
    while st["round"] < a.rounds:
        rnd = st["round"]
        if rank == die_rank and rnd == die_at and first_epoch:
            os._exit(17)
        if rank == 0:
            status = MPI.Status()
            while not comm.Iprobe(source=MPI.ANY_SOURCE, tag=rnd, status=status):
                time.sleep(0.0005)
            first = status.Get_source()
            reqs = [comm.irecv(source=w, tag=rnd) for w in workers]
            order = []
            while len(order) < len(workers):
                if rnd % 2 == 0:
                    idx, _ = MPI.Request.waitany(reqs)
                else:
                    idx, flag, _ = MPI.Request.testany(reqs)
                    if not flag:
                        time.sleep(0.0005)
                        continue
                order.append(idx)
            for place, idx in enumerate(order):
                bonus = 100 if workers[idx] == first else 0
                comm.send(place + bonus, dest=workers[idx], tag=rnd)
            st["orders"].append((first, [workers[i] for i in order]))
        else:
            time.sleep(0.001 * ((rank * 7 + rnd * 3) % 4))  # vary who comes first
            comm.send(rank * 1000 + rnd, dest=0, tag=rnd)
            st["told"].append(comm.recv(source=0, tag=rnd))
        st["round"] = rnd + 1
        if raps and st["round"] % a.every == 0:
            raps.checkpoint(st)
    total = comm.reduce(sum(st["told"]), op=MPI.SUM, root=0)
    told = comm.gather(st["told"], root=0)
    if rank == 0:
        assert told is not None
        agree = all(told[w][rnd] == order.index(w) + (100 if w == first else 0)
                    for rnd, (first, order) in enumerate(st["orders"]) for w in workers)
        print("rounds", a.rounds, "total", total, "agree", agree, flush=True)


if __name__ == "__main__":
    main()
