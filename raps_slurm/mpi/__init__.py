"""mpi4py-compatible MPI on the RAPS logged runtime (docs/mpi.md).

A program written for mpi4py runs unchanged with ``--mpi4py`` (``raps-run`` or the
local launcher): ``from mpi4py import MPI`` resolves to :mod:`raps_slurm.mpi.MPI`.
To survive failures without starting over, it adds two calls::

    from raps_slurm import mpi as raps
    state = raps.restore() or initial_state()     # before its first communication
    ...
    if raps.checkpoint_due():
        raps.checkpoint(state)                     # any picklable object

Modules: :mod:`.engine` (envelopes, matching, determinants), :mod:`.comm`
(communicators, point-to-point), :mod:`.requests` (statuses, requests), :mod:`.groups`,
:mod:`.tree` (the collectives' trees and schedules), :mod:`.collective` (broadcasts,
reductions, communicator creation), :mod:`.blocks` (gathers, scatters, vector and prefix
collectives), :mod:`.nonblocking`, :mod:`.types` (datatypes, operations),
:mod:`.buffers` (buffer specifications), :mod:`.support` (what is supported),
:mod:`.world` (start-up, checkpoint, restore), :mod:`.MPI` (the namespace).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")

__all__ = ["SHIM_DIR", "checkpoint", "checkpoint_due", "restore", "shim_env"]


def shim_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` in which ``import mpi4py`` finds :mod:`raps_slurm.mpi` first
    (``--mpi4py``): the shim directory is put in front of ``PYTHONPATH``."""
    out = dict(env)
    old = out.get("PYTHONPATH", "")
    parts = [p for p in old.split(os.pathsep) if p and p != SHIM_DIR]
    out["PYTHONPATH"] = os.pathsep.join([SHIM_DIR, *parts])
    return out


def restore() -> Any:
    """The state this rank's last checkpoint saved, or None when it starts afresh. A
    restored rank calls it before communicating (communicator creation may come first)."""
    from raps_slurm.mpi.world import world

    return world().restore()


def checkpoint(state: Any) -> int:
    """Save ``state`` (any picklable object) and this rank's message state; returns the
    generation. No receive may be pending (complete requests first)."""
    from raps_slurm.mpi.world import world

    return world().checkpoint(state)


def checkpoint_due() -> bool:
    """Whether a checkpoint is due (``checkpoint.interval_sec`` / ``--raps-ckpt-interval``
    passed, or the job is about to be preempted)."""
    from raps_slurm.mpi.world import world

    return world().ctx.checkpoint_due()
