"""Run a scenario: every strategy on the same failure traces, seed after seed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from raps_slurm.sim.inputs import (
    LoggedFailure,
    TraceJob,
    load_failure_log,
    load_trace,
    log_period,
    trace_summary,
)
from raps_slurm.sim.intervals import Choice, choose, job_mtbf, with_interval
from raps_slurm.sim.models import daly_fraction, daly_interval, young_interval
from raps_slurm.sim.periodic import global_costs, scr_costs, simulate_periodic, step_costs
from raps_slurm.sim.raps import RapsSim
from raps_slurm.sim.results import (
    StrategyResult,
    ci95,
    merge,
    seeds_for_half_width,
    summarize,
)
from raps_slurm.sim.scenario import Scenario
from raps_slurm.sim.trace import build_layout, fold_warning, layout_warnings, node_timeline

DAY = 86400.0


def run_one(s: Scenario, strategy: str, seed: int, nodes: int | None = None,
            work_s: float | None = None, log: list[LoggedFailure] | None = None
            ) -> StrategyResult:
    """One strategy, one seed, one job (``nodes`` and ``work_s`` for a trace job).

    Every strategy of a seed lives in the same cluster: the same nodes, racks, failure and
    repair timeline, spares and queue wait.
    """
    layout = build_layout(s, job_nodes=nodes)
    horizon = s.run.horizon_days * DAY
    if log is None:
        log = load_failure_log(s)
    timeline = node_timeline(s, layout, seed, horizon, log)
    n = len(layout.working)
    if strategy == "raps":
        return RapsSim(s, layout, seed, horizon, work_s, timeline).simulate()
    costs = {"global": global_costs, "scr": scr_costs, "step": step_costs}[strategy](s, n)
    return simulate_periodic(strategy, s, layout, timeline, horizon, costs, work_s)


def run_seed(s: Scenario, strategy: str, seed: int, trace: list[TraceJob] | None,
             log: list[LoggedFailure] | None = None) -> StrategyResult:
    """One seed: the single job, or every job of the trace (summed node-weighted)."""
    if trace is None:
        return run_one(s, strategy, seed, log=log)
    return merge([run_one(s, strategy, seed * 1_000_003 + i, job.nodes, job.work_s, log)
                  for i, job in enumerate(trace)])


def choices(s: Scenario) -> dict[str, Choice]:
    """Each strategy's interval (and SCR's flush frequency), pinned or chosen for it
    (:mod:`raps_slurm.sim.intervals`), searched on the scenario's first ``run.seeds``."""
    trace = load_trace(s)
    log = load_failure_log(s)
    n = _first_job_nodes(s) or s.job.nodes

    def evaluate(scn: Scenario, name: str) -> float:
        return statistics.fmean(run_seed(scn, name, scn.run.seed + k, trace, log)
                                .useful_work_fraction for k in range(scn.run.seeds))

    m = job_mtbf(node_mtbf_h(s), n)
    return {name: choose(s, name, m, n, evaluate) for name in s.run.strategies}


def simulate(s: Scenario, progress: Callable[[int, int], None] | None = None,
             chosen: dict[str, Choice] | None = None) -> dict[str, list[StrategyResult]]:
    """Every strategy of the scenario over its seeds; the same seeds for each strategy,
    each at its own interval (``chosen``, else :func:`choices`).

    With ``run.half_width`` the seeds go on past ``run.seeds`` (at least 3) until every
    strategy's useful-work fraction has a 95 % half-width within it, or ``run.max_seeds``:
    each round runs as many seeds as the spread so far says are needed
    (:func:`~raps_slurm.sim.results.seeds_for_half_width`).
    """
    trace = load_trace(s)
    log = load_failure_log(s)
    chosen = chosen if chosen is not None else choices(s)
    own = {name: with_interval(s, c.interval_s, c.flush_every) for name, c in chosen.items()}
    out: dict[str, list[StrategyResult]] = {name: [] for name in s.run.strategies}
    target = s.run.half_width
    want = max(s.run.seeds, 3) if target > 0 else s.run.seeds
    total = len(s.run.strategies) * want
    done = k = 0
    while True:
        while k < want:
            for name in s.run.strategies:
                out[name].append(run_seed(own[name], name, s.run.seed + k, trace, log))
                done += 1
                if progress is not None:
                    progress(done, total)
            k += 1
        if target <= 0 or k >= s.run.max_seeds:
            return out
        need = max(seeds_for_half_width([r.useful_work_fraction for r in rs], target)
                   for rs in out.values())
        if need <= k:
            return out
        want = min(s.run.max_seeds, need)
        total = len(s.run.strategies) * want


def half_width_note(s: Scenario, runs: dict[str, list[StrategyResult]]) -> dict[str, Any]:
    """What ``run.half_width`` asked and got: the target, the seeds run, whether every
    strategy's useful-work half-width reached it."""
    widths = {name: ci95([r.useful_work_fraction for r in rs]) for name, rs in runs.items()}
    return {"target": s.run.half_width, "max_seeds": s.run.max_seeds,
            "seeds": max((len(rs) for rs in runs.values()), default=0),
            "reached": all(w <= s.run.half_width for w in widths.values())}


