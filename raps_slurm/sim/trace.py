"""The simulated cluster and its failure trace, one model for every strategy.

The cluster is a finite set of nodes in racks (and power domains). Each node has its own
random stream (times to failure, then repair times, in the order the node lives them) and
each fault domain its own list of correlated events; :func:`node_timeline` turns them into
one list of failures and repairs that every strategy of a seed reads (common random
numbers). A failed node stays down until it is repaired, whichever strategy runs; what
differs is what the strategy does about it.
"""

from __future__ import annotations

import heapq
import math
import random
import re
from dataclasses import dataclass

from raps_slurm.errors import ScenarioError
from raps_slurm.model import Switch, Topology
from raps_slurm.sim.inputs import LoggedFailure, log_period
from raps_slurm.sim.scenario import Scenario, cluster_check


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


def even_split(total: int, parts: int) -> list[int]:
    """``total`` items in ``parts`` runs whose sizes differ by at most one, larger first."""
    q, extra = divmod(total, parts)
    return [q + 1 if i < extra else q for i in range(parts)]


def rack_sizes(s: Scenario, pool: int) -> list[int]:
    """Nodes per rack for a job of ``pool`` nodes (working + spares); ScenarioError when the
    cluster cannot hold it."""
    problems = cluster_check(s, pool - s.raps.spares)
    if problems:
        raise ScenarioError(problems)
    if s.cluster.rack_sizes:
        return list(s.cluster.rack_sizes)
    return even_split(pool + s.cluster.idle_nodes, s.cluster.racks)


def build_layout(s: Scenario, job_nodes: int | None = None, spares: int | None = None) -> Layout:
    """Nodes of the job (``job_nodes`` working + ``spares``) and the idle ones, in racks.

    Racks hold consecutive nodes (``cluster.racks`` sizes, or a count split evenly); power
    domains hold consecutive racks, split evenly. Spares are spread evenly over the job's
    nodes so that they sit in as many racks as possible, as an admin would ask Slurm for them.
    """
    n_work = s.job.nodes if job_nodes is None else job_nodes
    n_spare = s.raps.spares if spares is None else spares
    pool = n_work + n_spare
    sizes = rack_sizes(s, n_work + s.raps.spares)
    total = sum(sizes)
    width = max(4, len(str(total)))
    names = tuple(f"n{i:0{width}d}" for i in range(1, total + 1))
    rack: dict[str, str] = {}
    rack_index: dict[str, int] = {}
    i = 0
    for k, size in enumerate(sizes):
        for n in names[i:i + size]:
            rack[n] = f"rack{k + 1}"
            rack_index[n] = k
        i += size
    power: dict[str, str] = {}
    if s.cluster.power_domains:
        runs = even_split(len(sizes), min(s.cluster.power_domains, len(sizes)))
        pdu_of = [p for p, run in enumerate(runs) for _ in range(run)]
        power = {n: f"pdu{pdu_of[rack_index[n]] + 1}" for n in names}
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


def layout_warnings(s: Scenario, layout: Layout) -> list[str]:
    """Configurations where raps's spares can never be used, one line each.

    The planner relaunches a dead node's ranks on a spare outside its rack (unless
    ``raps.prefer_original_rack`` and the rest of the rack is healthy), so a working node
    whose rack holds every spare escalates to a whole-job requeue whenever it dies.
    """
    if not layout.spares or "raps" not in s.run.strategies:
        return []
    spare_racks = {layout.rack[n] for n in layout.spares}
    stuck = [n for n in layout.working if spare_racks == {layout.rack[n]}]
    if not stuck:
        return []
    if len(set(layout.rack.values())) == 1:
        head = "cluster.racks: one rack: every spare shares the rack of every working node"
    else:
        head = (f"raps.spares: all {len(layout.spares)} spares are in "
                f"{next(iter(spare_racks))}, the rack of {len(stuck)} of "
                f"{len(layout.working)} working nodes")
    if s.raps.prefer_original_rack:
        return [f"{head}; they are used only while the rest of that rack is healthy "
                f"(raps.prefer_original_rack)"]
    return [f"{head}; the planner never relaunches in a dead node's own rack, so their "
            f"failures requeue the whole job (describe the racks, spread the spares or set "
            f"raps.prefer_original_rack: true)"]


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

    def first_uptime(self) -> float:
        """Time to the node's first failure, for a node already in service: a Weibull node
        draws it from the equilibrium (forward-recurrence) distribution, the lambda x
        Gamma(1/k)^(1/k) whose density is the survival over the mean, so that a cluster
        does not start with every node new (with k < 1 that would put infant mortality on
        every node at once). An exponential node is memoryless: an ordinary uptime."""
        if self._shape and not math.isinf(self._mean):
            g = self._rng.gammavariate(1.0 / self._shape, 1.0)
            return float(self._scale * g ** (1.0 / self._shape))
        return self.uptime()

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


