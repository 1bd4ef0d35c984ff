"""raps-slurm: resilience for long parallel jobs on Slurm clusters."""

__version__ = "0.1.0"
