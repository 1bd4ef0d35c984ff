"""What one strategy did in one run, and the mean over seeds with a confidence interval."""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StrategyResult:
    """One strategy, one seed (or the sum over a trace's jobs)."""

    strategy: str
    wall_s: float           # job wall time (the horizon, or the time to finish the work)
    useful_s: float         # computation kept, job seconds
    nodes: int              # working nodes
    allocated_nodes: int    # working + spares
    lost_work_s: float      # computation thrown away and done again, job seconds
    checkpoint_s: float     # time spent writing checkpoints, job seconds
    checkpoints: int
    failures: int           # node failures the job saw (spares and holders included)
    job_failures: int       # failures that stopped the job (whole or waiting for a rank)
    escalations: int        # raps: whole-job requeues
    interrupted_restarts: int
    recoveries: list[float] = field(default_factory=list)  # fault -> back where it was
    stops: list[float] = field(default_factory=list)       # fault -> computing again
    storage_gb: float = 0.0
    pfs_tb: float = 0.0
    network_tb: float = 0.0
    events: int = 0
    node_seconds: float = 0.0  # allocated node-seconds (trace: summed over jobs)
    logging_s: float = 0.0     # raps: computation spent on message logging
    escalation_kinds: dict[str, int] = field(default_factory=dict)  # raps: why requeued

    @property
    def useful_work_fraction(self) -> float:
        """Useful computation over wall time."""
        return self.useful_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def node_efficiency(self) -> float:
        """Useful node-seconds over allocated node-seconds (spares count as allocated)."""
        alloc = self.node_seconds or self.wall_s * self.allocated_nodes
        return self.useful_s * self.nodes / alloc if alloc > 0 else 0.0


def merge(results: Sequence[StrategyResult]) -> StrategyResult:
    """The sum of several jobs' results (a trace): times and counts add up."""
    first = results[0]
    out = StrategyResult(first.strategy, 0.0, 0.0, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0)
    useful_ns = wall_ns = alloc_ns = 0.0
    for r in results:
        useful_ns += r.useful_s * r.nodes
        wall_ns += r.wall_s * r.nodes
        alloc_ns += r.node_seconds or r.wall_s * r.allocated_nodes
        for name in ("lost_work_s", "checkpoint_s", "logging_s"):  # node-weighted like wall
            setattr(out, name, getattr(out, name) + getattr(r, name) * r.nodes)
        for name in ("storage_gb", "pfs_tb", "network_tb"):
            setattr(out, name, getattr(out, name) + getattr(r, name))
        for name in ("checkpoints", "failures", "job_failures", "escalations",
                     "interrupted_restarts", "events"):
            setattr(out, name, getattr(out, name) + getattr(r, name))
        for k, v in r.escalation_kinds.items():
            out.escalation_kinds[k] = out.escalation_kinds.get(k, 0) + v
        out.recoveries.extend(r.recoveries)
        out.stops.extend(r.stops)
    # Node-weighted: a trace's fraction is useful node-seconds over node-seconds.
    out.nodes, out.allocated_nodes = 1, 1
    out.useful_s, out.wall_s, out.node_seconds = useful_ns, wall_ns, alloc_ns
    return out


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _ci95(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    return 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def summarize(runs: Sequence[StrategyResult]) -> dict[str, Any]:
    """Mean over seeds; the useful-work fraction with its 95 % confidence half-width."""
    fr = [r.useful_work_fraction for r in runs]
    rec = [x for r in runs for x in r.recoveries]
    stops = [x for r in runs for x in r.stops]
    n = len(runs)
    wall = sum(r.wall_s for r in runs)

    def mean(name: str) -> float:
        return float(sum(getattr(r, name) for r in runs)) / n

    def r4(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "useful_work_fraction": round(statistics.fmean(fr), 5),
        "useful_work_fraction_ci95": round(_ci95(fr), 5),
        "node_efficiency": round(statistics.fmean(r.node_efficiency for r in runs), 5),
        "lost_work_fraction": round(sum(r.lost_work_s for r in runs) / wall, 5) if wall else 0.0,
        "checkpoint_overhead": round(sum(r.checkpoint_s for r in runs) / wall, 5)
        if wall else 0.0,
        "logging_overhead": round(sum(r.logging_s for r in runs) / wall, 5) if wall else 0.0,
        "stall_fraction": round(1.0 - statistics.fmean(fr) - sum(
            r.lost_work_s + r.checkpoint_s + r.logging_s for r in runs) / wall, 5)
        if wall else 0.0,
        "recoveries": len(rec),
        "recovery_mean_s": r4(statistics.fmean(rec)) if rec else None,
        "recovery_p50_s": r4(_pct(rec, 0.5)),
        "recovery_p90_s": r4(_pct(rec, 0.9)),
        "recovery_max_s": r4(max(rec)) if rec else None,
        "stop_p50_s": r4(_pct(stops, 0.5)),
        "failures_per_seed": round(mean("failures"), 2),
        "job_failures_per_seed": round(mean("job_failures"), 2),
        "escalations_per_seed": round(mean("escalations"), 2),
        "escalation_causes": {k: round(sum(r.escalation_kinds.get(k, 0) for r in runs) / n, 2)
                              for k in sorted({k for r in runs for k in r.escalation_kinds})},
        "checkpoints_per_seed": round(mean("checkpoints"), 1),
        "storage_gb": round(mean("storage_gb"), 2),
        "pfs_tb_per_seed": round(mean("pfs_tb"), 4),
        "network_tb_per_seed": round(mean("network_tb"), 4),
        "events": sum(r.events for r in runs),
        "seeds": n,
    }


CSV_COLUMNS = ("strategy", "useful_work_fraction", "useful_work_fraction_ci95",
               "node_efficiency", "lost_work_fraction", "checkpoint_overhead",
               "logging_overhead", "stall_fraction", "recoveries", "recovery_mean_s",
               "recovery_p50_s", "recovery_p90_s", "recovery_max_s", "stop_p50_s",
               "failures_per_seed",
               "job_failures_per_seed", "escalations_per_seed", "checkpoints_per_seed",
               "storage_gb", "pfs_tb_per_seed", "network_tb_per_seed", "events", "seeds")


def to_csv(rows: Sequence[dict[str, Any]], extra: Sequence[str] = ()) -> str:
    """CSV text: the ``extra`` columns (sweep parameters) first, then the summary's."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    cols = (*extra, *CSV_COLUMNS)
    w.writerow(cols)
    for row in rows:
        w.writerow(["" if row.get(c) is None else row.get(c) for c in cols])
    return buf.getvalue()
