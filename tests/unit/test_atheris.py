"""atheris, coverage-guided, on every fuzz target (``raps_slurm.testing.fuzz``) for a bounded
time in CI (``RAPS_FUZZ_SECONDS``, default 2 s each; longer on demand), and every input
that once crashed a parser (``tests/fuzz/regressions/TARGET/``) replayed.

The targets are fuzzed by one ``--each`` process, which instruments once (seconds) and
forks a fuzzer per target, as many at a time as this process may use cores; each test
below judges its own target's run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raps_slurm.testing.fuzz_targets import TARGETS

SECONDS = int(os.environ.get("RAPS_FUZZ_SECONDS", "2"))
REGRESSIONS = Path(__file__).resolve().parents[1] / "fuzz" / "regressions"


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every target fuzzed for SECONDS; the directory of their logs, statuses, crashes."""
    out = tmp_path_factory.mktemp("atheris")
    parallel = len(os.sched_getaffinity(0))
    proc = subprocess.run(
        [sys.executable, "-m", "raps_slurm.testing.fuzz", "--each", str(out), "--parallel",
         str(parallel), f"-max_total_time={SECONDS}", "-timeout=10", "-rss_limit_mb=2048"],
        capture_output=True, text=True, cwd=out,
        timeout=(SECONDS + 20) * len(TARGETS) + 120, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]  # 1: a target failed, judged below
    return out


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_atheris_finds_no_crash(name: str, fuzzed: Path) -> None:
    log = (fuzzed / f"{name}.log").read_text(errors="replace")
    crashes = [p.name for p in (fuzzed / name).iterdir()]
    assert (fuzzed / f"{name}.rc").read_text().strip() == "0" and not crashes, \
        (crashes, log[-4000:])
    done = re.search(r"Done (\d+) runs", log)
    assert done is not None and int(done.group(1)) > 0, log[-2000:]


CASES = sorted(p for p in REGRESSIONS.glob("*/*") if p.is_file())


def test_every_regression_names_a_target() -> None:
    assert CASES, f"no saved inputs under {REGRESSIONS}"
    assert {p.parent.name for p in CASES} <= set(TARGETS)


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.name}" for p in CASES])
def test_saved_crash_inputs_stay_fixed(path: Path) -> None:
    TARGETS[path.parent.name].run(path.read_bytes())
