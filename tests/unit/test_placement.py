"""Backup groups and spare order (raps_slurm.core.placement).

The checks below use their own brute-force reference (tiers over all node pairs), not
the module's class-level shortcuts, so a shortcut that misses a group shows up here.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raps_slurm.core.placement import (
    MAX_REPLICAS,
    compute_placement,
    domain_disjoint,
    fault_domain,
    order_spares,
    replace_dead_backups,
)
from raps_slurm.errors import PlacementError
from raps_slurm.model import BackupGroup, RankPlacement, Switch, Topology

# ---------------------------------------------------------------- building topologies


def make_topology(racks: Mapping[str, Sequence[str]], power: Mapping[str, str] | None = None,
                  spines: Mapping[str, Sequence[str]] | None = None) -> Topology:
    """Leaf switches (level 0) under a root; with ``spines``, racks hang off level-1 spines."""
    switches = {r: Switch(r, 0, frozenset(nodes)) for r, nodes in racks.items()}
    every = frozenset(n for nodes in racks.values() for n in nodes)
    if spines:
        for s, members in spines.items():
            held = frozenset(n for r in members for n in racks[r])
            switches[s] = Switch(s, 1, held, tuple(members))
        switches["root"] = Switch("root", 2, every, tuple(spines))
    else:
        switches["root"] = Switch("root", 1, every, tuple(racks))
    return Topology(switches, dict(power or {}))


# ---------------------------------------------------------------- reference model

FULL, RACK, RACK_ONLY, OFF_RACK, ONE_OFF, SAME_RACK = 5, 4, 3, 2, 1, 0


def rack(topo: Topology, n: str) -> str:
    found = topo.rack_of(n)
    assert found is not None
    return found


def disjoint(topo: Topology, a: str, b: str) -> bool:
    pa, pb = topo.power_domains.get(a), topo.power_domains.get(b)
    return rack(topo, a) != rack(topo, b) and not (pa is not None and pa == pb)


def pair_tier(topo: Topology, p: str, x: str) -> int:
    """Tier of a lone log backup ``x`` (replicas=1)."""
    if disjoint(topo, p, x):
        return FULL
    return RACK if rack(topo, p) != rack(topo, x) else SAME_RACK


def tier(topo: Topology, p: str, x: str, y: str) -> int:
    trio = (p, x, y)
    if len({rack(topo, n) for n in trio}) == 3:
        shared = sum(not disjoint(topo, a, b) for a, b in itertools.combinations(trio, 2))
        return {0: FULL, 1: RACK, 3: RACK_ONLY}[shared]
    return [SAME_RACK, ONE_OFF, OFF_RACK][sum(rack(topo, n) != rack(topo, p) for n in (x, y))]


def best_tier(topo: Topology, p: str, working: set[str]) -> int:
    others = sorted(working - {p})
    return max(tier(topo, p, x, y) for x, y in itertools.permutations(others, 2))


def backup_loads(result: Mapping[int, RankPlacement], working: set[str],
                 roles: int = 9) -> Counter[str]:
    """Backup roles per node, counting each group's first ``roles`` backups only."""
    load: Counter[str] = Counter(dict.fromkeys(working, 0))
    for pl in result.values():
        load.update(pl.group.members[1:1 + roles])
    return load


def spare_key(topo: Topology, p: str, s: str, prefer: bool,
              sick: set[str]) -> tuple[bool, bool, bool, int, str]:
    home = rack(topo, p)
    away = not (prefer and home not in sick and rack(topo, s) == home)
    is_sick = s in sick or rack(topo, s) in sick
    return is_sick, away, not disjoint(topo, p, s), topo.distance(p, s), s


# ---------------------------------------------------------------- table-driven examples

CONTIGUOUS = make_topology({"r1": ["n1", "n2"], "r2": ["n3", "n4"], "r3": ["n5", "n6"]})
INTERLEAVED = make_topology({"r1": ["n1", "n4"], "r2": ["n2", "n5"], "r3": ["n3", "n6"]})
FOUR_RANKS = {0: "n1", 1: "n2", 2: "n3", 3: "n4"}


def groups(result: Mapping[int, RankPlacement]) -> dict[int, tuple[str, ...]]:
    """Rank -> its backups: log backup, then mirrors."""
    return {r: p.group.members[1:] for r, p in result.items()}


