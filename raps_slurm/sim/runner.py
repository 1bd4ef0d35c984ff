"""Run a scenario: every strategy on the same failure traces, seed after seed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from raps_slurm.sim.models import daly_fraction, daly_interval, young_interval
from raps_slurm.sim.periodic import global_costs, scr_costs, simulate_periodic
from raps_slurm.sim.raps import RapsSim
from raps_slurm.sim.results import StrategyResult, merge, summarize
from raps_slurm.sim.scenario import Scenario, TraceJob, load_trace
from raps_slurm.sim.trace import build_layout

DAY = 86400.0


def run_one(s: Scenario, strategy: str, seed: int, nodes: int | None = None,
            work_s: float | None = None) -> StrategyResult:
    """One strategy, one seed, one job (``nodes`` and ``work_s`` for a trace job)."""
    layout = build_layout(s, job_nodes=nodes)
    horizon = s.run.horizon_days * DAY
    n = len(layout.working)
    if strategy == "raps":
        return RapsSim(s, layout, seed, horizon, work_s).simulate()
    costs = global_costs(s, n) if strategy == "global" else scr_costs(s, n)
    return simulate_periodic(strategy, s, layout, seed, horizon, costs, work_s)


def run_seed(s: Scenario, strategy: str, seed: int,
             trace: list[TraceJob] | None) -> StrategyResult:
    """One seed: the single job, or every job of the trace (summed node-weighted)."""
    if trace is None:
        return run_one(s, strategy, seed)
    return merge([run_one(s, strategy, seed * 1_000_003 + i, job.nodes, job.work_s)
                  for i, job in enumerate(trace)])


def simulate(s: Scenario, progress: Callable[[int, int], None] | None = None
             ) -> dict[str, list[StrategyResult]]:
    """Every strategy of the scenario over its seeds; the same seeds for each strategy."""
    trace = load_trace(s)
    out: dict[str, list[StrategyResult]] = {name: [] for name in s.run.strategies}
    total = len(s.run.strategies) * s.run.seeds
    done = 0
    for k in range(s.run.seeds):
        for name in s.run.strategies:
            out[name].append(run_seed(s, name, s.run.seed + k, trace))
            done += 1
            if progress is not None:
                progress(done, total)
    return out


def models(s: Scenario) -> dict[str, Any]:
    """Young's and Daly's intervals and Daly's prediction for the global strategy."""
    n = s.job.nodes
    mtbf_job = s.failures.mtbf_h * 3600.0 / n
    g = global_costs(s, n)
    return {
        "job_mtbf_s": round(mtbf_job, 1),
        "global_checkpoint_s": round(g.delta, 2),
        "global_restart_s": round(g.restart, 2),
        "young_interval_s": round(young_interval(g.delta, mtbf_job), 1),
        "daly_interval_s": round(daly_interval(g.delta, mtbf_job), 1),
        "daly_global_fraction_at_interval": round(
            daly_fraction(s.checkpoint.interval_s, g.delta, g.restart, mtbf_job), 5),
    }


def report(s: Scenario, runs: dict[str, list[StrategyResult]], wall_s: float
           ) -> dict[str, Any]:
    """The JSON document ``rapsctl simulate run --json`` prints."""
    return {
        "scenario": s.name,
        "source": s.source,
        "seeds": s.run.seeds,
        "horizon_days": s.run.horizon_days,
        "nodes": s.job.nodes,
        "spares": s.raps.spares,
        "interval_s": s.checkpoint.interval_s,
        "replicas": s.checkpoint.replicas,
        "strategies": {name: summarize(rs) for name, rs in runs.items()},
        "models": models(s),
        "wall_s": round(wall_s, 3),
    }


def run_report(s: Scenario, progress: Callable[[int, int], None] | None = None
               ) -> tuple[dict[str, Any], dict[str, list[StrategyResult]]]:
    """Simulate and report, timing the simulation."""
    t0 = time.perf_counter()
    runs = simulate(s, progress)
    return report(s, runs, time.perf_counter() - t0), runs
