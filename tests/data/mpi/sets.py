"""Rank 1 sends rank 0 a ``set`` of strings with ``send`` (pickled in the set's iteration
order, which follows the strings' hashes) and waits for rank 0's answer. ``--die STEP`` makes rank 1 exit (code 17) at
STEP in its first epoch: the relaunched rank re-sends the same sets, byte for byte, only if
its strings hash as before. Rank 0 prints one line per step.

    python -m raps_slurm.runtime.local -n 2 --restarts 1 --mpi4py -- python tests/data/mpi/sets.py --die 3
"""

from __future__ import annotations

import argparse
import os

from mpi4py import MPI


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--die", type=int, default=-1, help="STEP")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    words = {f"word{i}" for i in range(32)}
    for step in range(6):
        if rank == 1 and step == a.die and os.environ.get("RAPS_EPOCH", "1") == "1":
            os._exit(17)
        if rank == 1:
            comm.send(words | {f"step{step}"}, dest=0, tag=step)
            comm.recv(source=0, tag=step)  # delivered: a re-sent copy is compared with it
        elif rank == 0:
            got = comm.recv(source=1, tag=step)
            comm.send(len(got), dest=1, tag=step)
            print(step, len(got), sorted(got)[0], flush=True)


if __name__ == "__main__":
    main()
