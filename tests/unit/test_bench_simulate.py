"""``rapsctl bench simulate --sizes``: every size timed, per strategy, smallest first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from raps_slurm.bench.simulate import run_simulate

ROOT = Path(__file__).resolve().parents[2]


def test_sizes_are_timed_per_strategy_smallest_first() -> None:
    out = run_simulate(200, 0.2, 4_380.0, 1, sizes=[300, 100])
    assert [x["nodes"] for x in out["sizes"]] == [100, 200, 300]
    assert out["nodes"] == 200 and out["sizes"][1]["wall_s"] == out["wall_s"]
    for size in out["sizes"]:
        assert set(size["strategies"]) == {"raps", "global", "scr", "step"}
        per = size["strategies"].values()
        assert size["events"] == sum(v["events"] for v in per) > 0
        assert size["wall_s"] >= sum(v["wall_s"] for v in per) - 0.01


def test_a_bad_size_is_refused_in_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "raps_slurm.cli", "bench", "simulate",
                        "--nodes", "200", "--sizes", "1000,ten"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120, check=False)
    assert r.returncode != 0 and r.stdout == ""
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--sizes" in lines[0] and "'ten'" in lines[0], r.stderr
