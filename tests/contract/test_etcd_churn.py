"""etcd stays under its quota with the leader's compaction, and fills up without it
(``rapsctl bench churn`` against a throw-away etcd, as a user runs it)."""

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


@pytest.mark.etcd
def test_compaction_keeps_a_day_of_churn_under_the_quota() -> None:
    out = churn("--days", "0.5", "--nodes", "16", "--quota", "24MiB", "--retention-sec", "600",
                "--interval-sec", "60")
    assert out["nospace"] is False and out["alarms"] == []
    assert out["compactions"] and int(out["compactions"]) > 100  # type: ignore[call-overload]
    assert int(out["max_db_bytes"]) < int(out["quota_bytes"])  # type: ignore[call-overload]
    assert out["simulated_days_done"] == 0.5


@pytest.mark.etcd
def test_without_compaction_the_same_churn_hits_the_quota() -> None:
    out = churn("--days", "0.5", "--nodes", "16", "--quota", "24MiB", "--retention-sec", "0")
    assert out["nospace"] is True and "NOSPACE" in out["alarms"]  # type: ignore[operator]
    assert float(out["simulated_days_done"]) < 0.5  # type: ignore[arg-type]
