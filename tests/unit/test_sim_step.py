"""The ``step`` strategy (raps-run --restart-mode step) against closed forms and its rules."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.models import daly_fraction, daly_interval
from raps_slurm.sim.periodic import detection_mean, step_costs
from raps_slurm.sim.results import StrategyResult
from raps_slurm.sim.runner import run_one
from raps_slurm.sim.scenario import Scenario, override, parse_scenario

M = 7200.0      # job MTBF of the closed-form checks, seconds
NODES = 16


def scenario(**sections: dict[str, Any]) -> Scenario:
    """16 nodes in 4 racks, a job MTBF of 2 h, 1000 MTBFs per seed; ``sections`` merged in."""
    data: dict[str, Any] = {
        "job": {"nodes": NODES, "state_gb_per_node": 15},
        "cluster": {"racks": 4, "idle_nodes": 64},
        "failures": {"mtbf_h": M * NODES / 3600, "repair_h": 1},
        "raps": {"spares": 4, "detect_s": 3.0},
        "step": {"relaunch_s": 600, "restore_gbps": -1},  # restore: pull and decode
        "run": {"horizon_days": 1000 * M / 86400, "seeds": 5, "strategies": ["step"]}}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return parse_scenario(data, "t")


def at_daly(s: Scenario) -> tuple[Scenario, float]:
    """The scenario pinned at Daly's interval for step's save, and that interval."""
    tau = daly_interval(step_costs(s, NODES).delta, M)
    return override(s, "step.interval_s", tau), tau


def runs(s: Scenario, seeds: int = 5) -> list[StrategyResult]:
    return [run_one(s, "step", k) for k in range(1, seeds + 1)]


def mean(rs: list[StrategyResult]) -> float:
    return statistics.fmean(r.useful_work_fraction for r in rs)


def test_without_failures_only_the_save_costs() -> None:
    s = override(scenario(failures={"mtbf_h": 1e9}, run={"horizon_days": 30}),
                 "step.interval_s", 600.0)
    (r,) = runs(s, 1)
    save = step_costs(s, NODES).delta
    assert r.job_failures == 0 and r.logging_s == 0
    assert save == pytest.approx(s.raps.incr_s_per_gb * 15)
    assert r.useful_work_fraction == pytest.approx(600 / (600 + save), abs=1e-4)
    # raps on the same cluster pays its message logging on top of the same save.
    raps = run_one(override(s, "raps.interval_s", 600.0), "raps", 1)
    assert raps.useful_work_fraction == pytest.approx(
        r.useful_work_fraction * (1 - s.raps.log_overhead), abs=1e-4)


def test_more_failures_less_useful_work() -> None:
    s, _ = at_daly(scenario())
    often = override(s, "failures.mtbf_h", s.failures.mtbf_h / 4)
    assert mean(runs(often, 2)) < mean(runs(s, 2)) - 0.05


def test_every_restart_costing_the_relaunch_is_dalys_model() -> None:
    """A requeue made to cost what a relaunch does (no queue wait, start-up = relaunch_s)
    turns every failure into Daly's restart R = detection + relaunch + restore; the
    simulated useful work must then be Daly's, within a tolerance that a model without
    the relaunch (600 s) or the restore (290 s of 150 GB) exceeds."""
    s, tau = at_daly(scenario(cluster={"queue_wait_s": 0}, job={"reinit_s": 600,
                                                                "state_gb_per_node": 150},
                              raps={"node_net_gbps": 1000}))
    c = step_costs(s, NODES)
    restore = 150 * s.raps.storage_ratio / 1000 + 150 / s.raps.restore_gbps
    assert c.relaunch == pytest.approx(3.0 + 600 + restore)
    assert c.queue + c.hold == pytest.approx(c.relaunch)
    expect = daly_fraction(tau, c.delta, c.relaunch, M)
    got = mean(runs(s))
    assert got == pytest.approx(expect, rel=0.01)
    assert abs(daly_fraction(tau, c.delta, c.relaunch - restore, M) - got) > 0.01 * got


def test_without_spares_every_failure_is_a_requeue() -> None:
    """No spare: each failure takes the requeue path (detection, queue wait, start-up,
    restore), as global's does. The queue wait Q holds no node (no failure restarts it),
    the rest H does: Daly's renewal argument then gives a wall time per segment of
    (e^((tau + delta)/M) - 1) e^(H/M) (M + Q), i.e. Daly's fraction for R = H times
    M / (M + Q)."""
    s, tau = at_daly(scenario(raps={"spares": 0, "node_net_gbps": 1000}))
    c = step_costs(s, NODES)
    restore = 15 * s.raps.storage_ratio / 1000 + 15 / s.raps.restore_gbps
    assert c.queue == pytest.approx(3.0 + s.cluster.queue_wait_s)
    assert c.hold == pytest.approx(s.job.reinit_s + restore)
    rs = runs(s)
    for r in rs:
        assert r.escalation_kinds.get("no spare", 0) == r.job_failures + r.interrupted_restarts
        assert min(r.stops) >= s.cluster.queue_wait_s
    got = mean(rs)
    expect = daly_fraction(tau, c.delta, c.hold, M) * M / (M + c.queue)
    assert got == pytest.approx(expect, rel=0.01)
    # Daly's R = Q + H, every second of it exposed, is off by more than the tolerance.
    assert abs(daly_fraction(tau, c.delta, c.queue + c.hold, M) - got) > 0.01 * got
    with_spares = runs(override(s, "raps.spares", 4))
    assert mean(with_spares) > got + 0.02
    assert all(r.escalations < r.job_failures / 2 for r in with_spares)


def rack_events(**extra: dict[str, Any]) -> Scenario:
    """Every failure a rack event taking 4 nodes of one rack, repairs in 4 h."""
    return scenario(failures={"mtbf_h": 500, "correlated_share": 1.0, "correlated_nodes": 4,
                              "correlated_scope": "rack", "repair_h": 4},
                    cluster={"idle_nodes": 16}, job={"nodes": 32}, raps={"spares": 24},
                    run={"horizon_days": 200}, step={"interval_s": 1200}, **extra)


def test_a_rack_loss_is_survived_while_a_copy_lives_in_another_rack() -> None:
    s = rack_events(checkpoint={"replicas": 1})
    r = run_one(s, "step", 1)
    assert r.job_failures > 100 and "no copy" not in r.escalation_kinds
    # One rack: the copy sits in the same rack and often dies with its node.
    one = run_one(override(s, "cluster.racks", 1), "step", 1)
    assert one.escalation_kinds.get("no copy", 0) > 5
    # No copy: every lost node waits for its own repair (hours), after a requeue.
    alone = run_one(override(s, "checkpoint.replicas", 0), "step", 1)
    assert alone.escalation_kinds.get("no copy", 0) == \
        alone.job_failures + alone.interrupted_restarts
    assert max(alone.stops) > 3600 > max(r.stops)
    assert alone.useful_work_fraction < r.useful_work_fraction - 0.05


def test_detection_is_rapss_and_no_logging() -> None:
    s = scenario(raps={"detect_s": -1.0})
    model = detection_mean(s.raps)
    assert 2.0 < model < 4.0
    assert step_costs(s, NODES).relaunch == pytest.approx(
        step_costs(override(s, "raps.detect_s", model), NODES).relaunch)
    own = override(override(s, "step.incr_s_per_gb", 0.1), "step.restore_gbps", 5.0)
    assert step_costs(own, NODES).delta == pytest.approx(1.5)
    assert step_costs(own, NODES).relaunch == pytest.approx(model + 600 + 15 / 5.0)


@pytest.mark.parametrize(("key", "value"), [("step.restore_gbps", 0), ("step.incr_s_per_gb",
                                                                      -0.5)])
def test_bad_step_keys_name_what_is_allowed(key: str, value: float) -> None:
    with pytest.raises(ScenarioError, match=rf"{key}: .* expected -1"):
        override(scenario(), key, value)
