"""atheris, coverage-guided, on the fuzz targets of ``raps_slurm.testing.fuzz_targets``::

    python -m raps_slurm.testing.fuzz TARGET [libFuzzer options, e.g. -max_total_time=600]
    python -m raps_slurm.testing.fuzz --list

Only raps_slurm's own modules are instrumented (imported inside the instrumenting block):
instrumenting everything loaded costs the better part of a minute per start.
Crashes atheris finds are kept as files under ``tests/fuzz/regressions/TARGET/``, which
``tests/unit/test_atheris.py`` replays on every run.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path


def main(argv: list[str]) -> int:
    """``TARGET [libFuzzer options]``: fuzz one target with atheris; ``--list``: names."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    import atheris  # the targets themselves run without it

    with atheris.instrument_imports(include=["raps_slurm"]):
        from raps_slurm.testing.fuzz_targets import TARGETS
    if argv[0] == "--list":
        print("\n".join(TARGETS))
        return 0
    target = TARGETS.get(argv[0])
    if target is None:
        print(f"fuzz: unknown target {argv[0]!r}; expected one of {', '.join(TARGETS)}",
              file=sys.stderr)
        return 2
    seed = Path(tempfile.gettempdir()) / "raps-fuzz-seeds" / argv[0]
    seed.parent.mkdir(exist_ok=True)
    seed.write_bytes(target.seed)  # overwritten each run: nothing piles up
    atheris.Setup([sys.argv[0], f"-seed_inputs={seed}", *argv[1:]], target.run)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
