"""The fast paths of placement on large trees: spare orders and hops of a uniform tree
(every upper switch holds all racked nodes or none) against the rule as documented."""

from __future__ import annotations

import random

import pytest

from raps_slurm.core.domains import Domains
from raps_slurm.core.placement import compute_placement, domain_disjoint, order_spares
from raps_slurm.model import Switch, Topology


def _tree(rng: random.Random, shape: str) -> tuple[Topology, list[str]]:
    switches: dict[str, Switch] = {}
    nodes: list[str] = []
    racks = [f"r{k}" for k in range(rng.randint(1, 12))]
    for r in racks:
        names = [f"{r}n{i}" for i in range(rng.randint(1, 5))]
        nodes += names
        switches[r] = Switch(r, 0, frozenset(names))
    if shape == "empty-core":  # the simulator's layout: the core lists no nodes
        switches["core"] = Switch("core", 1, frozenset(), tuple(racks))
    elif shape == "full-core":  # topology.conf's usual root: every node
        switches["core"] = Switch("core", 1, frozenset(nodes), tuple(racks))
    else:  # two middle switches: hops differ between rack pairs
        halves = [racks[::2], racks[1::2]]
        for i, half in enumerate(halves):
            switches[f"m{i}"] = Switch(f"m{i}", 1, frozenset(n for r in half for n in
                                                            switches[r].nodes), tuple(half))
        switches["top"] = Switch("top", 2, frozenset(), ("m0", "m1"))
    pd = rng.choice([0, 2, 3])
    power = {n: f"p{rng.randrange(pd)}" for n in nodes if rng.random() < 0.8} if pd else {}
    return Topology(switches, power), nodes


def _reference(topo: Topology, primary: str, spares: list[str], prefer: bool,
               unhealthy: frozenset[str]) -> tuple[str, ...]:
    """The documented spare order, straight from its rule (module docstring)."""
    rack = {n: r for r, ns in sorted(topo.racks().items(), reverse=True) for n in ns}
    home = rack[primary]
    prefer_home = prefer and home not in unhealthy

    def key(s: str) -> tuple[bool, bool, bool, int, str]:
        sick = s in unhealthy or rack[s] in unhealthy
        away = not (prefer_home and rack[s] == home)
        return (sick, away, not domain_disjoint(topo, primary, s),
                topo.distance(primary, s), s)

    return tuple(sorted(set(spares), key=key))


@pytest.mark.parametrize("shape", ["empty-core", "full-core", "two-level"])
def test_spare_order_follows_the_rule(shape: str) -> None:
    rng = random.Random(shape)
    for _ in range(150):
        topo, nodes = _tree(rng, shape)
        spares = rng.sample(nodes, rng.randint(0, len(nodes)))
        primary = rng.choice(nodes)
        unhealthy = frozenset(rng.sample([*nodes, *topo.racks()], 2)) \
            if len(nodes) > 1 else frozenset()
        prefer = rng.random() < 0.5
        got = order_spares(topo, primary, spares, prefer_original_rack=prefer,
                           unhealthy=unhealthy)
        assert got == _reference(topo, primary, spares, prefer, unhealthy)


@pytest.mark.parametrize("shape,uniform", [("empty-core", True), ("full-core", True),
                                           ("two-level", False)])
def test_hops_match_the_topology(shape: str, uniform: bool) -> None:
    rng = random.Random(f"hops/{shape}")
    for _ in range(30):
        topo, nodes = _tree(rng, shape)
        d = Domains(topo)
        assert d.uniform == (uniform or len(topo.racks()) == 1)
        for a in nodes:
            for b in nodes:
                assert d.dist(a, b) == topo.distance(a, b), (a, b)
                if d.rack[a] != d.rack[b]:
                    assert d.near(a) <= d.dist(a, b)


def test_backups_of_a_large_job_stay_balanced_and_disjoint() -> None:
    """1,000 nodes in 100 racks: the ordered pick gives every group a log backup and a
    mirror in two other racks, and no node holds two roles more than another."""
    racks = {f"r{k}": [f"r{k}n{i}" for i in range(10)] for k in range(100)}
    topo = Topology({**{r: Switch(r, 0, frozenset(ns)) for r, ns in racks.items()},
                     "core": Switch("core", 1, frozenset(), tuple(racks))})
    nodes = [n for ns in racks.values() for n in ns]
    spares = nodes[5::50]
    working = [n for n in nodes if n not in set(spares)]
    out = compute_placement(topo, dict(enumerate(working)), spares)
    load: dict[str, int] = dict.fromkeys(nodes, 0)
    for p in out.values():
        g = p.group
        assert not g.degraded and len({n[:n.index("n")] for n in
                                        (g.primary, g.log_backup, *g.ckpt_mirrors)}) == 3
        for b in (g.log_backup, *g.ckpt_mirrors):
            assert b is not None
            load[b] += 1
    assert max(load.values()) - min(load.values()) <= 1
