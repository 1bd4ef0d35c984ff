"""atheris, coverage-guided, on every fuzz target (``raps_slurm.testing.fuzz``) for a bounded
time in CI (``RAPS_FUZZ_SECONDS``, default 2 s each; longer on demand), and every input
that once crashed a parser (``tests/fuzz/regressions/TARGET/``) replayed."""

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


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_atheris_finds_no_crash(name: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "raps_slurm.testing.fuzz", name, f"-max_total_time={SECONDS}",
         "-timeout=10", "-rss_limit_mb=2048", f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=SECONDS + 120, cwd=tmp_path, check=False)
    crashes = [p.name for p in tmp_path.iterdir()]
    assert proc.returncode == 0 and not crashes, (crashes, proc.stderr[-4000:])
    done = re.search(r"Done (\d+) runs", proc.stderr)
    assert done is not None and int(done.group(1)) > 0, proc.stderr[-2000:]


CASES = sorted(p for p in REGRESSIONS.glob("*/*") if p.is_file())


def test_every_regression_names_a_target() -> None:
    assert CASES, f"no saved inputs under {REGRESSIONS}"
    assert {p.parent.name for p in CASES} <= set(TARGETS)


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.name}" for p in CASES])
def test_saved_crash_inputs_stay_fixed(path: Path) -> None:
    TARGETS[path.parent.name].run(path.read_bytes())