def test_three_racks_groups_are_rack_disjoint() -> None:
    # n1..n4 span r1, r2, r3 here, so every group can use three racks.
    result = compute_placement(INTERLEAVED, FOUR_RANKS, ["n5", "n6"])
    for r, pl in result.items():
        g = pl.group
        assert g.primary == FOUR_RANKS[r]
        assert len({rack(INTERLEAVED, n) for n in g.members}) == 3
        assert not g.degraded and g.reason == ""
    # Spares outside the primary's rack first; equal hops, so then by name.
    assert [result[r].spares for r in range(4)] == [
        ("n5", "n6"), ("n6", "n5"), ("n5", "n6"), ("n5", "n6")]
    # Ranks on r1 (n1, n4) are backed up by one node of r2 and one of r3.
    for r in (0, 3):
        assert {rack(INTERLEAVED, n) for n in groups(result)[r]} == {"r2", "r3"}
    # 8 backup roles over the 6 nodes of the pool: loads within one.
    load = backup_loads(result, {"n1", "n2", "n3", "n4", "n5", "n6"})
    assert sorted(load.values()) == [1, 1, 1, 1, 2, 2], load


def test_spares_in_a_third_rack_make_groups_rack_disjoint() -> None:
    # n1..n4 fill r1 and r2 only; the spares n5, n6 (r3) hold the third copy.
    result = compute_placement(CONTIGUOUS, FOUR_RANKS, ["n5", "n6"])
    for r, pl in result.items():
        g = pl.group
        assert len({rack(CONTIGUOUS, n) for n in g.members}) == 3, (r, g)
        assert not g.degraded and g.reason == ""
        assert set(g.members[1:]) & {"n5", "n6"}
    load = backup_loads(result, {"n1", "n2", "n3", "n4", "n5", "n6"})
    assert max(load.values()) - min(load.values()) <= 1, load


def test_two_racks_are_degraded_with_reason() -> None:
    # Without spares, n1..n4 fill r1 and r2 only.
    result = compute_placement(CONTIGUOUS, FOUR_RANKS)
    assert groups(result) == {0: ("n3", "n4"), 1: ("n3", "n4"), 2: ("n1", "n2"), 3: ("n1", "n2")}
    for pl in result.values():
        assert pl.group.degraded
    assert result[0].group.reason == (
        "job spans 2 racks (r1, r2): log backup and checkpoint mirror share rack r2")
    assert result[2].group.reason.endswith("log backup and checkpoint mirror share rack r1")


def test_two_racks_one_node_off_rack() -> None:
    topo = make_topology({"r1": ["n1", "n2"], "r2": ["n3"]})
    result = compute_placement(topo, {0: "n1", 1: "n2", 2: "n3"})
    for pl in result.values():
        g = pl.group
        assert g.degraded and len(set(g.members)) == 3
        assert "job spans 2 racks (r1, r2)" in g.reason
        assert "n3" in g.members  # the one node off r1 is always used


def test_one_node_is_degraded() -> None:
    result = compute_placement(CONTIGUOUS, {0: "n1", 1: "n1"})
    for pl in result.values():
        assert pl.group.members == ("n1",)
        assert pl.group.log_backup is None and pl.group.ckpt_mirrors == ()
        assert pl.group.degraded
        assert pl.group.reason == "job has 1 node: no backup possible"
        assert pl.spares == ()


def test_one_rank_node_and_a_spare_back_up_to_the_spare() -> None:
    result = compute_placement(CONTIGUOUS, {0: "n1"}, ["n3"])
    g = result[0].group
    assert (g.log_backup, g.ckpt_mirrors, g.degraded) == ("n3", (), True)
    assert result[0].spares == ("n3",)


def test_two_nodes_have_no_mirror() -> None:
    result = compute_placement(CONTIGUOUS, {0: "n1", 1: "n2"})
    assert groups(result) == {0: ("n2",), 1: ("n1",)}
    assert result[0].group.reason == (
        "job has 2 nodes: no checkpoint mirror possible; primary and log backup share rack r1")


