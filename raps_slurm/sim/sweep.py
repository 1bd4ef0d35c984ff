"""Parameter sweeps and the recommendation of interval, replicas and spares."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.models import daly_fraction, daly_interval, young_interval
from raps_slurm.sim.periodic import global_costs
from raps_slurm.sim.results import summarize
from raps_slurm.sim.runner import node_mtbf_h, simulate
from raps_slurm.sim.scenario import Scenario, override

Progress = Callable[[int, int], None]


def parse_values(key: str, text: str) -> list[Any]:
    """``600,1200,1800`` or ``300:3600:6`` (six values, geometric) for ``--vary KEY=...``."""
    import yaml

    if text.count(":") == 2 and "," not in text:
        try:
            lo, hi, n = (float(x) for x in text.split(":"))
        except ValueError:
            raise ScenarioError([f"--vary {key}: expected LOW:HIGH:COUNT numbers, got "
                                 f"{text!r}"]) from None
        if not (0 < lo < hi) or n < 2 or n != int(n):
            raise ScenarioError([f"--vary {key}: expected 0 < LOW < HIGH and COUNT >= 2, got "
                                 f"{text!r}"])
        k = int(n)
        return [round(lo * (hi / lo) ** (i / (k - 1)), 6) for i in range(k)]
    values = [yaml.safe_load(v) for v in text.split(",") if v.strip()]
    if not values:
        raise ScenarioError([f"--vary {key}: expected values separated by commas"])
    return values


def grid(s: Scenario, vary: Sequence[tuple[str, Sequence[Any]]]
         ) -> list[tuple[dict[str, Any], Scenario]]:
    """Every combination of the varied keys, each as a checked scenario."""
    out = []
    keys = [k for k, _ in vary]
    for combo in itertools.product(*(vals for _, vals in vary)):
        scn = s
        for k, v in zip(keys, combo, strict=True):
            scn = override(scn, k, v)
        out.append((dict(zip(keys, combo, strict=True)), scn))
    return out


def sweep(s: Scenario, vary: Sequence[tuple[str, Sequence[Any]]],
          progress: Progress | None = None) -> list[dict[str, Any]]:
    """One row per combination and strategy: the varied values, then the summary."""
    points = grid(s, vary)
    rows: list[dict[str, Any]] = []
    total = len(points)
    for i, (params, scn) in enumerate(points):
        runs = simulate(scn)
        for name, rs in runs.items():
            rows.append({**params, "strategy": name, **summarize(rs)})
        if progress is not None:
            progress(i + 1, total)
    return rows


def daly_curve(s: Scenario, intervals: Sequence[float]) -> list[tuple[float, float]]:
    """Daly's prediction for the global strategy at each interval."""
    g = global_costs(s, s.job.nodes)
    m = node_mtbf_h(s) * 3600.0 / s.job.nodes  # the failure log's MTBF when there is one
    return [(t, daly_fraction(t, g.delta, g.restart, m)) for t in intervals]


def _summary(s: Scenario) -> dict[str, Any]:
    return summarize(simulate(s)["raps"])


def recommend(s: Scenario, progress: Progress | None = None) -> dict[str, Any]:
    """Interval, spares and replicas that maximise raps's useful work per allocated node.

    The objective is ``node_efficiency``: useful node-hours over the node-hours the job
    holds, spares included, so a spare must earn its keep. The interval is searched around
    Young's (raps's blocking save cost against the job's MTBF), then the spare count, then
    the replica count; a larger spare or replica count is taken only when it gains more
    than 0.05 points (less storage, fewer nodes held for the same result).
    """
    s = replace(s, run=replace(s.run, strategies=("raps",)))
    n = s.job.nodes
    m_job = node_mtbf_h(s) * 3600.0 / n  # the failure log's MTBF when there is one
    c = s.raps.incr_s_per_gb * s.job.state_gb_per_node
    young = young_interval(max(c, 1e-3), m_job)
    intervals = sorted({round(min(86400.0, max(30.0, young * f)))
                        for f in (0.25, 0.5, 0.71, 1.0, 1.41, 2.0, 4.0)})
    spares = sorted({max(1, round(n * f)) for f in (0.005, 0.01, 0.02, 0.05, 0.1)}
                    | {1, 2, 4, 8})
    spares = [x for x in spares if x <= max(8, n // 5)]
    replicas = [1, 2, 3]
    total = len(intervals) + len(spares) + len(replicas)
    step = 0

    def tick() -> None:
        nonlocal step
        step += 1
        if progress is not None:
            progress(step, total)

    tried: list[dict[str, Any]] = []
    summaries: dict[tuple[str, Any], dict[str, Any]] = {}

    def score(scn: Scenario, what: dict[str, Any]) -> float:
        summary = _summary(scn)
        ((key, value),) = what.items()
        summaries[(key, value)] = summary
        tried.append({**what, "node_efficiency": summary["node_efficiency"],
                      "node_efficiency_ci95": summary["node_efficiency_ci95"],
                      "useful_work_fraction": summary["useful_work_fraction"],
                      "escalations_per_seed": summary["escalations_per_seed"],
                      "recovery_p50_s": summary["recovery_p50_s"]})
        tick()
        return float(summary["node_efficiency"])

    best_t = max(intervals, key=lambda t: score(
        override(s, "checkpoint.interval_s", float(t)), {"interval_s": t}))
    s = override(s, "checkpoint.interval_s", float(best_t))
    best_sp, best_f = spares[0], -1.0
    for sp in spares:
        f = score(override(s, "raps.spares", sp), {"spares": sp})
        if f > best_f + 0.0005:
            best_sp, best_f = sp, f
    s = override(s, "raps.spares", best_sp)
    best_r, best_rf = replicas[0], -1.0
    for r in replicas:
        f = score(override(s, "checkpoint.replicas", r), {"replicas": r})
        if f > best_rf + 0.0005:
            best_r, best_rf = r, f
    final = summaries[("replicas", best_r)]
    g = global_costs(s, n)
    return {
        "nodes": n, "mtbf_h": round(node_mtbf_h(s), 3),
        "state_gb_per_node": s.job.state_gb_per_node,
        "job_mtbf_s": round(m_job, 1),
        "objective": "node_efficiency: useful node-hours / allocated node-hours (spares "
                     "included)",
        "raps": {"interval_s": best_t, "spares": best_sp, "replicas": best_r,
                 "node_efficiency": final["node_efficiency"],
                 "node_efficiency_ci95": final["node_efficiency_ci95"],
                 "useful_work_fraction": final["useful_work_fraction"],
                 "useful_work_fraction_ci95": final["useful_work_fraction_ci95"],
                 "checkpoint_s": round(c, 2),
                 "young_interval_s": round(young, 1),
                 "daly_interval_s": round(daly_interval(max(c, 1e-3), m_job), 1)},
        "global": {"checkpoint_s": round(g.delta, 2), "restart_s": round(g.restart, 1),
                   "young_interval_s": round(young_interval(g.delta, m_job), 1),
                   "daly_interval_s": round(daly_interval(g.delta, m_job), 1),
                   "daly_useful_work_fraction": round(daly_fraction(
                       daly_interval(g.delta, m_job), g.delta, g.restart, m_job), 5)
                   if g.delta > 0 else None},
        "tried": tried,
        "seeds": s.run.seeds, "horizon_days": s.run.horizon_days,
    }