FAIL, REPAIR = "fail", "repair"


@dataclass(frozen=True)
class Outage:
    """One event of the cluster's failure trace: ``node`` fails or comes back at ``at``."""

    at: float
    kind: str       # FAIL or REPAIR
    node: str


MAX_OUTAGES = 5_000_000  # failures and repairs of one seed: about 1 GB of events


def expected_outages(s: Scenario, nodes: int, horizon: float) -> float:
    """Mean failures and repairs over ``horizon``: every node cycles through an uptime of
    ``mtbf_h`` and a repair of ``repair_h``."""
    cycle = (s.failures.mtbf_h + s.failures.repair_h) * 3600.0
    return 2.0 * nodes * horizon / cycle


def timeline_cap_error(s: Scenario, nodes: int, count: float) -> str:
    """One line: the failure timeline would be too long."""
    return (f"failures.mtbf_h: {s.failures.mtbf_h:g} h on {nodes} nodes over "
            f"{s.run.horizon_days:g} days makes about {count:.3g} failures and repairs (at "
            f"most {MAX_OUTAGES}); give a larger failures.mtbf_h, fewer nodes or a shorter "
            f"run.horizon_days")


def node_timeline(s: Scenario, layout: Layout, seed: int, horizon: float,
                  log: list[LoggedFailure] | None = None) -> list[Outage]:
    """Every node's failures and repairs up to ``horizon``, in time order (from the
    failure ``log`` when there is one, see :func:`log_timeline`).

    The same list serves every strategy of one seed (one cluster model): a node fails
    whether or not a job holds it, stays down for its repair time, then runs until its next
    failure. A domain event takes down the victims that are up (voiding their pending
    independent failure, which is drawn afresh after their repair).
    """
    if log is not None:
        return log_timeline(s, layout, seed, horizon, log)
    expected = expected_outages(s, len(layout.nodes), horizon)
    if expected > MAX_OUTAGES:
        raise ScenarioError([timeline_cap_error(s, len(layout.nodes), expected)])
    streams = {n: NodeStream(seed, n, s) for n in layout.nodes}
    gen = dict.fromkeys(layout.nodes, 0)
    down: set[str] = set()
    heap: list[tuple[float, int, str, str, int]] = []
    seq = 0

    def push(at: float, kind: str, node: str) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (at, seq, kind, node, gen[node]))

    for n in layout.nodes:
        push(streams[n].first_uptime(), FAIL, n)
    for ev in domain_events(s, layout, seed, horizon):
        seq += 1
        heapq.heappush(heap, (ev.at, seq, "domain", ",".join(ev.victims), -1))
    out: list[Outage] = []

    def fail(at: float, node: str) -> None:
        down.add(node)
        gen[node] += 1
        out.append(Outage(at, FAIL, node))
        push(at + streams[node].repair(), REPAIR, node)

    while heap and heap[0][0] < horizon:
        if len(out) > MAX_OUTAGES:  # the estimate is a mean: a seed may draw more
            raise ScenarioError([timeline_cap_error(s, len(layout.nodes), len(out))])
        at, _, kind, node, g = heapq.heappop(heap)
        if kind == "domain":
            for v in node.split(","):
                if v not in down:
                    fail(at, v)
        elif g != gen[node]:
            continue  # an independent failure voided by a domain event
        elif kind == FAIL:
            fail(at, node)
        else:
            down.discard(node)
            gen[node] += 1
            out.append(Outage(at, REPAIR, node))
            push(at + streams[node].uptime(), FAIL, node)
    return out


