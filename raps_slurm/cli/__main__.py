"""``python -m raps_slurm.cli`` runs rapsctl."""

from raps_slurm.cli import main

main()