def test_power_domains_make_groups_fully_disjoint() -> None:
    power = {"n1": "p1", "n2": "p2", "n3": "p2", "n4": "p3", "n5": "p3", "n6": "p1"}
    topo = make_topology(CONTIGUOUS.racks(), power)
    result = compute_placement(topo, {i: f"n{i + 1}" for i in range(6)})
    # The only group for n1 in three racks and three power domains: n3 (p2), n5 (p3).
    assert set(result[0].group.members) == {"n1", "n3", "n5"}
    for pl in result.values():
        g = pl.group
        assert not g.degraded
        assert all(domain_disjoint(topo, a, b) for a, b in itertools.combinations(g.members, 2))


def test_two_power_domains_fall_back_to_rack_disjoint() -> None:
    power = {"n1": "A", "n2": "B", "n3": "A", "n4": "B", "n5": "A", "n6": "B"}
    topo = make_topology(CONTIGUOUS.racks(), power)
    result = compute_placement(topo, {i: f"n{i + 1}" for i in range(6)})
    for pl in result.values():
        g = pl.group
        assert g.degraded and "rack-disjoint only" in g.reason and "power domain" in g.reason
        assert len({rack(topo, n) for n in g.members}) == 3
        # Best left: only two of the three share a power domain, never all three.
        assert len({power[n] for n in g.members}) == 2


SPINES = make_topology(
    {"r1": ["a0", "a1", "a2"], "r2": ["b0", "b1"], "r3": ["c0", "c1"]},
    spines={"s1": ["r1", "r2"], "s2": ["r3"]},
)


def test_equal_load_prefers_fewer_switch_hops() -> None:
    # z0 shares spine s1 with a0 (2 hops); b0 and c0 sit behind s2 (3 hops).
    topo = make_topology({"ra": ["a0"], "rz": ["z0"], "rb": ["b0"], "rc": ["c0"]},
                         spines={"s1": ["ra", "rz"], "s2": ["rb", "rc"]})
    result = compute_placement(topo, {0: "a0", 1: "z0", 2: "b0", 3: "c0"})
    assert groups(result)[0] == ("z0", "b0")  # nearest first, then by name


@pytest.mark.parametrize(("prefer", "sick", "expected"), [
    (False, set(), ("b1", "c1", "a2")),         # off-rack first, nearer spine first
    (True, set(), ("a2", "b1", "c1")),          # original rack first
    (True, {"r1"}, ("b1", "c1", "a2")),         # original rack sick: as without prefer
    (False, {"b1"}, ("c1", "a2", "b1")),        # a sick spare goes last
    (True, {"r2"}, ("a2", "c1", "b1")),         # a sick rack's spares go last
])
def test_spare_order(prefer: bool, sick: set[str], expected: tuple[str, ...]) -> None:
    ranks = {0: "a0", 1: "a1", 2: "b0", 3: "c0"}
    result = compute_placement(SPINES, ranks, ["c1", "a2", "b1"],
                               prefer_original_rack=prefer, unhealthy=sick)
    assert result[0].spares == expected
    assert order_spares(SPINES, "a0", ["b1", "a2", "c1"], prefer_original_rack=prefer,
                        unhealthy=sick) == expected


@pytest.mark.parametrize(("ranks", "spares", "message"), [
    ({}, [], "rank map is empty"),
    ({0: "n1", 1: "zz"}, [], "rank 1: node 'zz' is not in any rack"),
    ({0: "n1"}, ["zz"], "spare 'zz' is not in any rack"),
    ({0: "n1", 1: "n2"}, ["n2"], "spare 'n2' also runs ranks"),
    ({0: "n1"}, ["n2", "n2"], "spare 'n2' is listed twice"),
    ({-1: "n1"}, [], "rank -1 is negative"),
])
def test_invalid_input(ranks: dict[int, str], spares: list[str], message: str) -> None:
    with pytest.raises(PlacementError) as err:
        compute_placement(CONTIGUOUS, ranks, spares)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- replica count

FOUR_RACKS = make_topology({"r1": ["n1", "n2"], "r2": ["n3", "n4"], "r3": ["n5", "n6"],
                            "r4": ["n7", "n8"]})


