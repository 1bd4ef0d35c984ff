"""``rapsctl bench simulate``: how fast the simulator covers a large cluster."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from raps_slurm.sim.runner import run_one
from raps_slurm.sim.scenario import parse_scenario

STEPS = (1_000, 10_000)  # smaller sizes timed too, so that a growth faster than linear shows


def run_size(nodes: int, years: float, mtbf_h: float, seed: int) -> dict[str, Any]:
    """Simulate every strategy once on one core (97 % working nodes, 2 % spares, 1 % idle);
    nodes, sim_years, wall_s, cpu_s (this process's CPU time: what a loaded machine does
    not inflate) and events, overall and per strategy."""
    spares = max(1, nodes * 2 // 100)
    idle = max(1, nodes // 100)
    s = parse_scenario({
        "name": "bench", "run": {"seeds": 1, "horizon_days": 365.0 * years, "seed": seed},
        "cluster": {"racks": max(1, nodes // 100), "idle_nodes": idle},
        "failures": {"mtbf_h": mtbf_h}, "job": {"nodes": nodes - spares - idle},
        # pinned: the bench times the simulation, not the interval search
        "checkpoint": {"interval_s": 600.0}, "scr": {"flush_every": 10},
        "raps": {"spares": spares}}, "bench")
    per: dict[str, dict[str, float | int]] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    events = 0
    for name in ("raps", "global", "scr", "step"):
        t, c = time.perf_counter(), time.process_time()
        r = run_one(s, name, seed)
        per[name] = {"wall_s": round(time.perf_counter() - t, 3),
                     "cpu_s": round(time.process_time() - c, 3), "events": r.events,
                     "node_failures": r.failures, "useful_work_fraction":
                     round(r.useful_work_fraction, 5)}
        events += r.events
    wall = time.perf_counter() - t0
    return {"nodes": nodes, "working_nodes": s.job.nodes, "spares": spares,
            "sim_years": years, "wall_s": round(wall, 3),
            "cpu_s": round(time.process_time() - c0, 3), "events": events,
            "strategies": per}


def run_simulate(nodes: int, years: float, mtbf_h: float, seed: int,
                 sizes: Sequence[int] = ()) -> dict[str, Any]:
    """``nodes`` (the top level, as :func:`run_size`) and under ``sizes``, smallest first,
    every size timed with its wall_s per strategy: ``sizes`` and ``nodes``, or without
    ``sizes`` the ones of ``STEPS`` below ``nodes``."""
    every = sorted({*sizes, nodes}) if sizes else [*(n for n in STEPS if n < nodes), nodes]
    runs = {n: run_size(n, years, mtbf_h, seed) for n in every}
    return {**runs[nodes], "sizes": [runs[n] for n in every]}
