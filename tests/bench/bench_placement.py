"""Benchmark: time to compute backup groups and spare lists for a large job; prints JSON.

    python tests/bench/bench_placement.py [--racks 40] [--nodes-per-rack 12]
        [--ranks-per-node 8] [--spares 16] [--power-domains 0] [--replicas 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import Counter

from raps_slurm.core.placement import compute_placement
from raps_slurm.model import Switch, Topology


def build(racks: int, per_rack: int, power: int) -> tuple[Topology, list[str]]:
    """A two-level tree: ``racks`` leaf switches under one root."""
    switches: dict[str, Switch] = {}
    nodes: list[str] = []
    for r in range(racks):
        names = [f"r{r}n{i}" for i in range(per_rack)]
        nodes += names
        switches[f"r{r}"] = Switch(f"r{r}", 0, frozenset(names))
    switches["root"] = Switch("root", 1, frozenset(nodes), tuple(f"r{r}" for r in range(racks)))
    domains = {n: f"p{i % power}" for i, n in enumerate(nodes)} if power else {}
    return Topology(switches, domains), nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--racks", type=int, default=40)
    ap.add_argument("--nodes-per-rack", type=int, default=12)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--spares", type=int, default=16)
    ap.add_argument("--power-domains", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=2,
                    help="copies besides the primary (0-8), as checkpoint.replica_count")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    topo, nodes = build(a.racks, a.nodes_per_rack, a.power_domains)
    # Spares spread over racks: every k-th node.
    step = max(1, len(nodes) // max(1, a.spares))
    spares = nodes[::step][: a.spares]
    working = [n for n in nodes if n not in set(spares)]
    ranks = {i * a.ranks_per_node + k: n for i, n in enumerate(working)
             for k in range(a.ranks_per_node)}
    times = []
    degraded = 0
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        result = compute_placement(topo, ranks, spares, replicas=a.replicas,
                                   prefer_original_rack=True)
        times.append(time.perf_counter() - t0)
        degraded = sum(p.group.degraded for p in result.values())
    # Backup roles per pool node: how even the spread is, not just how fast.
    load = Counter(dict.fromkeys(nodes, 0))
    load.update(n for p in result.values() for n in p.group.members[1:])
    print(json.dumps({
        "benchmark": "placement",
        "racks": a.racks, "nodes": len(nodes), "ranks": len(ranks), "spares": len(spares),
        "power_domains": a.power_domains, "replicas": a.replicas, "repeat": a.repeat,
        "seconds_median": round(statistics.median(times), 4),
        "seconds_min": round(min(times), 4),
        "degraded_groups": degraded,
        "backup_load_min": min(load.values()), "backup_load_max": max(load.values()),
        "python": platform.python_version(),
    }))


if __name__ == "__main__":
    main()
