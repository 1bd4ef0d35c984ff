"""Stand-in for mpi4py under RAPS: ``from mpi4py import MPI`` is :mod:`raps_slurm.mpi.MPI`
(installed on ``PYTHONPATH`` by ``--mpi4py``; docs/mpi.md)."""

import sys
from types import SimpleNamespace

from raps_slurm.mpi import MPI

sys.modules[__name__ + ".MPI"] = MPI
__version__ = "3.1.4+raps"


class _Rc(SimpleNamespace):
    """mpi4py's run-time options, set as attributes or by calling ``rc(**options)``:
    accepted and ignored (the world starts on first use, or at ``MPI.Init``)."""

    def __call__(self, **kwargs: object) -> None:
        for k, v in kwargs.items():
            if not hasattr(self, k):
                raise TypeError(f"unexpected argument {k!r}")
            setattr(self, k, v)


rc = _Rc(initialize=True, finalize=None, threads=True, thread_level="multiple",
         recv_mprobe=True, errors="exception")

__all__ = ["MPI", "rc"]
