"""Entry points whose daemons have not landed yet: they say so and exit 2."""

from __future__ import annotations

import sys


def not_yet(name: str) -> int:
    """Print the one-line notice and return the exit code."""
    print(f"{name}: not yet available in raps-slurm 0.1 (see README: Status)", file=sys.stderr)
    return 2
