"""The simulator's real inputs: an sacct trace with its states and a node failure log."""

from __future__ import annotations

from pathlib import Path

import pytest

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.inputs import (
    load_trace,
    log_period,
    parse_failure_log,
    parse_trace,
    trace_summary,
)
from raps_slurm.sim.runner import inputs, node_mtbf_h, run_one, simulate
from raps_slurm.sim.scenario import load_scenario, override
from raps_slurm.sim.trace import FAIL, REPAIR, build_layout, node_timeline

DATA = Path(__file__).resolve().parents[1] / "data" / "sim"
DAY = 86400.0


def scenario(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "s.yaml"
    f.write_text(text)
    return f


# ---------------------------------------------------------------- sacct states

def test_trace_states_choose_the_simulated_jobs(tmp_path: Path) -> None:
    s = load_scenario(scenario(tmp_path, f"job: {{trace: {DATA / 'sacct-states.psv'}}}\n"
                                         "run: {seeds: 1, horizon_days: 10}\n"))
    jobs = load_trace(s)
    assert jobs is not None
    # FAILED (the program's own error) and CANCELLED are not simulated by default.
    assert [(j.job_id, j.state) for j in jobs] == [
        ("2001", "COMPLETED"), ("2002", "NODE_FAIL"), ("2003", "TIMEOUT"),
        ("2006", "COMPLETED")]
    summary = trace_summary(s)
    assert summary is not None
    assert summary["by_state"] == {"CANCELLED": 1, "COMPLETED": 2, "FAILED": 1,
                                   "NODE_FAIL": 1, "TIMEOUT": 1}
    # 8x24 + 16x12 + 8x48 + 4x(1/6) + 8x6 + 16x24 node-hours, one NODE_FAIL job.
    hours = 8 * 24 + 16 * 12 + 8 * 48 + 4 / 6 + 8 * 6 + 16 * 24
    assert summary["node_mtbf_h_from_node_fail"] == pytest.approx(hours, abs=0.1)
    # One failure: [2T / chi2(0.975, 4), 2T / chi2(0.025, 2)] from the tables, 0.18-40 x T.
    low, high = summary["node_mtbf_h_from_node_fail_ci95"]
    assert low == pytest.approx(2 * hours / 11.14329, abs=0.1)
    assert high == pytest.approx(2 * hours / 0.05063562, rel=1e-5)
    only = override(s, "job.trace_states", ["COMPLETED"])
    assert [j.job_id for j in load_trace(only) or []] == ["2001", "2006"]
    with pytest.raises(ScenarioError, match=r"job.trace_states: no job of the trace is in "
                                            r"PREEMPTED \(the trace has CANCELLED, COMPLETED"):
        load_trace(override(s, "job.trace_states", ["PREEMPTED"]))
    runs = simulate(s)
    assert all(rs[0].useful_s > 0 for rs in runs.values())


def test_state_is_the_first_word() -> None:
    (job,) = parse_trace("JobID|NNodes|Start|End|State\n"
                         "9|2|2026-01-01T00:00:00|2026-01-01T01:00:00|CANCELLED by 0\n")
    assert job.state == "CANCELLED"


# ---------------------------------------------------------------- failure logs

def test_failure_log_is_parsed_relative_to_its_first_failure() -> None:
    log = parse_failure_log((DATA / "failures.csv").read_text(), "f")
    assert len(log) == 13 and log[0].at == 0.0 and log[0].node == "cn017"
    assert log[0].down_s == pytest.approx(5 * 3600 + 28 * 60)
    assert log[1].down_s is None  # no end: a repair time is drawn
    rack = [f for f in log if f.kind == "power"]
    assert len(rack) == 4 and len({f.at for f in rack}) == 1
    seconds = parse_failure_log("time,node,kind\n100,a,hw\n250.5,b,sw\n", "f")
    assert [(f.at, f.node) for f in seconds] == [(0.0, "a"), (150.5, "b")]


@pytest.mark.parametrize(("text", "message"), [
    ("", "f: empty failure log"),
    ("when,node,kind\n", "f: line 1: header lacks time (expected time,node,kind[,end])"),
    ("time,node,kind\nyesterday,a,hw\n",
     "f: line 2: time: expected YYYY-MM-DDTHH:MM:SS or seconds, got 'yesterday'"),
    ("time,node,kind\n5,,hw\n", "f: line 2: node: expected a node name, got ''"),
    ("time,node,kind,end\n50,a,hw,10\n",
     "f: line 2: end: expected a time of the same form as time and not before it, got '10'"),
    ("time,node,kind\n5,a,hw\n2026-01-01T00:00:00,b,hw\n",
     "f: time: date-times and seconds are mixed; use one form"),
    ("time,node,kind\n5,a\n", "f: line 2: expected 3 fields, got 2"),
    ("time,node,kind\n", "f: no failure in the log"),
])
def test_bad_failure_logs_are_one_line(text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as exc:
        parse_failure_log(text, "f")
    assert exc.value.errors[0].startswith(message)


def log_scenario(tmp_path: Path, extra: str = "") -> object:
    return load_scenario(scenario(tmp_path, (
        f"failures: {{log: {DATA / 'failures.csv'}, repair_h: 2}}\n"
        "cluster: {racks: 3, idle_nodes: 2}\n"
        "job: {nodes: 20, state_gb_per_node: 4}\nraps: {spares: 2}\n"
        "run: {seeds: 2, horizon_days: 30}\ncheckpoint: {interval_s: 600}\n" + extra)))


def test_the_log_is_replayed_on_the_clusters_nodes(tmp_path: Path) -> None:
    s = log_scenario(tmp_path)
    lay = build_layout(s)  # type: ignore[arg-type]
    log = parse_failure_log((DATA / "failures.csv").read_text(), "f")
    tl = node_timeline(s, lay, s.run.seed, 30 * DAY, log)  # type: ignore[attr-defined]
    fails = [o for o in tl if o.kind == FAIL]
    # Seed 1 starts the log at its first failure: its 13 failures in 29 days.
    assert len(fails) == 13 and fails[0].at == 0.0
    # By number: cn017 is the 17th node, cn010-cn013 (one power event) the 10th-13th.
    assert fails[0].node == lay.nodes[16]
    power = [o for o in fails if o.at == fails[4].at]
    assert [o.node for o in power] == list(lay.nodes[9:13])
    assert {lay.rack[o.node] for o in power} == {"rack2"}  # racks of 8
    # The logged end is the repair; without one, a repair time is drawn.
    back = next(o for o in tl if o.kind == REPAIR and o.node == lay.nodes[16])
    assert back.at == pytest.approx(5 * 3600 + 28 * 60)
    other = node_timeline(s, lay, s.run.seed + 1, 30 * DAY, log)  # type: ignore[attr-defined]
    assert other != tl and len([o for o in other if o.kind == FAIL]) in range(11, 15)


def test_every_strategy_runs_on_the_log(tmp_path: Path) -> None:
    s = log_scenario(tmp_path)
    for name in ("raps", "global", "scr"):
        r = run_one(s, name, 1)  # type: ignore[arg-type]
        assert 0 < r.useful_work_fraction < 1 and r.failures > 0, name
    info = inputs(s)  # type: ignore[arg-type]
    assert info["failure_log"]["failures"] == 13
    assert info["failure_log"]["kinds"] == ["hardware", "human", "network", "power", "software"]
    # 24 nodes x the replay period (the span and one mean gap) / 13 failures.
    log = parse_failure_log((DATA / "failures.csv").read_text(), "f")
    span = log[-1].at
    assert log_period(log) == pytest.approx(span * 13 / 12)
    assert node_mtbf_h(s) == pytest.approx(24 * log_period(log) / 13 / 3600)  # type: ignore[arg-type]
    hw = override(s, "failures.log_kinds", ["hardware"])  # type: ignore[arg-type]
    assert inputs(hw)["failure_log"]["failures"] == 5


def test_a_log_naming_more_nodes_than_the_cluster_is_refused(tmp_path: Path) -> None:
    s = load_scenario(scenario(tmp_path, (
        f"failures: {{log: {DATA / 'failures.csv'}}}\ncluster: {{racks: 2, idle_nodes: 0}}\n"
        "job: {nodes: 6}\nraps: {spares: 2}\n")))
    # cn024 is beyond 8 nodes, so names map in order, and 12 names do not fit.
    with pytest.raises(ScenarioError, match=r"failures\.log: the log names 12 nodes, "
                                            r"the cluster has 8"):
        run_one(s, "global", 1)
