"""What the programs of examples/mpi4py share: the crash knob and the printing.

Each program runs the same under Open MPI and under RAPS, e.g. for ``vector.py``::

    mpirun -n 3 python examples/mpi4py/vector.py
    python -m raps_slurm.runtime.local -n 3 --mpi4py -- python examples/mpi4py/vector.py

``--die RANK:STEP`` makes RANK exit (code 17) at STEP in its first epoch (``RAPS_EPOCH``
1): with ``--restarts 1`` the local launcher relaunches it and it re-executes from the
start while its peers replay what they had sent it. Rank 0 prints every rank's lines,
in rank order, so that the output does not depend on timing.
"""

import argparse
import os


def crash_knob():
    """A function ``maybe_die(rank, step)`` that exits where ``--die RANK:STEP`` says."""
    p = argparse.ArgumentParser()
    p.add_argument("--die", default=None, help="RANK:STEP")
    die_rank, die_at = (int(x) for x in (p.parse_args().die or "-1:-1").split(":"))
    first = os.environ.get("RAPS_EPOCH", "1") == "1"

    def maybe_die(rank, step):
        if rank == die_rank and step == die_at and first:
            os._exit(17)
    return maybe_die


def print_all(comm, lines):
    """Every rank's ``lines``, printed by rank 0 in rank order."""
    every = comm.gather(lines, root=0)
    if comm.Get_rank() == 0:
        for part in every:
            print("\n".join(part))
