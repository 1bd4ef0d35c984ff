"""``raps-coordinator``: leader election, job registry, rank maps (see ``main``)."""

from __future__ import annotations

from raps_slurm.coordinator.main import main

__all__ = ["main"]