def _natural(name: str) -> tuple[object, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def by_number(names: list[str], nodes: tuple[str, ...]) -> list[int] | None:
    """Each logged name's node number when every name ends with a distinct one within the
    cluster (cn017 is the 17th node), else None."""
    numbers = [re.search(r"(\d+)$", n) for n in names]
    idx = [int(m.group(1)) for m in numbers if m]
    if len(idx) == len(names) and len(set(idx)) == len(idx) and \
            all(1 <= i <= len(nodes) for i in idx):
        return idx
    return None


def fold_warning(log: list[LoggedFailure], nodes: tuple[str, ...]) -> str | None:
    """One line when the log's nodes are folded onto the cluster's first ones (the log
    names nodes the cluster does not have, or names without distinct numbers)."""
    names = sorted({f.node for f in log}, key=_natural)
    if by_number(names, nodes) is not None or len(names) > len(nodes):
        return None
    return (f"failures.log: its {len(names)} node names do not all end with distinct "
            f"numbers within the cluster's {len(nodes)} nodes (a log of a larger machine?): "
            f"they are folded onto the first {len(names)} nodes in name order, so the "
            f"log's racks are not the scenario's")


def log_nodes(names: list[str], nodes: tuple[str, ...]) -> dict[str, str]:
    """The cluster node each logged node is: by the number its name ends with when every
    name has a distinct one within the cluster (cn017 is the 17th node, so the log's racks
    are the scenario's), else by natural order onto the first nodes
    (:func:`fold_warning` says so)."""
    idx = by_number(names, nodes)
    if idx is not None:
        return {n: nodes[i - 1] for n, i in zip(names, idx, strict=True)}
    if len(names) > len(nodes):
        raise ScenarioError([f"failures.log: the log names {len(names)} nodes, the cluster "
                             f"has {len(nodes)} (cluster.racks, cluster.idle_nodes)"])
    return dict(zip(names, nodes, strict=False))


def log_timeline(s: Scenario, layout: Layout, seed: int, horizon: float,
                 log: list[LoggedFailure]) -> list[Outage]:
    """Failures and repairs replayed from a failure log.

    The log's nodes are the cluster's by :func:`log_nodes`. The log repeats with a period
    of its span plus one mean gap; the first seed starts it at its first failure, every
    other seed at an offset drawn from the seed, so seeds see the same failures at other
    moments. A node
    stays down until the log's ``end`` or a repair time drawn from ``repair_h``; a failure
    logged while it is still down is part of the same outage.
    """
    node_of = log_nodes(sorted({f.node for f in log}, key=_natural), layout.nodes)
    period = log_period(log)
    cycles = math.ceil(horizon / period) + 1
    if cycles * len(log) > MAX_OUTAGES:
        raise ScenarioError([f"failures.log: {len(log)} failures in {period / 3600:.1f} h "
                             f"replayed over run.horizon_days make {cycles * len(log)} "
                             f"failures (at most {MAX_OUTAGES}); give a longer log or a shorter "
                             f"horizon"])
    offset = 0.0 if seed == s.run.seed else random.Random(f"{seed}/log").uniform(0, period)
    streams = {n: NodeStream(seed, n, s) for n in node_of.values()}
    up_at: dict[str, float] = {}
    out: list[Outage] = []
    occurrences = sorted((f.at + c * period - offset, k, f) for c in range(cycles)
                         for k, f in enumerate(log))
    for at, _, f in occurrences:
        if at < 0 or at >= horizon:
            continue
        node = node_of[f.node]
        if up_at.get(node, -1.0) > at:
            continue
        # At least a second down, so that a repair never sorts before its own failure.
        down = max(1.0, f.down_s if f.down_s is not None else streams[node].repair())
        up_at[node] = at + down
        out.append(Outage(at, FAIL, node))
        if at + down < horizon:
            out.append(Outage(at + down, REPAIR, node))
    out.sort(key=lambda o: (o.at, o.kind == FAIL, o.node))  # a node back, then new failures
    return out


def allocate(nodes: tuple[str, ...], down: set[str], previous: list[str], need: int
             ) -> list[str] | None:
    """``need`` live nodes for a requeued job: its own live ones first, then the
    lowest-numbered live others; None while the cluster has too few."""
    mine = [n for n in dict.fromkeys(previous) if n not in down]
    taken = set(mine)
    out = mine + [n for n in nodes if n not in down and n not in taken]
    return out[:need] if len(out) >= need else None
