"""``python -m raps_slurm.agent``: same as ``raps-agent``."""

from raps_slurm.agent.main import main

main()