def test_replicas_zero_is_the_primary_alone() -> None:
    result = compute_placement(CONTIGUOUS, FOUR_RANKS, ["n5", "n6"], replicas=0)
    default = compute_placement(CONTIGUOUS, FOUR_RANKS, ["n5", "n6"])
    for r, pl in result.items():
        assert pl.group == BackupGroup(r, FOUR_RANKS[r], None, (), degraded=False, reason="")
        assert pl.group.members == (FOUR_RANKS[r],)
        assert pl.spares == default[r].spares  # spares do not depend on replicas
    # Even a 1-node job is complete: nothing was asked for.
    assert not compute_placement(CONTIGUOUS, {0: "n1"}, replicas=0)[0].group.degraded


def test_replicas_one_is_a_log_backup_only() -> None:
    result = compute_placement(CONTIGUOUS, FOUR_RANKS, ["n5", "n6"], replicas=1)
    # Off-rack, least loaded, then name; no room kept for a mirror.
    assert groups(result) == {0: ("n3",), 1: ("n4",), 2: ("n1",), 3: ("n2",)}
    for pl in result.values():
        assert pl.group.ckpt_mirrors == () and not pl.group.degraded and pl.group.reason == ""


def test_replicas_one_prefers_a_domain_disjoint_log_backup() -> None:
    power = {"n1": "A", "n2": "B", "n3": "A", "n4": "A", "n5": "B", "n6": "B"}
    topo = make_topology(CONTIGUOUS.racks(), power)
    # n3 is another rack but power domain A like n1; n5 differs in both.
    assert groups(compute_placement(topo, {0: "n1"}, ["n3", "n5"], replicas=1)) == {0: ("n5",)}
    # Only same-power nodes left: another rack still beats n1's own rack.
    assert groups(compute_placement(topo, {0: "n1"}, ["n2", "n3"], replicas=1)) == {0: ("n3",)}


def test_replicas_one_is_degraded_only_without_any_backup() -> None:
    same_rack = compute_placement(CONTIGUOUS, {0: "n1", 1: "n2"}, replicas=1)
    assert groups(same_rack) == {0: ("n2",), 1: ("n1",)}
    assert not any(pl.group.degraded for pl in same_rack.values())
    alone = compute_placement(CONTIGUOUS, {0: "n1"}, replicas=1)[0].group
    assert alone.members == ("n1",) and alone.degraded
    assert alone.reason == "job has 1 node: no backup possible"


def test_replicas_three_with_four_racks_are_rack_disjoint() -> None:
    result = compute_placement(FOUR_RACKS, FOUR_RANKS, ["n5", "n6", "n7", "n8"], replicas=3)
    two = compute_placement(FOUR_RACKS, FOUR_RANKS, ["n5", "n6", "n7", "n8"])
    for r, pl in result.items():
        g = pl.group
        assert len(g.ckpt_mirrors) == 2 and len(set(g.members)) == 4
        assert len({rack(FOUR_RACKS, n) for n in g.members}) == 4
        assert not g.degraded and g.reason == ""
        assert g.members[:3] == two[r].group.members  # first two copies as with replicas=2
    load = backup_loads(result, {f"n{i}" for i in range(1, 9)})
    assert sorted(load.values()) == [1, 1, 1, 1, 2, 2, 2, 2], load


def test_replicas_three_with_three_racks_share_a_rack() -> None:
    result = compute_placement(CONTIGUOUS, FOUR_RANKS, ["n5", "n6"], replicas=3)
    assert groups(result) == {0: ("n3", "n5", "n2"), 1: ("n4", "n6", "n1"),
                              2: ("n1", "n5", "n4"), 3: ("n2", "n6", "n3")}
    assert result[0].group.degraded
    assert result[0].group.reason == (
        "job spans 3 racks (r1, r2, r3): primary and checkpoint mirror 2 share rack r1")
    # 12 roles on 6 nodes; the greedy extra mirrors even the loads out here.
    assert set(backup_loads(result, {f"n{i}" for i in range(1, 7)}).values()) == {2}


def test_replicas_four_with_five_racks_are_rack_disjoint() -> None:
    topo = make_topology({f"r{i}": [f"n{i}", f"m{i}"] for i in range(1, 6)})
    result = compute_placement(topo, {i: f"n{i}" for i in range(1, 6)}, ["m1", "m3"],
                               replicas=4)
    for pl in result.values():
        g = pl.group
        assert len(g.ckpt_mirrors) == 3 and not g.degraded
        assert len({rack(topo, n) for n in g.members}) == 5


