"""The simulator's parts: scenarios, traces, layout, detection delays and the three strategies."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from raps_slurm.core.detector import Detector
from raps_slurm.core.planner import Plan
from raps_slurm.errors import ScenarioError
from raps_slurm.sim.detect import detection_delays, settings_for
from raps_slurm.sim.raps import RapsSim
from raps_slurm.sim.runner import run_one, simulate
from raps_slurm.sim.scenario import (
    describe,
    load_scenario,
    override,
    parse_scenario,
    parse_trace,
)
from raps_slurm.sim.trace import SlotFailures, build_layout, domain_events

ROOT = Path(__file__).resolve().parents[2]
DAY = 86400.0


def scn(**sections: dict[str, object]) -> object:
    return parse_scenario({k.rstrip("_"): v for k, v in sections.items()}, "test")


# ---------------------------------------------------------------- scenarios

@pytest.mark.parametrize(("data", "message"), [
    ({"job": {"nodez": 3}}, "test: job.nodez: unknown key; did you mean 'nodes'? (allowed: nodes, ranks_per_node, "
     "state_gb_per_node, change_rate, trace)"),
    ({"job": {"nodes": 0}}, "test: job.nodes: 0 is out of range, allowed 1 to 10000000"),
    ({"job": {"nodes": "many"}}, "test: job.nodes: expected an integer, got 'many'"),
    ({"failures": {"distribution": "gamma"}},
     "test: failures.distribution: 'gamma' is not allowed, expected one of exponential, weibull"),
    ({"run": {"strategies": ["raps", "magic"]}},
     "test: run.strategies: 'magic' is not a strategy, expected some of raps, global, scr"),
    ({"failures": {"correlated_share": 0.2, "correlated_scope": "power"}},
     "test: failures.correlated_scope: 'power' needs cluster.power_domains > 0"),
    ({"global": {"pfs_write_gbps": -1}},
     "test: global.pfs_write_gbps: -1 is out of range, allowed 0.001 to 1000000000.0"),
    ({"source": "x"}, "test: source: unknown key (allowed: name, run, cluster, failures, job, "
                      "checkpoint, raps, global, scr)"),
    ([1, 2], "test: scenario: expected a mapping of keys, got [1, 2]"),
])
def test_bad_scenarios_name_the_key(data: object, message: str) -> None:
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(data, "test")
    assert exc.value.errors[0] == message


def test_scenario_files_load_and_every_key_is_described() -> None:
    for f in sorted((ROOT / "examples" / "scenarios").glob("*.yaml")):
        s = load_scenario(f)
        assert s.source == str(f)
    keys = {k for k, _, _ in describe()}
    assert {"global.pfs_write_gbps", "raps.spares", "checkpoint.interval_s", "name"} <= keys
    assert not any(k.startswith(("global_", "source")) for k in keys)


def test_override_checks_the_new_value() -> None:
    s = parse_scenario({}, "test")
    assert override(s, "raps.spares", 9).raps.spares == 9
    with pytest.raises(ScenarioError, match=r"raps\.sparez: unknown key"):
        override(s, "raps.sparez", 1)
    with pytest.raises(ScenarioError, match=r"checkpoint\.replicas: 9 is out of range"):
        override(s, "checkpoint.replicas", 9)


def test_unreadable_or_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("job: [1,\n")
    with pytest.raises(ScenarioError, match=r"bad.yaml: line \d+ invalid YAML"):
        load_scenario(bad)


def test_sacct_trace() -> None:
    text = (ROOT / "examples" / "scenarios" / "trace-small.psv").read_text()
    jobs = parse_trace(text)
    assert [(j.job_id, j.nodes, j.work_s) for j in jobs] == [
        ("1001", 64, 36 * 3600.0), ("1002", 128, 72 * 3600.0), ("1003", 32, 12.5 * 3600.0),
        ("1005", 256, 7 * 86400.0)]


@pytest.mark.parametrize(("text", "message"), [
    ("", "t: empty trace"),
    ("JobID|NNodes|Start\n", "t: line 1: header lacks End, State"),
    ("JobID|NNodes|Start|End|State\n1|x|2026-01-01T00:00:00|2026-01-02T00:00:00|COMPLETED\n",
     "t: line 2: NNodes: expected a positive integer, got 'x'"),
    ("JobID|NNodes|Start|End|State\n1|2|yesterday|2026-01-02T00:00:00|COMPLETED\n",
     "t: line 2: Start: expected YYYY-MM-DDTHH:MM:SS, got 'yesterday'"),
    ("JobID|NNodes|Start|End|State\n1|2\n", "t: line 2: expected 5 fields, got 2"),
    ("JobID|NNodes|Start|End|State\n1|2|Unknown|Unknown|PENDING\n",
     "t: no job with a start, an end and NNodes >= 1"),
])
def test_bad_traces(text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as exc:
        parse_trace(text, "t")
    assert exc.value.errors[0].startswith(message)


# ---------------------------------------------------------------- layout and traces

def test_layout_spreads_spares_over_racks() -> None:
    s = parse_scenario({"job": {"nodes": 60}, "raps": {"spares": 4},
                        "cluster": {"racks": 4, "power_domains": 2, "idle_nodes": 4}}, "t")
    lay = build_layout(s)
    assert len(lay.working) == 60 and len(lay.spares) == 4
    assert not set(lay.working) & set(lay.spares)
    assert len({lay.rack[n] for n in lay.spares}) == 4
    assert set(lay.power.values()) == {"pdu1", "pdu2"}
    assert set(lay.topology.racks()) == {"rack1", "rack2", "rack3", "rack4"}


def test_correlated_events_cause_their_share_of_failures() -> None:
    s = parse_scenario({"job": {"nodes": 100}, "raps": {"spares": 0},
                        "cluster": {"racks": 10, "idle_nodes": 0},
                        "failures": {"mtbf_h": 1000, "correlated_share": 0.5,
                                     "correlated_nodes": 2}}, "t")
    lay = build_layout(s)
    horizon = 2000 * 3600.0
    events = domain_events(s, lay, 3, horizon)
    hits = sum(len(e.victims) for e in events)
    expected = 0.5 * 100 * horizon / (1000 * 3600)   # 100 node failures from events
    assert abs(hits - expected) < 4 * math.sqrt(expected)
    assert all(len(e.victims) == 2 for e in events)
    assert events == domain_events(s, lay, 3, horizon)  # a seed is a trace


def test_slot_failures_are_a_poisson_stream() -> None:
    s = parse_scenario({"job": {"nodes": 50}, "failures": {"mtbf_h": 100}}, "t")
    lay = build_layout(s)
    horizon = 1000 * 3600.0
    f = SlotFailures(s, lay, 1, horizon, lay.working)
    t, n = 0.0, 0
    while True:
        t = f.next_after(t)
        if t > horizon:
            break
        n += 1
    expected = 50 * 1000 / 100
    assert abs(n - expected) < 4 * math.sqrt(expected)


def test_weibull_keeps_the_mean() -> None:
    s = parse_scenario({"job": {"nodes": 200}, "failures": {
        "mtbf_h": 100, "distribution": "weibull", "weibull_shape": 0.6}}, "t")
    from raps_slurm.sim.trace import NodeStream
    draws = [NodeStream(1, f"n{i}", s).uptime() for i in range(4000)]
    assert abs(sum(draws) / len(draws) / 3600 - 100) < 10


# ---------------------------------------------------------------- detection

def test_detection_delays_come_from_the_detector() -> None:
    s = parse_scenario({}, "t")
    delays = detection_delays(s.raps)
    st = settings_for(s.raps)
    # Three strikes after the last heartbeat, at most the window plus margin and a period.
    assert min(delays) >= st.miss_window - st.interval
    assert max(delays) <= st.miss_window + st.fence_margin + st.interval + 0.1
    assert sorted(delays) != [delays[0]] * len(delays)
    assert isinstance(Detector(st, 0.0), Detector)


def test_detection_scales_with_the_heartbeat_interval() -> None:
    fast = parse_scenario({"raps": {"heartbeat_interval_s": 0.2}}, "t")
    slow = parse_scenario({"raps": {"heartbeat_interval_s": 2.0}}, "t")
    assert max(detection_delays(fast.raps)) < min(detection_delays(slow.raps))


# ---------------------------------------------------------------- strategies

def no_failures(**extra: object) -> object:
    base = {"job": {"nodes": 16, "state_gb_per_node": 10}, "failures": {"mtbf_h": 1e9},
            "run": {"seeds": 1, "horizon_days": 10}, "raps": {"spares": 2}}
    base.update(extra)
    return parse_scenario(base, "t")


def test_failure_free_fractions_are_the_overheads() -> None:
    s = no_failures()
    tau = s.checkpoint.interval_s
    c = s.raps.incr_s_per_gb * 10
    r = run_one(s, "raps", 1)
    assert r.job_failures == 0
    assert r.useful_work_fraction == pytest.approx((1 - s.raps.log_overhead) * tau / (tau + c),
                                                   rel=1e-3)
    g = run_one(s, "global", 1)
    delta = 16 * 10 / s.global_.pfs_write_gbps
    assert g.useful_work_fraction == pytest.approx(tau / (tau + delta), rel=1e-3)


def test_same_seed_same_result_other_seed_other_result() -> None:
    s = parse_scenario({"job": {"nodes": 32}, "failures": {"mtbf_h": 500},
                        "run": {"horizon_days": 60, "seeds": 1}}, "t")
    a, b, c = (run_one(s, "raps", k) for k in (1, 1, 2))
    assert a.recoveries == b.recoveries and a.useful_s == b.useful_s
    assert a.recoveries != c.recoveries


def test_raps_plans_go_through_the_store_and_finish() -> None:
    s = parse_scenario({"job": {"nodes": 32}, "failures": {"mtbf_h": 300},
                        "raps": {"spares": 8}, "run": {"horizon_days": 10, "seeds": 1}}, "t")
    sim = RapsSim(s, build_layout(s), 4, 10 * DAY)
    r = sim.simulate()
    plans = [Plan.from_json(kv.key, kv.value)
             for kv in sim.store.get_prefix(sim.keys.job_plans_prefix("1"))]
    assert plans and r.recoveries
    assert {p.state for p in plans} <= {"done", "escalated", "failed", "queued", "running",
                                        "restored"}
    done = [p for p in plans if p.state == "done"]
    assert done and all(p.target != p.source and p.restored_at is not None for p in done)
    # Every done plan started and ended after the fault verdict it answers.
    assert all(p.detected_at is not None and p.started_at >= p.detected_at  # type: ignore[operator]
               for p in done)


def test_raps_without_spares_requeues_every_time() -> None:
    s = parse_scenario({"job": {"nodes": 16}, "failures": {"mtbf_h": 200},
                        "raps": {"spares": 0}, "run": {"horizon_days": 20, "seeds": 1}}, "t")
    r = run_one(s, "raps", 1)
    assert r.job_failures > 0
    assert r.escalations == r.job_failures
    assert set(r.escalation_kinds) <= {"no spare", "batch host"}


def test_more_spares_fewer_requeues() -> None:
    base = {"job": {"nodes": 64}, "failures": {"mtbf_h": 1000},
            "run": {"horizon_days": 120, "seeds": 2, "strategies": ["raps"]}}
    few = simulate(parse_scenario({**base, "raps": {"spares": 2}}, "t"))["raps"]
    many = simulate(parse_scenario({**base, "raps": {"spares": 16}}, "t"))["raps"]
    assert sum(r.escalations for r in many) < sum(r.escalations for r in few)


def test_concurrency_bound_queues_a_rack_failure() -> None:
    def worst(bound: int) -> float:
        s = parse_scenario({
            "job": {"nodes": 32, "ranks_per_node": 2, "state_gb_per_node": 50},
            "cluster": {"racks": 4},
            "failures": {"mtbf_h": 2000, "correlated_share": 1.0, "correlated_nodes": 3},
            "raps": {"spares": 24, "max_concurrent_recoveries": bound,
                     "recovery_timeout_s": 100000},
            "run": {"horizon_days": 60, "seeds": 1}}, "t")
        return max(run_one(s, "raps", 2).recoveries)
    assert worst(1) > worst(8)


def test_trace_jobs_end_when_their_work_is_done() -> None:
    s = load_scenario(ROOT / "examples" / "scenarios" / "trace.yaml")
    s = override(s, "run.seeds", 1)
    runs = simulate(s)
    for rs in runs.values():
        r = rs[0]
        assert 0 < r.useful_work_fraction <= 1
    work = sum(j * n for j, n in ((36, 64), (72, 128), (12.5, 32), (168, 256))) * 3600
    assert runs["raps"][0].useful_s == pytest.approx(work, rel=1e-6)
