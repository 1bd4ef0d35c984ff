"""Benchmarks: the measuring code behind ``rapsctl bench``, one module per benchmark.

Each module's entry function takes plain values and returns the result as a dict (the
JSON object the command prints); ``raps_slurm.cli.bench`` parses the options and prints.
Nothing here imports ``raps_slurm.cli``. Bad input a user can give ends as a
``ValueError`` (sizes) or a :class:`raps_slurm.errors.RapsError` (a failed measurement).
"""
