"""The simulated cluster and its failure trace.

Every strategy of one seed sees the same trace through common random numbers: each
node has its own random stream (times to failure, then repair times, in the order the
node lives them) and each fault domain its own list of correlated events, so a node's
n-th failure is drawn from the same numbers whichever strategy asks for it. What differs
is what the strategy does with a failed node: ``global`` and ``scr`` give the job a
fresh node at once (the requeued job is placed elsewhere, so its next failure counts
from the restart), ``raps`` keeps the node down until it is repaired.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from raps_slurm.model import Switch, Topology
from raps_slurm.sim.scenario import Scenario


@dataclass(frozen=True)
class Layout:
    """Node names, racks and power domains; the job's first allocation."""

    nodes: tuple[str, ...]
    rack: dict[str, str]
    power: dict[str, str]
    working: tuple[str, ...]        # the job's working nodes, in rank order
    spares: tuple[str, ...]
    topology: Topology

    def domain_members(self, scope: str) -> dict[str, tuple[str, ...]]:
        """Rack or power domain -> its nodes."""
        src = self.rack if scope == "rack" else self.power
        out: dict[str, list[str]] = {}
        for n in self.nodes:
            if n in src:
                out.setdefault(src[n], []).append(n)
        return {d: tuple(ns) for d, ns in out.items()}


def build_layout(s: Scenario, job_nodes: int | None = None, spares: int | None = None) -> Layout:
    """Nodes of the job (``job_nodes`` working + ``spares``) and the idle ones, in racks.

    Racks hold consecutive nodes; spares are spread evenly over the job's nodes so that
    they sit in as many racks as possible, as an admin would ask Slurm for them.
    """
    n_work = s.job.nodes if job_nodes is None else job_nodes
    n_spare = s.raps.spares if spares is None else spares
    pool = n_work + n_spare
    total = pool + s.cluster.idle_nodes
    width = max(4, len(str(total)))
    names = tuple(f"n{i:0{width}d}" for i in range(1, total + 1))
    racks = min(s.cluster.racks, total)
    per = math.ceil(total / racks)
    rack = {n: f"rack{i // per + 1}" for i, n in enumerate(names)}
    n_racks = math.ceil(total / per)
    power: dict[str, str] = {}
    if s.cluster.power_domains:
        pd = min(s.cluster.power_domains, n_racks)
        per_pd = math.ceil(n_racks / pd)
        power = {n: f"pdu{(int(rack[n][4:]) - 1) // per_pd + 1}" for n in names}
    spare_pos = {min(pool - 1, int((j + 0.5) * pool / n_spare)) for j in range(n_spare)} \
        if n_spare else set()
    j = 0
    while len(spare_pos) < n_spare:  # rounding collisions: fill the first free slots
        spare_pos.add(j)
        j += 1
    spare_names = tuple(names[i] for i in sorted(spare_pos))
    working = tuple(names[i] for i in range(pool) if i not in spare_pos)
    switches = {}
    members: dict[str, set[str]] = {}
    for n, r in rack.items():
        members.setdefault(r, set()).add(n)
    for r, ns in members.items():
        switches[r] = Switch(r, 0, frozenset(ns))
    switches["core"] = Switch("core", 1, frozenset(), tuple(sorted(members)))
    return Layout(names, rack, power, working, spare_names,
                  Topology(switches, power_domains=dict(power)))


class NodeStream:
    """One node's random numbers: times to failure and repair times, in seconds."""

    __slots__ = ("_mean", "_repair", "_rng", "_scale", "_shape")

    def __init__(self, seed: int, node: str, s: Scenario) -> None:
        self._rng = random.Random(f"{seed}/{node}")
        f = s.failures
        indep = 1.0 - f.correlated_share
        self._mean = math.inf if indep <= 0 else f.mtbf_h * 3600.0 / indep
        self._shape = f.weibull_shape if f.distribution == "weibull" else 0.0
        self._scale = self._mean / math.gamma(1.0 + 1.0 / self._shape) if self._shape else 0.0
        self._repair = f.repair_h * 3600.0

    def uptime(self) -> float:
        """Time from (re)start to the node's next independent failure."""
        if math.isinf(self._mean):
            self._rng.random()
            return math.inf
        if self._shape:
            return self._rng.weibullvariate(self._scale, self._shape)
        return self._rng.expovariate(1.0 / self._mean)

    def repair(self) -> float:
        """How long the node stays down."""
        return self._rng.expovariate(1.0 / self._repair) if self._repair > 0 else \
            (self._rng.random() * 0.0)


@dataclass(frozen=True)
class DomainEvent:
    """A correlated failure: ``victims`` of ``domain`` fail at ``at``."""

    at: float
    domain: str
    victims: tuple[str, ...]


def domain_events(s: Scenario, layout: Layout, seed: int, horizon: float) -> list[DomainEvent]:
    """Correlated events up to ``horizon``, each domain from its own random stream.

    A domain of m nodes losing v per event gets events at rate share x m / (MTBF x v), so
    that correlated events cause ``correlated_share`` of every node's failures.
    """
    f = s.failures
    if f.correlated_share <= 0:
        return []
    out: list[DomainEvent] = []
    for dom, members in sorted(layout.domain_members(f.correlated_scope).items()):
        m = len(members)
        v = min(m, f.correlated_nodes or m)
        rate = f.correlated_share * m / (f.mtbf_h * 3600.0 * v)
        rng = random.Random(f"{seed}/domain/{dom}")
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= horizon:
                break
            victims = tuple(sorted(rng.sample(members, v))) if v < m else members
            out.append(DomainEvent(t, dom, victims))
    out.sort(key=lambda e: (e.at, e.domain))
    return out


class SlotFailures:
    """Failures of a job that is given a fresh node for every failed one (global, scr).

    Slot i is the job's i-th node position; its failures are the node's stream with no
    repair time (the requeued job runs elsewhere). Correlated events hit the slots whose
    node is in the event's domain and restart their clocks.
    """

    def __init__(self, s: Scenario, layout: Layout, seed: int, horizon: float,
                 slots: tuple[str, ...]) -> None:
        self._streams = {n: NodeStream(seed, n, s) for n in slots}
        self._current = dict.fromkeys(slots, 0)  # the valid heap entry's number per slot
        self._heap: list[tuple[float, int, str]] = [
            (st.uptime(), 0, n) for n, st in self._streams.items()]
        heapq.heapify(self._heap)
        self._events = [e for e in domain_events(s, layout, seed, horizon)
                        if any(v in self._streams for v in e.victims)]
        self._ei = 0
        self.failures = 0  # node failures consumed (several may stop the job once)

    def _restart(self, node: str, at: float) -> None:
        st = self._streams[node]
        st.repair()  # consumed so the stream stays aligned with what raps draws
        self._current[node] += 1
        heapq.heappush(self._heap, (at + st.uptime(), self._current[node], node))

    def next_after(self, t: float) -> float:
        """Time of the first failure after ``t``; every failure up to ``t`` is consumed."""
        heap = self._heap
        while True:
            while heap and heap[0][1] != self._current[heap[0][2]]:
                heapq.heappop(heap)  # superseded by a correlated event's restart
            ft = heap[0][0] if heap else math.inf
            et = self._events[self._ei].at if self._ei < len(self._events) else math.inf
            nxt = min(ft, et)
            if nxt > t:
                return nxt
            if et <= ft:
                ev = self._events[self._ei]
                self._ei += 1
                for v in ev.victims:
                    if v in self._streams:
                        self.failures += 1
                        self._restart(v, ev.at)
            else:
                at, _, node = heapq.heappop(heap)
                self.failures += 1
                self._restart(node, at)
