"""``python -m raps_slurm.coordinator``: same as ``raps-coordinator``."""

from raps_slurm.coordinator.main import main

main()
