"""atheris, coverage-guided, on the fuzz targets of ``raps_slurm.testing.fuzz_targets``::

    python -m raps_slurm.testing.fuzz TARGET [libFuzzer options, e.g. -max_total_time=600]
    python -m raps_slurm.testing.fuzz --each DIR [--parallel N] [libFuzzer options]
    python -m raps_slurm.testing.fuzz --list

Only raps_slurm's own modules are instrumented (imported inside the instrumenting block):
instrumenting everything loaded costs the better part of a minute per start.
``--each`` instruments once and fuzzes every target in a child forked from that process,
``N`` at a time (default 1): per target, its libFuzzer output in ``DIR/TARGET.log``, its
crash files under ``DIR/TARGET/`` and its exit status in ``DIR/TARGET.rc``; it exits 1
if any target's fuzzer failed.
Crashes atheris finds are kept as files under ``tests/fuzz/regressions/TARGET/``, which
``tests/unit/test_atheris.py`` replays on every run.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _fuzz(name: str, run: Callable[[bytes], None], seed_bytes: bytes,
          options: list[str]) -> None:
    """Fuzz one target in this process; libFuzzer exits the process when it ends."""
    import atheris

    seed = Path(tempfile.gettempdir()) / "raps-fuzz-seeds" / name
    seed.parent.mkdir(exist_ok=True)
    seed.write_bytes(seed_bytes)  # overwritten each run: nothing piles up
    atheris.Setup([sys.argv[0], f"-seed_inputs={seed}", *options], run)
    atheris.Fuzz()


def _each(targets: dict[str, Any], argv: list[str]) -> int:
    """``--each DIR [--parallel N] [options]``: every target in a forked child."""
    if len(argv) < 2:
        print("fuzz: --each needs a directory", file=sys.stderr)
        return 2
    out, rest = Path(argv[1]), argv[2:]
    parallel = 1
    if rest[:1] == ["--parallel"]:
        if len(rest) < 2 or not rest[1].isdigit() or int(rest[1]) < 1:
            print("fuzz: --parallel takes a whole number of 1 or more", file=sys.stderr)
            return 2
        parallel, rest = int(rest[1]), rest[2:]
    out.mkdir(parents=True, exist_ok=True)
    running: dict[int, str] = {}
    failed = False

    def reap() -> None:
        nonlocal failed
        pid, status = os.wait()
        name = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        failed = failed or code != 0
        (out / f"{name}.rc").write_text(f"{code}\n")

    for name, target in targets.items():
        while len(running) >= parallel:
            reap()
        (out / name).mkdir(exist_ok=True)
        log = os.open(out / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pid = os.fork()
        if pid == 0:  # the child: the instrumented modules are already loaded
            try:
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.chdir(out / name)
                _fuzz(name, target.run, target.seed,
                      [*rest, f"-artifact_prefix={out / name}/"])
            except SystemExit:
                raise  # a found crash: libFuzzer's exit handler writes its file as we end
            except BaseException:
                traceback.print_exc()
                os._exit(70)
            os._exit(0)  # libFuzzer ends the process itself; never back into the loop
        os.close(log)
        running[pid] = name
    while running:
        reap()
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    """``TARGET [libFuzzer options]``: fuzz one target with atheris; ``--each DIR``: every
    target, instrumented once; ``--list``: names."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    import atheris  # the targets themselves run without it

    with atheris.instrument_imports(include=["raps_slurm"]):
        from raps_slurm.testing.fuzz_targets import TARGETS
    if argv[0] == "--list":
        print("\n".join(TARGETS))
        return 0
    if argv[0] == "--each":
        return _each(TARGETS, argv)
    target = TARGETS.get(argv[0])
    if target is None:
        print(f"fuzz: unknown target {argv[0]!r}; expected one of {', '.join(TARGETS)}",
              file=sys.stderr)
        return 2
    _fuzz(argv[0], target.run, target.seed, argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
