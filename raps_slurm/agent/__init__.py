"""`raps-agent`: placeholder until its issue lands."""

from __future__ import annotations

import sys

from raps_slurm._placeholder import not_yet


def main() -> None:
    """Entry point of `raps-agent`."""
    sys.exit(not_yet("raps-agent"))
