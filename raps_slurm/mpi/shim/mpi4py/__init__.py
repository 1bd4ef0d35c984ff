"""Stand-in for mpi4py under RAPS: ``from mpi4py import MPI`` is :mod:`raps_slurm.mpi.MPI`
(installed on ``PYTHONPATH`` by ``--mpi4py``; docs/mpi.md)."""

import sys
from types import SimpleNamespace

from raps_slurm.mpi import MPI

sys.modules[__name__ + ".MPI"] = MPI
__version__ = "3.1.4+raps"
# mpi4py's run-time options: accepted and ignored (the world starts on first use).
rc = SimpleNamespace(initialize=True, finalize=True, threads=True, thread_level="multiple")

__all__ = ["MPI", "rc"]
