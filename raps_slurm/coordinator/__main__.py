"""``python -m raps_slurm.coordinator``: same as ``raps-coordinator``."""

from raps_slurm.coordinator.main import main

if __name__ == "__main__":  # a spawned receiver process imports this module too
    main()