@pytest.mark.parametrize(("replicas", "ranks", "reason"), [
    (3, {0: "n1", 1: "n3", 2: "n5"}, "job has 3 nodes: 1 of 2 checkpoint mirrors possible"),
    (4, {0: "n1", 1: "n3", 2: "n5", 3: "n7"},
     "job has 4 nodes: 2 of 3 checkpoint mirrors possible"),
    (8, {0: "n1", 1: "n3", 2: "n5", 3: "n7"},
     "job has 4 nodes: 2 of 7 checkpoint mirrors possible"),
    (3, {0: "n1", 1: "n2"},
     "job has 2 nodes: 0 of 2 checkpoint mirrors possible; primary and log backup share rack r1"),
])
def test_too_few_nodes_for_all_mirrors(replicas: int, ranks: dict[int, str],
                                       reason: str) -> None:
    result = compute_placement(FOUR_RACKS, ranks, replicas=replicas)
    for pl in result.values():
        g = pl.group
        assert len(g.members) == len(ranks) and g.degraded and g.reason == reason


def test_extra_mirrors_sharing_power_are_degraded() -> None:
    topo = make_topology({f"r{i}": [f"n{i}"] for i in range(1, 5)},
                         {"n1": "A", "n2": "B", "n3": "A", "n4": "B"})
    g = compute_placement(topo, {i - 1: f"n{i}" for i in range(1, 5)}, replicas=3)[0].group
    assert g.members == ("n1", "n2", "n3", "n4") and g.degraded
    assert g.reason == ("rack-disjoint only: primary and checkpoint mirror 1 share power domain "
                        "A; log backup and checkpoint mirror 2 share power domain B")


@pytest.mark.parametrize("replicas", [-1, 9, 100, True, 2.0, "2", None])
def test_invalid_replicas(replicas: Any) -> None:
    with pytest.raises(PlacementError) as err:
        compute_placement(CONTIGUOUS, FOUR_RANKS, replicas=replicas)
    message = str(err.value)
    assert message == f"replicas: expected an integer 0-8, got {replicas!r}"
    assert MAX_REPLICAS == 8


def test_fault_domain() -> None:
    assert fault_domain(CONTIGUOUS, "n4") == "r2"
    with pytest.raises(PlacementError, match="not in any rack"):
        fault_domain(CONTIGUOUS, "nope")


# ---------------------------------------------------------------- property tests


@dataclass(frozen=True)
class Job:
    topo: Topology
    rank_nodes: dict[int, str]
    spares: list[str]
    prefer: bool
    sick: set[str]
    replicas: int = 2

    @property
    def pool(self) -> set[str]:
        """Where backups may go: the working nodes and the spares."""
        return set(self.rank_nodes.values()) | set(self.spares)

    def run(self) -> dict[int, RankPlacement]:
        return compute_placement(self.topo, self.rank_nodes, self.spares, replicas=self.replicas,
                                 prefer_original_rack=self.prefer, unhealthy=self.sick)


