"""Each strategy's checkpoint interval (and SCR's flush frequency), chosen for that strategy.

A comparison at one shared interval favours whichever strategy that interval suits, so
every strategy runs at its own best unless the scenario pins it:

- ``global``: Daly's optimum (:func:`~raps_slurm.sim.models.daly_interval`) for its
  checkpoint and the job's MTBF; the simulator models Daly's renewal process, so no
  search is needed;
- ``raps``, ``scr`` and ``step``: a bounded search, simulated on the scenario's own seeds
  (common random numbers), around a closed-form start: Young's interval for the blocking
  save with the lost work replayed ``replay_speedup`` times faster (raps), Daly's for the
  local and partner write plus the flush's share (scr), Daly's for the blocking
  incremental save with the relaunch as restart (step). Five points at x0.5 ... x2, then two around
  the best; then, for scr, ``flush_every`` among a few values at that interval.

A pin: ``checkpoint.interval_s`` > 0 sets every strategy's interval, ``<strategy>.interval_s``
> 0 one strategy's (it wins), ``scr.flush_every`` >= 0 the flush frequency.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from raps_slurm.sim.models import daly_interval, young_interval
from raps_slurm.sim.scenario import Scenario

SPREAD = (0.5, 0.71, 1.0, 1.41, 2.0)
REFINE = (0.84, 1.19)
FLUSH_CHOICES = (2, 5, 10, 20, 50)
DEFAULT_FLUSH = 10  # the flush frequency the interval search runs at
MIN_INTERVAL_S, MAX_INTERVAL_S = 1.0, 1e8

# useful-work fraction of one strategy in a scenario (mean over the scenario's seeds)
Evaluate = Callable[[Scenario, str], float]


@dataclass(frozen=True)
class Choice:
    """One strategy's settings and why."""

    interval_s: float
    why: str
    flush_every: int | None = None      # scr only
    # (interval_s, scr's flush_every or None, useful-work fraction) of every simulated try
    tried: tuple[tuple[float, int | None, float], ...] = ()


def _own(s: Scenario, strategy: str) -> float:
    return {"raps": s.raps.interval_s, "global": s.global_.interval_s,
            "scr": s.scr.interval_s, "step": s.step.interval_s}[strategy]


def pinned(s: Scenario, strategy: str) -> float:
    """The interval the scenario pins for ``strategy`` (0: none)."""
    own = _own(s, strategy)
    return own if own > 0 else s.checkpoint.interval_s


def with_interval(s: Scenario, interval_s: float, flush_every: int | None = None) -> Scenario:
    """The scenario with every strategy's interval (and SCR's flush frequency) fixed."""
    out = replace(s, checkpoint=replace(s.checkpoint, interval_s=interval_s),
                  raps=replace(s.raps, interval_s=0.0), global_=replace(s.global_, interval_s=0.0),
                  scr=replace(s.scr, interval_s=0.0), step=replace(s.step, interval_s=0.0))
    if flush_every is not None:
        out = replace(out, scr=replace(out.scr, flush_every=flush_every))
    return out


def _clamp(x: float) -> float:
    return round(min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, x)), 1)


def start_point(s: Scenario, strategy: str, job_mtbf_s: float, nodes: int) -> tuple[float, str]:
    """The closed-form interval a strategy's search starts from, and what it is."""
    from raps_slurm.sim.periodic import global_costs, scr_costs, step_costs

    if strategy == "global":
        g = global_costs(s, nodes)
        return _clamp(daly_interval(max(g.delta, 1e-6), job_mtbf_s)), (
            f"Daly's optimum for a {g.delta:.0f} s checkpoint at a job MTBF of "
            f"{job_mtbf_s / 3600:.2f} h")
    if strategy == "scr":
        c = scr_costs(s, nodes)
        every = s.scr.flush_every if s.scr.flush_every >= 0 else 10
        delta = c.delta + (c.flush / every if every else 0.0)
        return _clamp(daly_interval(max(delta, 1e-6), job_mtbf_s)), (
            f"Daly's interval for a {delta:.1f} s checkpoint (local, partner and the flush's "
            f"share)")
    if strategy == "step":
        c = step_costs(s, nodes)
        return _clamp(daly_interval(max(c.delta, 1e-6), job_mtbf_s)), (
            f"Daly's interval for a {c.delta:.1f} s incremental save")
    save = s.raps.incr_s_per_gb * s.job.state_gb_per_node
    return _clamp(young_interval(max(save, 1e-3), job_mtbf_s * s.raps.replay_speedup)), (
        f"Young's interval for a {save:.1f} s save, lost work replayed "
        f"x{s.raps.replay_speedup:g}")


def choose(s: Scenario, strategy: str, job_mtbf_s: float, nodes: int,
           evaluate: Evaluate) -> Choice:
    """``strategy``'s interval (and SCR's flush frequency) for scenario ``s``."""
    own = _own(s, strategy)
    start, what = start_point(s, strategy, job_mtbf_s, nodes)
    flush_pin = s.scr.flush_every if s.scr.flush_every >= 0 else None
    flush = None if strategy != "scr" else DEFAULT_FLUSH if flush_pin is None else flush_pin
    seen: dict[tuple[float, int | None], float] = {}

    def score(t: float, f: int | None = flush) -> float:
        if (t, f) not in seen:
            seen[(t, f)] = evaluate(with_interval(s, t, f), strategy)
        return seen[(t, f)]

    if own > 0 or s.checkpoint.interval_s > 0:
        interval = own if own > 0 else s.checkpoint.interval_s
        key = f"{strategy}.interval_s" if own > 0 else "checkpoint.interval_s"
        why = f"pinned by {key} (the planner would start from {start:g} s: {what})"
    elif strategy == "global":
        interval, why = start, what
    else:
        best = max(sorted({_clamp(start * k) for k in SPREAD}), key=score)
        for t in sorted({_clamp(best * k) for k in REFINE}):
            score(t)
        interval = max(seen, key=lambda k: seen[k])[0]
        why = f"best of {len(seen)} simulated intervals from {start:g} s ({what})"
    if strategy == "scr" and flush_pin is None:
        best_f, best_v = flush, score(interval)
        for f in FLUSH_CHOICES:
            if score(interval, f) > best_v + 1e-9:
                best_f, best_v = f, score(interval, f)
        flush = best_f
        why += f"; scr.flush_every {flush}, best of {', '.join(map(str, FLUSH_CHOICES))}"
    elif strategy == "scr":
        why += f"; scr.flush_every {flush} pinned"
    tried = tuple(sorted(((t, f, round(v, 5)) for (t, f), v in seen.items()),
                         key=lambda x: (x[0], x[1] or 0)))
    return Choice(interval, why, flush, tried)


def unpinned(s: Scenario) -> bool:
    """Whether any strategy's interval is left to the planner."""
    return any(pinned(s, x) <= 0 for x in s.run.strategies) or (
        "scr" in s.run.strategies and s.scr.flush_every < 0)


def job_mtbf(node_mtbf_h: float, nodes: int) -> float:
    """The job's MTBF in seconds: one node's, over the job's nodes."""
    return node_mtbf_h * 3600.0 / max(1, nodes) if not math.isinf(node_mtbf_h) else math.inf