def models(s: Scenario, global_interval_s: float | None = None) -> dict[str, Any]:
    """Young's and Daly's intervals and Daly's prediction for the global strategy at its
    interval (with a failure log, for the node MTBF the log shows over the whole cluster)."""
    n = s.job.nodes
    mtbf_job = job_mtbf(node_mtbf_h(s), n)
    g = global_costs(s, n)
    daly = daly_interval(g.delta, mtbf_job)
    at = global_interval_s or (s.global_.interval_s or s.checkpoint.interval_s or daly)
    return {
        "job_mtbf_s": round(mtbf_job, 1),
        "global_checkpoint_s": round(g.delta, 2),
        "global_restart_s": round(g.restart, 2),
        "young_interval_s": round(young_interval(g.delta, mtbf_job), 1),
        "daly_interval_s": round(daly, 1),
        "global_interval_s": round(at, 1),
        "daly_global_fraction_at_interval": round(
            daly_fraction(at, g.delta, g.restart, mtbf_job), 5),
        "daly_global_fraction_at_daly": round(
            daly_fraction(daly, g.delta, g.restart, mtbf_job), 5),
    }


def node_mtbf_h(s: Scenario) -> float:
    """``failures.mtbf_h``, or with a failure log: the cluster's node-hours over the log's
    span (plus one mean gap, its replay period) per logged failure."""
    log = load_failure_log(s)
    if not log:
        return s.failures.mtbf_h
    nodes = len(build_layout(s, job_nodes=_first_job_nodes(s)).nodes)
    return log_period(log) * nodes / len(log) / 3600.0


def _first_job_nodes(s: Scenario) -> int | None:
    trace = load_trace(s)
    return trace[0].nodes if trace else None


def inputs(s: Scenario) -> dict[str, Any]:
    """What the real inputs hold: the trace's jobs by state, the failure log's size."""
    out: dict[str, Any] = {}
    summary = trace_summary(s)
    if summary is not None:
        out["trace"] = summary
    log = load_failure_log(s)
    if log:
        out["failure_log"] = {"failures": len(log), "nodes": len({f.node for f in log}),
                              "kinds": sorted({f.kind for f in log}),
                              "span_days": round((log[-1].at - log[0].at) / DAY, 3),
                              "node_mtbf_h": round(node_mtbf_h(s), 1)}
    return out


def warnings(s: Scenario) -> list[str]:
    """Configurations the scenario should not have, one line each (the run goes on)."""
    trace = load_trace(s)
    sizes = sorted({job.nodes for job in trace}) if trace else [s.job.nodes]
    out: list[str] = []
    for n in sizes:
        for w in layout_warnings(s, build_layout(s, job_nodes=n)):
            if w not in out:
                out.append(w)
    log = load_failure_log(s)
    if log:
        fold = fold_warning(log, build_layout(s, job_nodes=sizes[0]).nodes)
        if fold:
            out.append(fold)
    return out


def result_warnings(s: Scenario, runs: dict[str, list[StrategyResult]],
                    chosen: dict[str, Choice]) -> list[str]:
    """Strategies that did no useful work at all: the cluster cannot run the job that way
    (one line each, with the figures that decide it)."""
    out = []
    m = job_mtbf(node_mtbf_h(s), s.job.nodes)
    for name, rs in runs.items():
        if rs and all(r.useful_s <= 0 for r in rs):
            c = chosen.get(name)
            every = f" checkpointing every {c.interval_s:g} s" if c else ""
            out.append(f"{name}: no useful work in any seed{every}: the job (MTBF "
                       f"{m:.3g} s over {s.job.nodes} nodes) never completes an interval "
                       f"between failures; this cluster cannot run it that way")
    return out


def report(s: Scenario, runs: dict[str, list[StrategyResult]], wall_s: float,
           chosen: dict[str, Choice] | None = None) -> dict[str, Any]:
    """The JSON document ``rapsctl simulate run --json`` prints."""
    chosen = chosen or {}
    g = chosen.get("global")
    out: dict[str, Any] = {
        "scenario": s.name,
        "source": s.source,
        "seeds": max((len(rs) for rs in runs.values()), default=s.run.seeds),
        "horizon_days": s.run.horizon_days,
        "nodes": s.job.nodes,
        "spares": s.raps.spares,
        "interval_s": s.checkpoint.interval_s,
        "replicas": s.checkpoint.replicas,
        "strategies": {name: summarize(rs) for name, rs in runs.items()},
        "intervals": {name: _choice_json(c) for name, c in chosen.items()},
        "models": models(s, g.interval_s if g else None),
        "inputs": inputs(s),
        "warnings": warnings(s) + result_warnings(s, runs, chosen),
        "wall_s": round(wall_s, 3),
    }
    if s.run.half_width > 0:
        out["half_width"] = half_width_note(s, runs)
    return out


def _choice_json(c: Choice) -> dict[str, Any]:
    out: dict[str, Any] = {"interval_s": c.interval_s, "why": c.why}
    if c.flush_every is not None:
        out["flush_every"] = c.flush_every
    if c.tried:
        out["tried"] = [{"interval_s": t, **({"flush_every": f} if f is not None else {}),
                         "useful_work_fraction": v} for t, f, v in c.tried]
    return out


def run_report(s: Scenario, progress: Callable[[int, int], None] | None = None
               ) -> tuple[dict[str, Any], dict[str, list[StrategyResult]]]:
    """Choose each strategy's interval, simulate and report, timing it all."""
    t0 = time.perf_counter()
    chosen = choices(s)
    runs = simulate(s, progress, chosen)
    return report(s, runs, time.perf_counter() - t0, chosen), runs
