"""``raps-run`` and the node supervisors it starts.

``run``         raps-run itself: rank map, one step for the job, plans followed
``control``     its control server and the Popen-like handle of each started rank
``channel``     the authenticated control channel (over ``raps_slurm.wire.framing``)
``supervisor``  the one task per node that starts, pins, watches and signals its ranks
``output``      the ranks' output passed on in whole lines (supervisors, local launcher)

Nothing is imported here: a supervisor (``python -m raps_slurm.launcher.supervisor``)
loads only the standard library, the channel, the framing and ``output``.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``raps-run`` (see :mod:`raps_slurm.launcher.run`)."""
    from raps_slurm.launcher.run import main as run_main

    run_main(argv)