@st.composite
def jobs(draw: st.DrawFn) -> Job:
    """1-6 racks of 1-5 nodes, maybe spines, maybe (partial) power domains, random job."""
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    racks = {f"r{i}": [f"r{i}n{j}" for j in range(k)] for i, k in enumerate(sizes)}
    nodes = [n for ns in racks.values() for n in ns]
    power: dict[str, str] = {}
    if draw(st.booleans()):
        domains = draw(st.integers(1, 4))
        for n in nodes:
            pd = draw(st.one_of(st.none(), st.integers(0, domains - 1)))
            if pd is not None:
                power[n] = f"p{pd}"
    spines = None
    if len(racks) > 1 and draw(st.booleans()):
        cut = draw(st.integers(1, len(racks) - 1))
        names = list(racks)
        spines = {"s1": names[:cut], "s2": names[cut:]}
    roles = draw(st.lists(st.sampled_from("wws-"), min_size=len(nodes), max_size=len(nodes)))
    candidates = [n for n, role in zip(nodes, roles, strict=True) if role == "w"] or nodes[:1]
    rank_ids = sorted(draw(st.sets(st.integers(0, 500), min_size=1, max_size=24)))
    rank_nodes = {r: draw(st.sampled_from(candidates)) for r in rank_ids}
    used = set(rank_nodes.values())
    spares = [n for n, role in zip(nodes, roles, strict=True) if role == "s" and n not in used]
    sick = draw(st.sets(st.sampled_from([*racks, *nodes])))
    return Job(make_topology(racks, power, spines), rank_nodes, spares,
               draw(st.booleans()), sick)


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_groups_properties(job: Job) -> None:
    topo, working = job.topo, job.pool
    result = job.run()
    assert sorted(result) == sorted(job.rank_nodes)
    for r, pl in result.items():
        g = pl.group
        assert g.rank == r and g.primary == job.rank_nodes[r]
        assert len(set(g.members)) == len(g.members) == min(3, len(working))
        assert set(g.members) <= working
        assert (g.log_backup is None) == (len(working) == 1)
        assert bool(g.reason) == g.degraded
        if len(working) < 3:
            assert g.degraded
            continue
        assert g.log_backup is not None and len(g.ckpt_mirrors) == 1
        best = best_tier(topo, g.primary, working)
        assert tier(topo, g.primary, g.log_backup, g.ckpt_mirrors[0]) == best
        # Domain-disjoint (and not degraded) exactly when the working nodes allow it.
        assert g.degraded == (best < FULL)
        if not topo.power_domains and len({rack(topo, n) for n in working}) >= 3:
            assert not g.degraded


@settings(max_examples=300, deadline=None)
@given(jobs(), st.integers(0, MAX_REPLICAS))
def test_replica_count_properties(job: Job, replicas: int) -> None:
    topo, pool = job.topo, job.pool
    result = replace(job, replicas=replicas).run()
    two = job.run()
    enough_racks = len({rack(topo, n) for n in pool}) > replicas
    for r, pl in result.items():
        g = pl.group
        backups = g.members[1:]
        assert len(set(backups)) == len(backups) == min(replicas, len(pool) - 1)
        assert g.primary not in backups and set(backups) <= pool
        assert (g.log_backup is None) == (not backups)
        assert bool(g.reason) == g.degraded and "\n" not in g.reason
        assert pl.spares == two[r].spares
        if replicas == 0:
            assert not g.degraded
        elif replicas == 1:
            assert g.degraded == (len(pool) == 1)
        else:
            short = len(backups) < replicas
            apart = all(disjoint(topo, a, b) for a, b in itertools.combinations(g.members, 2))
            assert g.degraded == (short or not apart), g
            if short:
                assert g.reason.startswith(f"job has {len(pool)} node")
        if replicas >= 3:
            assert g.members[:3] == two[r].group.members
            # Each further mirror is as independent of the members before it as the pool allows.
            for k in range(3, len(g.members)):
                before, m = g.members[:k], g.members[k]
                free = pool - set(before)
                if not all(disjoint(topo, m, x) for x in before):
                    assert not any(all(disjoint(topo, c, x) for x in before) for c in free)
                if any(rack(topo, m) == rack(topo, x) for x in before):
                    assert not any(all(rack(topo, c) != rack(topo, x) for x in before)
                                   for c in free)
        if replicas >= 1 and enough_racks:
            assert len({rack(topo, n) for n in g.members}) == len(g.members)
            if replicas >= 2 and not topo.power_domains:
                assert not g.degraded


