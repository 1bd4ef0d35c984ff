"""Master and workers in the usual mpi4py style: rank 0 hands out ``--tasks`` tasks, one
at a time, to whichever worker answers first (``recv(source=ANY_SOURCE)``), until all
are done. The result does not depend on which worker did what. Under RAPS it
checkpoints every ``--every`` results (two added lines: ``restore`` and
``checkpoint``), and ``--die RANK:COUNT`` makes RANK exit after COUNT results in its
first epoch (to watch it relaunched: ``--restarts 1``).

    mpirun -n 4 python examples/mpi_master_worker.py
    python -m raps_slurm.runtime.local -n 4 --restarts 1 --mpi4py -- \\
        python examples/mpi_master_worker.py --die 0:7
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from typing import Any

from mpi4py import MPI

try:  # the checkpoint API (absent under plain mpi4py: the program runs without it)
    from raps_slurm import mpi as raps
except ImportError:
    raps = None

WORK, STOP = 1, 2


def work(task: int) -> int:
    h = hashlib.sha256(str(task).encode()).digest()
    return int.from_bytes(h[:4], "big") % 1000


def hand_out(comm: MPI.Comm, st: dict[str, Any], worker: int, tasks: int) -> None:
    """The next task to ``worker``, or STOP when none is left."""
    if st["next"] < tasks:
        comm.send(st["next"], dest=worker, tag=WORK)
        st["next"] += 1
    else:
        comm.send(None, dest=worker, tag=STOP)
        st["stopped"] += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--die", default=None, help="RANK:COUNT")
    p.add_argument("--work-sec", type=float, default=0.0)
    a = p.parse_args()
    die_rank, die_at = (int(x) for x in a.die.split(":")) if a.die else (-1, -1)
    first_epoch = os.environ.get("RAPS_EPOCH", "1") == "1"
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    state = raps.restore() if raps else None
    if rank == 0:
        st = state or {"next": 0, "results": {}, "stopped": 0}
        if state is None:
            for w in range(1, size):
                hand_out(comm, st, w, a.tasks)
        status = MPI.Status()
        while st["stopped"] < size - 1:
            task, value = comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            st["results"][task] = value
            hand_out(comm, st, status.Get_source(), a.tasks)
            done = len(st["results"])
            if raps and done % a.every == 0:
                raps.checkpoint(st)
            if rank == die_rank and done == die_at and first_epoch:
                os._exit(17)
        total = sum(st["results"].values())
        print("tasks", len(st["results"]), "sum", total, "digest",
              hashlib.sha256(repr(sorted(st["results"].items())).encode()).hexdigest()[:16],
              flush=True)
    else:
        st = state or {"done": 0}
        status = MPI.Status()
        while True:
            task = comm.recv(source=0, tag=MPI.ANY_TAG, status=status)
            if status.Get_tag() == STOP:
                break
            if a.work_sec:
                time.sleep(a.work_sec)
            comm.send((task, work(task)), dest=0, tag=WORK)
            st["done"] += 1
            if raps and st["done"] % a.every == 0:
                raps.checkpoint(st)
            if rank == die_rank and st["done"] == die_at and first_epoch:
                os._exit(17)


if __name__ == "__main__":
    main()
