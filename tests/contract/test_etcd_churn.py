"""etcd stays under its quota with the leader's compaction, and fills up without it
(``rapsctl bench churn`` against a throw-away etcd, as a user runs it).

Both runs simulate the same churn: 16 nodes, 16-node jobs of 4 h arriving 48 a day, so
that 8 jobs run at once from the fourth hour on, the steady state of the benchmark's
default 8 h jobs at 24 a day, reached in half the simulated time (each job's start and
purge, twice as often, is churn too). A quarter day holds two hours of it: without
compaction the quota is full before then, with it the database stays where the default
profile's half day ends (4.4 MB of 24 MiB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def churn(*args: str) -> dict[str, object]:
    r = subprocess.run([sys.executable, "-m", "raps_slurm.cli", "bench", "churn", "--json",
                        *args], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out: dict[str, object] = json.loads(r.stdout)
    return out


DAYS = 0.25
CHURN = ("--days", str(DAYS), "--nodes", "16", "--jobs-per-day", "48", "--job-hours", "4",
         "--quota", "24MiB")


@pytest.mark.etcd
def test_compaction_keeps_the_steady_churn_under_the_quota() -> None:
    out = churn(*CHURN, "--retention-sec", "600", "--interval-sec", "60")
    assert out["nospace"] is False and out["alarms"] == []
    assert out["compactions"] and int(out["compactions"]) > 100  # type: ignore[call-overload]
    assert int(out["max_db_bytes"]) < int(out["quota_bytes"])  # type: ignore[call-overload]
    assert out["simulated_days_done"] == DAYS


@pytest.mark.etcd
def test_without_compaction_the_same_churn_hits_the_quota() -> None:
    out = churn(*CHURN, "--retention-sec", "0")
    assert out["nospace"] is True and "NOSPACE" in out["alarms"]  # type: ignore[operator]
    assert float(out["simulated_days_done"]) < DAYS  # type: ignore[arg-type]
