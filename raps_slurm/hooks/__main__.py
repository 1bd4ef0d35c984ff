"""``python -m raps_slurm.hooks HOOK [--config FILE]``: the entry point the wrappers exec.

A job without ``--raps`` costs one environment lookup: nothing else is imported,
no file is read and etcd is never contacted.
"""

from __future__ import annotations

import os
import sys

HOOKS = ("prolog-slurmctld", "epilog-slurmctld", "prolog", "epilog")
USAGE = ("usage: python -m raps_slurm.hooks {prolog-slurmctld|epilog-slurmctld|prolog|epilog}"
         " [--config FILE]")


def _args(argv: list[str]) -> tuple[str, str | None] | None:
    if not argv or argv[0] not in HOOKS:
        return None
    if len(argv) == 1:
        return argv[0], None
    if len(argv) == 3 and argv[1] == "--config" and argv[2]:
        return argv[0], argv[2]
    return None


def main(argv: list[str]) -> int:
    """Run one hook; exit status as Slurm should see it."""
    args = _args(argv)
    if args is None:
        print(f"raps-hook: {USAGE}", file=sys.stderr)
        return 2
    if os.environ.get("SPANK_RAPS_ENABLED") != "1":
        return 0  # not a RAPS job: untouched
    from raps_slurm.hooks.run import run_hook  # the costly imports, for RAPS jobs only

    return run_hook(args[0], args[1], dict(os.environ))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
