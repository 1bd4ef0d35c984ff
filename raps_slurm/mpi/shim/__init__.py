"""A directory put first on ``PYTHONPATH`` by ``--mpi4py``: its ``mpi4py`` package is
:mod:`raps_slurm.mpi` (see :func:`raps_slurm.mpi.shim_env`)."""
