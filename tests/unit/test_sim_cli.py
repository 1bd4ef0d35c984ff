"""``rapsctl simulate`` and ``rapsctl bench simulate`` as a user runs them (real processes)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEED = "examples/scenarios/article-128.yaml"
QUICK = ("--seeds", "1", "--set", "run.horizon_days=30")


def rapsctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "raps_slurm.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, check=False)


def test_run_json_has_every_strategy() -> None:
    r = rapsctl("simulate", "run", SEED, "--json", *QUICK)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for name in ("raps", "global", "scr", "step"):
        frac = out["strategies"][name]["useful_work_fraction"]
        assert 0 < frac < 1
    assert out["strategies"]["raps"]["useful_work_fraction"] > \
        out["strategies"]["global"]["useful_work_fraction"]
    assert out["models"]["daly_interval_s"] > 0


def test_run_table_csv_and_cdf(tmp_path: Path) -> None:
    r = rapsctl("simulate", "run", SEED, *QUICK, "--csv", str(tmp_path / "r.csv"),
                "--plots", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "useful work (share of wall time)" in r.stdout
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert [row["strategy"] for row in rows] == ["raps", "global", "scr", "step"]
    assert (tmp_path / "recovery-cdf.png").read_bytes().startswith(b"\x89PNG")


def test_sweep_writes_rows_and_plots(tmp_path: Path) -> None:
    r = rapsctl("simulate", "sweep", SEED, *QUICK, "--vary", "checkpoint.interval_s=300,1200",
                "--vary", "checkpoint.replicas=1,2", "--json", "--plots", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["rows"]) == 2 * 2 * 4
    assert {row["checkpoint.interval_s"] for row in out["rows"]} == {300, 1200}
    assert sorted(Path(p).name for p in out["plots"]) == ["storage-vs-replicas.png",
                                                         "useful-vs-interval.png"]


def test_recommend_prints_interval_replicas_spares() -> None:
    r = rapsctl("simulate", "recommend", "--mtbf-h", "2000", "--state-gb", "20", "--nodes",
                "64", "--days", "20", "--seeds", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rec = out["raps"]
    assert rec["interval_s"] > 0 and rec["spares"] >= 1 and rec["replicas"] in (1, 2, 3)
    assert rec["young_interval_s"] > 0 and out["global"]["daly_interval_s"] > 0
    assert out["objective"].startswith("node_efficiency")
    best = max(t["node_efficiency"] for t in out["tried"] if "interval_s" in t)
    assert rec["node_efficiency"] >= best - 0.0011
    assert rec["node_efficiency_ci95"] == 0.0  # one seed: no interval
    r = rapsctl("simulate", "recommend", "--mtbf-h", "2000", "--state-gb", "20", "--nodes",
                "64", "--days", "10", "--seeds", "1")
    assert "checkpoint.interval_s:" in r.stdout and "Young" in r.stdout
    assert "useful work per allocated node (the objective)" in r.stdout


def test_errors_are_one_line() -> None:
    r = rapsctl("simulate", "run", "examples/scenarios/missing.yaml")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot read" in r.stderr
    r = rapsctl("simulate", "run", SEED, "--set", "raps.sparez=3")
    assert r.returncode == 2 and "raps.sparez: unknown key" in r.stderr
    r = rapsctl("simulate", "run", SEED, "--set", "nonsense")
    assert r.returncode == 2 and "expected KEY=VALUE" in r.stderr
    r = rapsctl("simulate", "sweep", SEED, "--vary", "checkpoint.interval_s=5:1:3")
    assert r.returncode == 2 and "0 < LOW < HIGH" in r.stderr


def test_unusable_spares_warn_on_stderr() -> None:
    r = rapsctl("simulate", "run", SEED, "--json", *QUICK, "--set", "cluster.racks=1")
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("warning: cluster.racks: one rack")
    assert json.loads(r.stdout)["warnings"] == [r.stderr[len("warning: "):].strip()]


def test_keys_lists_every_key() -> None:
    r = rapsctl("simulate", "keys")
    assert r.returncode == 0
    assert "raps.max_concurrent_recoveries = 4" in r.stdout
    assert "cluster.queue_wait_s = 1200.0" in r.stdout


def test_bench_simulate_prints_its_measurement() -> None:
    r = rapsctl("bench", "simulate", "--nodes", "500", "--years", "0.2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["nodes"] == 500 and out["sim_years"] == 0.2
    assert out["events"] == sum(v["events"] for v in out["strategies"].values()) > 0
    assert out["wall_s"] > 0
    # the smaller sizes below it, then itself: a growth faster than linear shows
    assert [x["nodes"] for x in out["sizes"]] == [500] and out["sizes"][-1]["wall_s"] > 0
    assert all(v["wall_s"] >= 0 for v in out["sizes"][0]["strategies"].values())