@pytest.mark.parametrize("replicas", [1, 2, 3])
@settings(max_examples=300, deadline=None)
@given(job=jobs())
def test_load_is_swap_stable(job: Job, replicas: int) -> None:
    """The log backup and first mirror; extra mirrors (replicas >= 3) are not counted."""
    topo, working = job.topo, job.pool
    result = replace(job, replicas=replicas).run()
    load = backup_loads(result, working, roles=2)
    for pl in result.values():
        g = pl.group
        if g.log_backup is None or (replicas >= 2 and not g.ckpt_mirrors):
            continue
        if replicas == 1:
            old = pair_tier(topo, g.primary, g.log_backup)
            for b in working - set(g.members):
                if pair_tier(topo, g.primary, b) >= old:
                    assert load[g.log_backup] <= load[b] + 1, (g, b, dict(load))
            continue
        x, y = g.log_backup, g.ckpt_mirrors[0]
        old = tier(topo, g.primary, x, y)
        for a, other in ((x, y), (y, x)):
            for b in working - {g.primary, x, y}:
                if tier(topo, g.primary, b, other) >= old:
                    assert load[a] <= load[b] + 1, (g, a, b, dict(load))
    if len({rack(topo, n) for n in working}) >= 3:  # the documented consequence
        by_class: dict[tuple[str, str | None], list[int]] = {}
        for n in working:
            key = (rack(topo, n), topo.power_domains.get(n))
            by_class.setdefault(key, []).append(load[n])
        for loads in by_class.values():
            assert max(loads) - min(loads) <= 1


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_spare_lists(job: Job) -> None:
    for pl in job.run().values():
        p = pl.group.primary
        assert sorted(pl.spares) == sorted(job.spares)
        keys = [spare_key(job.topo, p, s, job.prefer, job.sick) for s in pl.spares]
        assert keys == sorted(keys)
        if not job.sick and not job.prefer:  # the plain rule: outside the domain first
            outside = [domain_disjoint(job.topo, p, s) for s in pl.spares]
            assert outside == sorted(outside, reverse=True)


@settings(max_examples=200, deadline=None)
@given(jobs(), st.randoms(use_true_random=False), st.integers(0, MAX_REPLICAS))
def test_deterministic_under_shuffled_input(job: Job, rnd: random.Random,
                                            replicas: int) -> None:
    job = replace(job, replicas=replicas)
    def shuffled(d: Mapping[str, object]) -> list[str]:
        keys = list(d)
        rnd.shuffle(keys)
        return keys

    switches = {k: job.topo.switches[k] for k in shuffled(job.topo.switches)}
    power = {k: job.topo.power_domains[k] for k in shuffled(job.topo.power_domains)}
    ranks = list(job.rank_nodes)
    rnd.shuffle(ranks)
    spares, sick = list(job.spares), sorted(job.sick)
    rnd.shuffle(spares)
    rnd.shuffle(sick)
    again = compute_placement(Topology(switches, power), {r: job.rank_nodes[r] for r in ranks},
                              spares, replicas=replicas, prefer_original_rack=job.prefer,
                              unhealthy=sick)
    assert again == job.run()


def test_replace_dead_backups_prefers_disjoint_then_least_loaded() -> None:
    topo = make_topology({"r1": ["a1", "a2"], "r2": ["b1", "b2"], "r3": ["c1", "c2"]})
    g = BackupGroup(0, "a1", "b1", ("c1",))
    assert replace_dead_backups(topo, g, {"a2"}, ["a1", "a2", "b1", "b2", "c1", "c2"], {}) \
        is None
    new = replace_dead_backups(topo, g, {"c1"}, ["a1", "a2", "b1", "b2", "c1", "c2"], {})
    assert new is not None and new.ckpt_mirrors == ("c2",) and not new.degraded
    new = replace_dead_backups(topo, g, {"c1", "c2"}, ["a1", "a2", "b1", "b2", "c1", "c2"],
                               {"a2": 3})
    assert new is not None and new.ckpt_mirrors == ("b2",)  # no disjoint node: least loaded
    new = replace_dead_backups(topo, g, {"b1", "c1"}, ["a1", "b1", "c1"], {})
    assert new is not None and new.log_backup is None and new.ckpt_mirrors == ()
    assert new.degraded and "too few live nodes" in new.reason


def test_spares_kept_from_backups_hold_none_and_come_last() -> None:
    # n5 (rack r3) would be the mirror of n1's and n3's groups, were it not kept off
    out = compute_placement(CONTIGUOUS, {0: "n1", 1: "n3"}, ["n5", "n2", "n6"],
                            no_backups={"n5"})
    for p in out.values():
        assert "n5" not in p.group.members
        assert p.spares[-1] == "n5"
    with pytest.raises(PlacementError, match="only a spare can be kept from backups"):
        compute_placement(CONTIGUOUS, {0: "n1"}, ["n3"], no_backups={"n1"})

