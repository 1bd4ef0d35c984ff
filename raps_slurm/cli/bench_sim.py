"""``rapsctl bench simulate``: how fast the simulator covers a large cluster."""

from __future__ import annotations

import json
import time

import click

from raps_slurm.sim.runner import run_one
from raps_slurm.sim.scenario import parse_scenario


@click.command("simulate")
@click.option("--nodes", type=click.IntRange(10, 10_000_000), default=10_000, show_default=True,
              help="Nodes in the cluster: 97 % working, 2 % spares, 1 % idle.")
@click.option("--years", type=click.FloatRange(0.01, 100), default=1.0, show_default=True,
              help="Simulated years.")
@click.option("--mtbf-h", type=click.FloatRange(1, 1e9), default=43_800.0, show_default=True,
              help="Node MTBF, hours (5 years: a failure every 4.4 h at 10,000 nodes).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the default output too).")
def bench_simulate(nodes: int, years: float, mtbf_h: float, seed: int, as_json: bool) -> None:
    """Simulate every strategy once on one core and print nodes, sim_years, wall_s, events."""
    spares = max(1, nodes * 2 // 100)
    idle = max(1, nodes // 100)
    s = parse_scenario({
        "name": "bench", "run": {"seeds": 1, "horizon_days": 365.0 * years, "seed": seed},
        "cluster": {"racks": max(1, nodes // 100), "idle_nodes": idle},
        "failures": {"mtbf_h": mtbf_h}, "job": {"nodes": nodes - spares - idle},
        "raps": {"spares": spares}}, "bench")
    per: dict[str, dict[str, float | int]] = {}
    t0 = time.perf_counter()
    events = 0
    for name in ("raps", "global", "scr"):
        t = time.perf_counter()
        r = run_one(s, name, seed)
        per[name] = {"wall_s": round(time.perf_counter() - t, 3), "events": r.events,
                     "node_failures": r.failures, "useful_work_fraction":
                     round(r.useful_work_fraction, 5)}
        events += r.events
    wall = time.perf_counter() - t0
    click.echo(json.dumps({"nodes": nodes, "working_nodes": s.job.nodes, "spares": spares,
                           "sim_years": years, "wall_s": round(wall, 3), "events": events,
                           "strategies": per}))
