"""The simulator's parts: scenarios, traces, layout, detection delays and the three strategies."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from raps_slurm.core.detector import Detector
from raps_slurm.core.planner import Plan
from raps_slurm.errors import ScenarioError
from raps_slurm.sim.detect import detection_delays, settings_for
from raps_slurm.sim.inputs import parse_trace
from raps_slurm.sim.periodic import partners
from raps_slurm.sim.raps import RapsSim
from raps_slurm.sim.runner import run_one, simulate
from raps_slurm.sim.scenario import (
    Scenario,
    describe,
    load_scenario,
    override,
)
from raps_slurm.sim.scenario import parse_scenario as parse_any
from raps_slurm.sim.trace import FAIL, REPAIR, build_layout, domain_events, node_timeline

ROOT = Path(__file__).resolve().parents[2]
DAY = 86400.0


def parse_scenario(data: object, source: str = "scenario") -> Scenario:
    """A scenario whose strategies checkpoint every 600 s unless it says otherwise: these
    tests check the strategies' mechanics, not the planner's interval search."""
    if isinstance(data, dict):
        ck = data.get("checkpoint")
        if ck is None or (isinstance(ck, dict) and "interval_s" not in ck):
            data = {**data, "checkpoint": {**(ck or {}), "interval_s": 600.0}}
    return parse_any(data, source)


def scn(**sections: dict[str, object]) -> object:
    return parse_scenario({k.rstrip("_"): v for k, v in sections.items()}, "test")


# ---------------------------------------------------------------- scenarios

@pytest.mark.parametrize(("data", "message"), [
    ({"job": {"nodez": 3}}, "test: job.nodez: unknown key; did you mean 'nodes'? (allowed: nodes, ranks_per_node, "
     "state_gb_per_node, change_rate, reinit_s, step_s, msg_bytes, msg_per_step, trace, trace_states)"),
    ({"job": {"nodes": 0}}, "test: job.nodes: 0 is out of range, allowed 1 to 10000000"),
    ({"job": {"nodes": "many"}}, "test: job.nodes: expected an integer, got 'many'"),
    ({"failures": {"distribution": "gamma"}},
     "test: failures.distribution: 'gamma' is not allowed, expected one of exponential, weibull"),
    ({"run": {"strategies": ["raps", "magic"]}},
     "test: run.strategies: 'magic' is not a strategy, expected some of raps, global, scr, "
     "step"),
    ({"failures": {"correlated_share": 0.2, "correlated_scope": "power"}},
     "test: failures.correlated_scope: 'power' needs cluster.power_domains > 0"),
    ({"global": {"pfs_write_gbps": -1}},
     "test: global.pfs_write_gbps: -1 is out of range, allowed 0.001 to 1000000000.0"),
    ({"source": "x"}, "test: source: unknown key (allowed: name, run, cluster, failures, job, "
                      "checkpoint, raps, global, scr, step)"),
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
    assert [(j.job_id, j.nodes, j.work_s, j.state) for j in jobs] == [
        ("1001", 64, 36 * 3600.0, "COMPLETED"), ("1002", 128, 72 * 3600.0, "COMPLETED"),
        ("1003", 32, 12.5 * 3600.0, "TIMEOUT"), ("1005", 256, 7 * 86400.0, "COMPLETED")]


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


def test_timeline_alternates_failures_and_repairs() -> None:
    s = parse_scenario({"job": {"nodes": 50}, "failures": {"mtbf_h": 100, "repair_h": 10,
                                                             "correlated_share": 0.3},
                        "cluster": {"racks": 5}}, "t")
    lay = build_layout(s)
    horizon = 1000 * 3600.0
    tl = node_timeline(s, lay, 1, horizon)
    assert tl == node_timeline(s, lay, 1, horizon)  # a seed is a trace
    assert [o.at for o in tl] == sorted(o.at for o in tl) and tl[-1].at < horizon
    last: dict[str, str] = {}
    for o in tl:
        assert last.get(o.node, REPAIR) != o.kind  # up, down, up, ...
        last[o.node] = o.kind
    # A node is up MTBF and down repair_h on average: failures at 1 / (100 h + 10 h).
    fails = sum(1 for o in tl if o.kind == FAIL)
    expected = len(lay.nodes) * 1000 / 110
    assert abs(fails - expected) < 4 * math.sqrt(expected)
    # Rack events show as several failures at one instant.
    times = [o.at for o in tl if o.kind == FAIL]
    assert len(times) > len(set(times))


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


# ---------------------------------------------------------------- bounds and topology

@pytest.mark.timeout(60)
def test_mtbf_shorter_than_a_restart_ends_at_the_horizon() -> None:
    # 128 nodes failing every 2 h: a job failure every minute, a 28-minute restart never
    # completes; every strategy must still stop at the horizon.
    s = parse_scenario({"failures": {"mtbf_h": 2}, "job": {"nodes": 128},
                        "raps": {"spares": 8}, "run": {"horizon_days": 20, "seeds": 1}}, "t")
    for name in ("global", "scr", "raps"):
        r = run_one(s, name, 1)
        assert r.wall_s == 20 * DAY
        assert r.useful_work_fraction < 0.05, name


@pytest.mark.timeout(60)
def test_trace_job_not_done_by_the_horizon_is_unfinished(tmp_path: Path) -> None:
    trace = tmp_path / "t.psv"
    trace.write_text("JobID|NNodes|Start|End|State\n"
                     "7|16|2026-01-01T00:00:00|2026-01-21T00:00:00|COMPLETED\n")
    (tmp_path / "s.yaml").write_text("job: {trace: t.psv}\nfailures: {mtbf_h: 2}\n"
                                     "run: {horizon_days: 5, seeds: 1}\n")
    runs = simulate(load_scenario(tmp_path / "s.yaml"))
    for name, rs in runs.items():
        assert rs[0].unfinished == 1, name


def test_rack_count_is_split_evenly() -> None:
    s = parse_scenario({"job": {"nodes": 7}, "raps": {"spares": 2},
                        "cluster": {"racks": 4, "idle_nodes": 0}}, "t")
    lay = build_layout(s)
    sizes = [list(lay.rack.values()).count(f"rack{k}") for k in (1, 2, 3, 4)]
    assert sizes == [3, 2, 2, 2]


def test_racks_as_a_list_of_sizes() -> None:
    s = parse_scenario({"job": {"nodes": 7}, "raps": {"spares": 2},
                        "cluster": {"racks": [4, 3, 2, 1], "power_domains": 2}}, "t")
    assert s.cluster.racks == 4 and s.cluster.idle_nodes == 1
    lay = build_layout(s)
    assert [list(lay.rack.values()).count(f"rack{k}") for k in (1, 2, 3, 4)] == [4, 3, 2, 1]
    assert {lay.power[n] for n in lay.nodes if lay.rack[n] in ("rack1", "rack2")} == {"pdu1"}
    assert override(s, "raps.spares", 3).cluster.idle_nodes == 0  # the list stays the cluster
    assert override(s, "job.nodes", 6).cluster.rack_sizes == (4, 3, 2, 1)


@pytest.mark.parametrize(("cluster", "message"), [
    ({"racks": 20, "idle_nodes": 0},
     "t: cluster.racks: 20 racks for 9 nodes (job.nodes + raps.spares = 9 + "
     "cluster.idle_nodes): every rack needs a node; give fewer racks or a list of rack sizes"),
    ({"racks": [4, 3]},
     "t: cluster.racks: the racks hold 7 nodes, fewer than job.nodes + raps.spares = 9"),
    ({"racks": [4, 0]},
     "t: cluster.racks: expected a rack count or a list of rack sizes (integers >= 1), "
     "got [4, 0]"),
    ({"rack_sizes": [4]}, "t: cluster.rack_sizes: unknown key (give cluster.racks a list of "
                          "rack sizes instead, e.g. racks: [4, 3, 2])"),
])
def test_bad_racks_are_one_line(cluster: dict[str, object], message: str) -> None:
    with pytest.raises(ScenarioError) as exc:
        parse_scenario({"job": {"nodes": 7}, "raps": {"spares": 2}, "cluster": cluster}, "t")
    assert exc.value.errors == [message]


def test_unusable_spares_are_warned_about() -> None:
    from raps_slurm.sim.runner import warnings

    one = parse_scenario({"job": {"nodes": 7}, "raps": {"spares": 2},
                          "cluster": {"racks": 1, "idle_nodes": 0},
                          "run": {"horizon_days": 30, "seeds": 1}}, "t")
    (w,) = warnings(one)
    assert w.startswith("cluster.racks: one rack: every spare shares the rack")
    # And it is true: with one rack every failure of a working node requeues the job.
    r = run_one(override(one, "failures.mtbf_h", 200), "raps", 1)
    assert r.job_failures > 0 and r.escalations >= r.job_failures
    assert warnings(override(one, "raps.prefer_original_rack", True))[0].endswith(
        "(raps.prefer_original_rack)")
    assert warnings(override(one, "cluster.racks", 3)) == []


# ---------------------------------------------------------------- one cluster model

def rack_events(**extra: dict[str, object]) -> dict[str, object]:
    base: dict[str, object] = {
        "job": {"nodes": 32, "state_gb_per_node": 10}, "cluster": {"racks": 4},
        "failures": {"mtbf_h": 2000, "correlated_share": 1.0, "correlated_scope": "rack",
                     "repair_h": 4},
        "raps": {"spares": 8}, "run": {"horizon_days": 120, "seeds": 1}}
    for k, v in extra.items():
        base[k] = {**base.get(k, {}), **v}  # type: ignore[dict-item]
    return base


def test_scr_partners_sit_in_another_rack() -> None:
    s = parse_scenario(rack_events(run={"horizon_days": 365}), "t")
    lay = build_layout(s)
    rack = [lay.rack[x] for x in lay.working]
    assert all(rack[i] != rack[j] for i, j in enumerate(partners(lay)))
    r = run_one(s, "scr", 1)
    # Whole-rack events take nodes, never their partners: no fall back to the flush ...
    assert r.job_failures > 0 and r.fallbacks == 0
    # ... while a rack event within one failure group of partners would.
    one = build_layout(override(s, "cluster.racks", 1))
    assert partners(one) == [(i + 1) % len(one.working) for i in range(len(one.working))]
    never = run_one(override(override(s, "cluster.racks", 1), "scr.flush_every", 0), "scr", 1)
    assert never.fallbacks > 0 and never.useful_work_fraction < r.useful_work_fraction


def test_rack_events_hit_every_strategy_the_same() -> None:
    s = parse_scenario(rack_events(), "t")
    seen = {name: run_one(s, name, 3).failures for name in ("raps", "global", "scr")}
    assert all(n > 0 for n in seen.values())
    # raps's backup groups are rack-disjoint: no copy is lost with its node.
    assert "no copy" not in run_one(s, "raps", 3).escalation_kinds


def test_requeued_jobs_wait_for_repairs_in_a_full_cluster() -> None:
    base = {"job": {"nodes": 16}, "failures": {"mtbf_h": 500, "repair_h": 100},
            "raps": {"spares": 0}, "run": {"horizon_days": 200, "seeds": 1}}
    full = parse_scenario({**base, "cluster": {"racks": 4, "idle_nodes": 0}}, "t")
    roomy = parse_scenario({**base, "cluster": {"racks": 4, "idle_nodes": 16}}, "t")
    restart = full.cluster.queue_wait_s + full.job.reinit_s
    for name in ("global", "scr", "raps"):
        waits = run_one(full, name, 1).stops
        spare_room = run_one(roomy, name, 1).stops
        # With no idle node a requeued job waits for its dead node's repair (hours).
        assert max(waits) > 5 * restart, name
        assert statistics.median(spare_room) < 2 * restart, name


def test_a_nodes_ranks_move_together_to_one_spare() -> None:
    s = parse_scenario({"job": {"nodes": 16, "ranks_per_node": 8, "state_gb_per_node": 8},
                        "failures": {"mtbf_h": 400}, "raps": {"spares": 4},
                        "run": {"horizon_days": 20, "seeds": 1}}, "t")
    sim = RapsSim(s, build_layout(s), 2, 20 * DAY)
    r = sim.simulate()
    plans = [Plan.from_json(kv.key, kv.value)
             for kv in sim.store.get_prefix(sim.keys.job_plans_prefix("1"))]
    assert r.job_failures > 0 and plans
    # One plan per dead node, moving the node's whole state (8 ranks x 1 GB).
    assert all(p.restore_bytes == 8 * 10**9 for p in plans)
    assert len({(p.source, p.run) for p in plans}) == len(plans)
    assert all(0 <= p.rank < 16 for p in plans)
