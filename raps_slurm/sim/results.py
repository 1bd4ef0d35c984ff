"""What one strategy did in one run, and the mean over seeds with a confidence interval."""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
    unfinished: int = 0        # trace jobs whose work was not done by the horizon
    fallbacks: int = 0         # scr: a node and its partner lost together, back to the PFS

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
                     "interrupted_restarts", "events", "unfinished", "fallbacks"):
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


# Two-sided 95 % quantiles of Student's t distribution (0.975 quantile) by degrees of
# freedom; tests/unit/test_sim_stats.py checks every entry against a numerical integration
# of the t density. Between entries the quantile is interpolated in 1/df.
T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 6: 2.4469, 7: 2.3646,
        8: 2.3060, 9: 2.2622, 10: 2.2281, 11: 2.2010, 12: 2.1788, 13: 2.1604, 14: 2.1448,
        15: 2.1314, 16: 2.1199, 17: 2.1098, 18: 2.1009, 19: 2.0930, 20: 2.0860, 25: 2.0595,
        30: 2.0423, 40: 2.0211, 60: 2.0003, 120: 1.9799}
Z975 = 1.959964


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (df >= 1)."""
    if df in T975:
        return T975[df]
    keys = sorted(T975)
    if df > keys[-1]:
        lo_df, lo_q, hi_inv, hi_q = keys[-1], T975[keys[-1]], 0.0, Z975
    else:
        lo_df = max(k for k in keys if k < df)
        hi_df = min(k for k in keys if k > df)
        lo_q, hi_inv, hi_q = T975[lo_df], 1.0 / hi_df, T975[hi_df]
    lo_inv = 1.0 / lo_df
    w = (1.0 / df - hi_inv) / (lo_inv - hi_inv)
    return hi_q + w * (lo_q - hi_q)


def ci95(values: Sequence[float]) -> float:
    """Half-width of the 95 % confidence interval of the mean (Student's t, n - 1 df)."""
    if len(values) < 2:
        return 0.0
    return t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


BOOTSTRAP_RESAMPLES = 1000


def bootstrap_pct_ci95(values: Sequence[float], q: float,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
                       ) -> tuple[float, float] | None:
    """95 % percentile-bootstrap interval of the ``q`` quantile (nearest rank, as
    :func:`_pct`): the values resampled with replacement ``resamples`` times, the quantile
    of each resample, their 2.5 % and 97.5 % points. A fixed ``seed`` makes a report
    reproducible. None for fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    data = np.asarray(values, dtype=float)
    k = min(n - 1, max(0, math.ceil(q * n) - 1))
    rng = np.random.default_rng(seed)
    stats: list[np.ndarray] = []
    per = max(1, 2_000_000 // n)  # resamples per batch: memory stays near 16 MB
    done = 0
    while done < resamples:
        m = min(per, resamples - done)
        sample = data[rng.integers(0, n, size=(m, n))]
        stats.append(np.partition(sample, k, axis=1)[:, k])
        done += m
    lo, hi = np.quantile(np.concatenate(stats), [0.025, 0.975])
    return float(lo), float(hi)


def seeds_for_half_width(values: Sequence[float], half_width: float) -> int:
    """Seeds the mean of ``values`` needs for a 95 % half-width of ``half_width``, from
    their spread so far: the smallest n with t(n-1) x s / sqrt(n) <= half_width."""
    if len(values) < 2 or half_width <= 0:
        return len(values)
    sd = statistics.stdev(values)
    if sd == 0:
        return len(values)
    n = max(2, math.ceil((Z975 * sd / half_width) ** 2))
    while t975(n - 1) * sd / math.sqrt(n) > half_width:
        n += 1
    return n


def summarize(runs: Sequence[StrategyResult]) -> dict[str, Any]:
    """Mean over seeds; the useful-work fraction and node efficiency with their 95 %
    confidence half-widths (Student's t over the seeds); recovery percentiles with 95 %
    bootstrap intervals (``[low, high]``, over the recoveries of every seed)."""
    fr = [r.useful_work_fraction for r in runs]
    ne = [r.node_efficiency for r in runs]
    rec = [x for r in runs for x in r.recoveries]
    stops = [x for r in runs for x in r.stops]
    n = len(runs)
    wall = sum(r.wall_s for r in runs)

    def mean(name: str) -> float:
        return float(sum(getattr(r, name) for r in runs)) / n

    def r4(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    def ci(values: list[float], q: float) -> list[float] | None:
        got = bootstrap_pct_ci95(values, q)
        return None if got is None else [round(got[0], 4), round(got[1], 4)]

    return {
        "useful_work_fraction": round(statistics.fmean(fr), 5),
        "useful_work_fraction_ci95": round(ci95(fr), 5),
        "node_efficiency": round(statistics.fmean(ne), 5),
        "node_efficiency_ci95": round(ci95(ne), 5),
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
        "recovery_p50_s_ci95": ci(rec, 0.5),
        "recovery_p90_s": r4(_pct(rec, 0.9)),
        "recovery_p90_s_ci95": ci(rec, 0.9),
        "recovery_max_s": r4(max(rec)) if rec else None,
        "stop_p50_s": r4(_pct(stops, 0.5)),
        "stop_p50_s_ci95": ci(stops, 0.5),
        "failures_per_seed": round(mean("failures"), 2),
        "job_failures_per_seed": round(mean("job_failures"), 2),
        "escalations_per_seed": round(mean("escalations"), 2),
        "escalation_causes": {k: round(sum(r.escalation_kinds.get(k, 0) for r in runs) / n, 2)
                              for k in sorted({k for r in runs for k in r.escalation_kinds})},
        "checkpoints_per_seed": round(mean("checkpoints"), 1),
        "storage_gb": round(mean("storage_gb"), 2),
        "pfs_tb_per_seed": round(mean("pfs_tb"), 4),
        "network_tb_per_seed": round(mean("network_tb"), 4),
        "pfs_fallbacks_per_seed": round(mean("fallbacks"), 2),
        "unfinished_jobs_per_seed": round(mean("unfinished"), 2),
        "events": sum(r.events for r in runs),
        "seeds": n,
    }


CSV_COLUMNS = ("strategy", "useful_work_fraction", "useful_work_fraction_ci95",
               "node_efficiency", "node_efficiency_ci95", "lost_work_fraction",
               "checkpoint_overhead", "logging_overhead", "stall_fraction", "recoveries",
               "recovery_mean_s", "recovery_p50_s", "recovery_p50_s_ci95_low",
               "recovery_p50_s_ci95_high", "recovery_p90_s", "recovery_p90_s_ci95_low",
               "recovery_p90_s_ci95_high", "recovery_max_s", "stop_p50_s",
               "failures_per_seed", "job_failures_per_seed",
               "escalations_per_seed", "checkpoints_per_seed", "storage_gb", "pfs_tb_per_seed",
               "network_tb_per_seed", "pfs_fallbacks_per_seed", "unfinished_jobs_per_seed",
               "events", "seeds")


def to_csv(rows: Sequence[dict[str, Any]], extra: Sequence[str] = ()) -> str:
    """CSV text: the ``extra`` columns (sweep parameters) first, then the summary's."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    cols = (*extra, *CSV_COLUMNS)
    w.writerow(cols)
    for row in rows:
        flat = dict(row)
        for name in ("recovery_p50_s", "recovery_p90_s"):
            low_high = row.get(name + "_ci95") or (None, None)
            flat[name + "_ci95_low"], flat[name + "_ci95_high"] = low_high
        w.writerow(["" if flat.get(c) is None else flat.get(c) for c in cols])
    return buf.getvalue()
