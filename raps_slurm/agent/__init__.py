"""``raps-agent``: the per-node agent (see ``main``)."""

from __future__ import annotations

from raps_slurm.agent.main import main

__all__ = ["main"]
