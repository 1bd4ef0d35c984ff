"""Rack, power domain and hop lookups of one topology, and spare orders on uniform trees:
pure, no I/O (the helpers of :mod:`raps_slurm.core.placement`)."""

from __future__ import annotations

from raps_slurm.errors import PlacementError
from raps_slurm.model import Topology

Class = tuple[str, str | None]  # (rack, power domain); disjointness depends on nothing else


class Domains:
    """Rack and power lookups with a distance cache (Topology recomputes on each call)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.rack: dict[str, str] = {}
        for name, nodes in sorted(topology.racks().items()):
            for n in nodes:
                self.rack.setdefault(n, name)  # a node in two racks: first by name wins
        self._dist: dict[tuple[str, str], int] = {}
        self._near: dict[str, int] = {}
        racks = topology.racks()
        self._members = {r: frozenset(ns) for r, ns in racks.items()}
        # A node listed in two racks is one hop from nodes of another rack's class.
        self._shared = sum(len(ns) for ns in racks.values()) != len(self.rack)
        self._upper = [s for s in topology.switches.values() if s.switches]
        self._top = max((s.level for s in topology.switches.values()), default=0)
        # Uniform: every upper switch holds all racked nodes or none, so any two nodes of
        # different racks are `far` hops apart and of one rack `same[rack]`; spare orders
        # and hops then need no per-pair lookup (the common tree: one core switch).
        racked = frozenset(self.rack)
        full = [s.level + 1 for s in self._upper if racked <= s.nodes]
        self.uniform = not self._shared and all(
            racked <= s.nodes or racked.isdisjoint(s.nodes) for s in self._upper)
        self.far = min(full, default=self._top + 2)
        self.same = {r: min([topology.switches[r].level + 1, *full]) for r in racks}
        self.spares: dict[tuple[tuple[str, ...], frozenset[str]], SpareSplit] = {}

    def near(self, a: str) -> int:
        """A lower bound of dist(a, b) for every b outside a's rack: an ordered scan
        stops at the first candidate that close instead of looking at every rack."""
        ra = self.rack[a]
        if ra not in self._near:
            mine = self._members[ra]
            self._near[ra] = 1 if self._shared else min(
                (s.level + 1 for s in self._upper if not mine.isdisjoint(s.nodes)),
                default=self._top + 2)
        return self._near[ra]

    def rack_of(self, node: str, what: str) -> str:
        """The rack of ``node``; PlacementError naming it as ``what`` if it is in none."""
        if node not in self.rack:
            raise PlacementError(f"{what} {node!r} is not in any rack of the topology")
        return self.rack[node]

    def cls(self, node: str) -> Class:
        """(rack, power domain or None) of ``node``."""
        return self.rack_of(node, "node"), self.topology.power_domains.get(node)

    @staticmethod
    def disjoint(a: Class, b: Class) -> bool:
        """Different racks and, where both are known, different power domains."""
        return a[0] != b[0] and (a[1] is None or b[1] is None or a[1] != b[1])

    def dist(self, a: str, b: str) -> int:
        """Switch hops between two racked nodes, as Topology.distance."""
        # Upper switches hold whole racks (topology.conf: Nodes= or Switches=), so the
        # hops between two distinct nodes depend on their racks only.
        if a == b:
            return 0
        ra, rb = self.rack[a], self.rack[b]
        if self.uniform:
            return self.same[ra] if ra == rb else self.far
        key = (ra, rb) if ra <= rb else (rb, ra)
        if key not in self._dist:
            self._dist[key] = self.topology.distance(a, b)
        return self._dist[key]


_CACHE: dict[int, tuple[Topology, Domains]] = {}


def domains(topology: Topology) -> Domains:
    """The lookups of a topology, kept for the next call (a Topology is immutable)."""
    hit = _CACHE.get(id(topology))
    if hit is not None and hit[0] is topology:
        return hit[1]
    if len(_CACHE) >= 8:
        _CACHE.clear()
    d = Domains(topology)
    _CACHE[id(topology)] = (topology, d)
    return d


class SpareSplit:
    """One spare list split for ordering: by name, by rack, by power domain, sick ones."""

    def __init__(self, d: Domains, spares: tuple[str, ...], unhealthy: frozenset[str]) -> None:
        self.names = sorted(set(spares))
        self.sick = {s for s in self.names if s in unhealthy or d.rack[s] in unhealthy}
        self.by_rack: dict[str, list[str]] = {}
        self.by_power: dict[str, list[str]] = {}
        for s in self.names:
            self.by_rack.setdefault(d.rack[s], []).append(s)
            pw = d.topology.power_domains.get(s)
            if pw is not None:
                self.by_power.setdefault(pw, []).append(s)


def order_uniform(d: Domains, primary: str, ix: SpareSplit, prefer_home: bool
                   ) -> tuple[str, ...]:
    """_order_spares when hops depend only on same rack or not: the spares sharing the
    primary's rack or power domain are the only ones out of name order."""
    home, pw = d.cls(primary)
    same = ix.by_rack.get(home, [])
    near_pw = [s for s in ix.by_power.get(pw, ()) if d.rack[s] != home] if pw is not None else []
    special = {*same, *near_pw}
    rest = [s for s in ix.names if s not in special] if special else ix.names
    groups: dict[tuple[bool, bool, int], list[str]] = {}
    for k, members in (((not prefer_home, True, d.same[home]), [s for s in same if s != primary]),
                       ((not prefer_home, True, 0), [primary] if primary in special else []),
                       ((True, True, d.far), near_pw), ((True, False, d.far), rest)):
        if members:
            groups[k] = sorted(groups[k] + members) if k in groups else members
    ordered = [groups[k] for k in sorted(groups)]
    if not ix.sick:
        return tuple(s for g in ordered for s in g)
    return (*(s for g in ordered for s in g if s not in ix.sick),
            *(s for g in ordered for s in g if s in ix.sick))
