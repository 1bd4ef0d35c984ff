"""What a failure log says, and how sure it is: its node MTBF with a confidence interval,
the fit of its uptimes, the scenario it drives with ``failures.log_mode: fit``, and what
the MTBF's uncertainty means for a report's intervals and useful work.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from raps_slurm.sim.failstats import fit_uptimes, mtbf_interval, node_uptimes
from raps_slurm.sim.inputs import load_trace, log_period, read_failure_log
from raps_slurm.sim.models import daly_fraction, daly_interval
from raps_slurm.sim.scenario import Scenario
from raps_slurm.sim.trace import build_layout

CONFIDENCE = 0.95
_SHAPE_RANGE = (0.05, 20.0)  # failures.weibull_shape's allowed range


def log_statistics(s: Scenario) -> dict[str, Any] | None:
    """The scenario's failure log (whatever ``failures.log_mode``): its failures, the node
    MTBF it implies (the cluster's node-hours over its replay period per failure, as the
    report's models use) with a 95 % chi-square interval, and the fit of its per-node
    uptimes (:func:`~raps_slurm.sim.failstats.fit_uptimes`); None without a log."""
    log = read_failure_log(s)
    if not log:
        return None
    trace = load_trace(s)
    nodes = len(build_layout(s, job_nodes=trace[0].nodes if trace else None).nodes)
    period_h = log_period(log) / 3600.0
    exposure = period_h * nodes
    low, high = mtbf_interval(len(log), exposure, CONFIDENCE)
    outages = [(f.node, f.at / 3600.0, None if f.down_s is None else (f.at + f.down_s) / 3600.0)
               for f in log]
    fails, censored = node_uptimes(outages, period_h)
    out: dict[str, Any] = {
        "failures": len(log), "cluster_nodes": nodes, "node_hours": round(exposure, 1),
        "node_mtbf_h": round(exposure / len(log), 2),
        "node_mtbf_h_ci95": [round(low, 2), None if math.isinf(high) else round(high, 2)]}
    try:
        out["fit"] = fit_uptimes(fails, censored).as_json()
    except ValueError:
        out["fit"] = None
        out["fit_why_not"] = (f"{len(fails)} uptimes between two failures of one node: at "
                              f"least two of different lengths are needed")
    return out


def with_log_fit(s: Scenario) -> Scenario:
    """``s`` with ``failures.log_mode: fit`` applied: ``mtbf_h`` from the log, and
    ``distribution: weibull`` with the fitted shape when the Weibull's AIC is lower (else
    exponential). Any other scenario is returned as it is."""
    if s.failures.log_mode != "fit" or not s.failures.log:
        return s
    stats = log_statistics(s)
    if stats is None:
        return s
    fit = stats["fit"]
    weibull = fit is not None and fit["better"] == "weibull"
    shape = min(max(fit["weibull"]["shape"], _SHAPE_RANGE[0]), _SHAPE_RANGE[1]) if weibull \
        else s.failures.weibull_shape
    failures = dataclasses.replace(
        s.failures, mtbf_h=float(stats["node_mtbf_h"]), weibull_shape=shape,
        distribution="weibull" if weibull else "exponential")
    return dataclasses.replace(s, failures=failures)


def _end(value: float | None) -> float:
    return math.inf if value is None else value


def mtbf_uncertainty(report: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    """What the log's MTBF interval means for a ``simulate run`` report.

    Intervals: each strategy's interval scaled as Young's and Daly's (sqrt of the MTBF) to
    the interval's ends. Useful work: to first order the work lost and the waiting scale
    with the failure rate, so at MTBF m' a strategy's fraction is u - (lost + stall) x
    (m / m' - 1) (checkpoint and logging costs do not move at a fixed interval).
    ``global``: Daly's model at its interval and at each end's own Daly interval (what the
    point estimate costs if the truth is at an end).
    """
    m = float(stats["node_mtbf_h"])
    low, high = stats["node_mtbf_h_ci95"]
    ends = (float(low), _end(high))
    out: dict[str, Any] = {"failures": stats["failures"], "node_mtbf_h": m,
                           "node_mtbf_h_ci95": [low, high],
                           "job_mtbf_h_ci95": [round(e / max(1, report["nodes"]), 3)
                                               if not math.isinf(e) else None for e in ends]}
    per: dict[str, Any] = {}
    for name, r in report["strategies"].items():
        u = float(r["useful_work_fraction"])
        loss = float(r.get("lost_work_fraction", 0.0)) + float(r.get("stall_fraction", 0.0))
        row: dict[str, Any] = {"useful_work_fraction": u, "useful_work_fraction_at_ends": [
            round(min(1.0, max(0.0, u - loss * (m / e - 1.0))), 4) for e in ends]}
        choice = report.get("intervals", {}).get(name)
        if choice:
            t = float(choice["interval_s"])
            row["interval_s"] = t
            row["interval_s_at_ends"] = [round(t * math.sqrt(e / m), 1)
                                         if not math.isinf(e) else None for e in ends]
        per[name] = row
    out["strategies"] = per
    mod = report.get("models")
    if mod and "global" in report["strategies"]:
        delta, restart = mod["global_checkpoint_s"], mod["global_restart_s"]
        at, job = mod["global_interval_s"], mod["job_mtbf_s"]
        rows: list[dict[str, Any] | None] = []
        for e in ends:
            if math.isinf(e):
                rows.append(None)
                continue
            mj = job * e / m
            best = daly_interval(delta, mj)
            rows.append({"job_mtbf_s": round(mj, 1),
                         "fraction_at_interval": round(daly_fraction(at, delta, restart, mj), 5),
                         "daly_interval_s": round(best, 1),
                         "fraction_at_own_interval": round(
                             daly_fraction(best, delta, restart, mj), 5)})
        out["global_daly_at_ends"] = rows
    return out
