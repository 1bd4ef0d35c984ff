"""Backup groups and spare order for one job: pure, deterministic, no I/O.

Vocabulary. The *working nodes* run the job's ranks (the values of the rank map);
the *spares* are the idle nodes the job allocated for relaunches; together they are
the job's *pool* (minus spares kept from backups, ``no_backups``: a spare whose agent
cannot serve now). A node's *fault domain* is its rack (leaf switch). Two nodes are
*domain-disjoint* when they sit in different racks and, if both power domains are
known, in different power domains (a node with no known power domain is compared by
rack only).

Replica count. ``replicas`` (``checkpoint.replica_count`` or ``--raps-replicas``, 0-8,
default 2) counts the copies besides the primary: the log backup is copy 1 and copies
2..N are checkpoint mirrors, so a group has up to N-1 mirrors. With 0 the group is the
primary alone and not degraded.

Backup groups. Each rank's group is its primary (its node) and its backups.
Backups are chosen in the whole pool, spares included: a spare's disk and network are
idle, so backup traffic there steals nothing from computing ranks; a spare that holds
a rank's checkpoint is the cheapest place to relaunch that rank (no transfer); and the
coordinator can pick spares in racks the ranks do not use, which makes the groups
rack-disjoint. A spare taken for a relaunch keeps the copies it holds.

Two copies (the default; for N >= 3 the log backup and the first mirror). Every group
reaches the best tier its primary allows within the pool:

  FULL       members pairwise domain-disjoint               (degraded=False)
  RACK       pairwise rack-disjoint, two members share a power domain
  RACK_ONLY  pairwise rack-disjoint, all three share a power domain
  OFF_RACK   both backups outside the primary's rack, sharing one (job on 2 racks)
  ONE_OFF    one backup outside the primary's rack
  SAME_RACK  three distinct nodes in one rack
Power domains refine only rack-disjoint groups; below that, racks alone decide.
With 2 nodes in the pool there is no mirror, with 1 no backup at all. Anything short
of a FULL, complete group has degraded=True and a one-line reason.

One copy. The log backup alone, at the best of: domain-disjoint from the primary,
in another rack, in the primary's rack (no room for a mirror is needed). Only a 1-node
pool, which allows no backup, makes the group degraded.

Three or more copies. Log backup and first mirror as for two copies; then each further
mirror, greedily in rank order and mirror order: a pool node not in the group,
domain-disjoint from every member if one is, else rack-disjoint from every member if
one is, then least loaded, then fewest hops from the primary, then name. The group is
degraded when the pool has too few nodes for N-1 mirrors or when two members are not
domain-disjoint. Greedy, not optimal: the first two backups are fixed before the others,
so a pool that could hold a pairwise domain-disjoint group of N+1 may not get one.

Balance guarantee. load(n) counts the backup roles (log backup or a mirror) that pool
node n holds; nodes holding none have load 0. For N <= 2 it is guaranteed
(*swap-stability*): for every group and each of its backups ``a``, every pool node
``b`` that could take a's role instead -- ``b`` is not in the group and the group keeps
its tier -- has ``load(b) >= load(a) - 1``. So no single reassignment can narrow the
gap between two nodes. Consequence: when the pool spans three or more racks,
nodes sharing rack and power domain have loads within one of each other (without
power domains: loads are balanced within one inside each rack). Construction: greedy
in rank order (least loaded eligible node, then fewest switch hops from the primary,
then name: fault independence is already fixed by the tier, so fewer hops just means
cheaper log traffic), then single-role moves to a node at least two lighter until none is left;
each move lowers the sum of squared loads, so the loop ends. For N >= 3 the guarantee
holds for loads counting log backups and first mirrors only, because that balancing
pass runs before further mirrors exist; those go to the least loaded of the equally
independent candidates when picked, with no swap-stability guarantee.

Spare order. Every rank gets all the job's spares: healthy spares first (a spare is
unhealthy when it or its rack is listed in ``unhealthy``, or it is in ``no_backups``), then -- with
``prefer_original_rack`` and the primary's rack healthy -- spares in the primary's
rack, then spares domain-disjoint from the primary, then fewer switch hops (cheaper
chunk transfer), then name.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Iterator, Mapping

from raps_slurm.core.domains import Class as _Class
from raps_slurm.core.domains import Domains as _Domains
from raps_slurm.core.domains import SpareSplit, order_uniform
from raps_slurm.core.domains import domains as _domains
from raps_slurm.errors import PlacementError
from raps_slurm.model import BackupGroup, RankPlacement, Topology

FULL, RACK, RACK_ONLY, OFF_RACK, ONE_OFF, SAME_RACK = 5, 4, 3, 2, 1, 0
MAX_REPLICAS = 8


def fault_domain(topology: Topology, node: str) -> str:
    """The rack (leaf switch) of ``node``; PlacementError if it is in no rack."""
    return _domains(topology).rack_of(node, "node")


def domain_disjoint(topology: Topology, a: str, b: str) -> bool:
    """True when ``a`` and ``b`` differ in rack and, where both are known, power domain."""
    d = _domains(topology)
    return d.disjoint(d.cls(a), d.cls(b))


def _class_tier(cp: _Class, cx: _Class, cy: _Class) -> int:
    """Tier of a group whose primary, log backup and mirror have these classes."""
    if len({cp[0], cx[0], cy[0]}) == 3:
        known = [c[1] for c in (cp, cx, cy) if c[1] is not None]
        # Equal power domains are transitive: 0, 1 or all 3 pairs share one.
        return (FULL, RACK, RACK_ONLY)[len(known) - len(set(known))]
    off = (cx[0] != cp[0]) + (cy[0] != cp[0])
    return (SAME_RACK, ONE_OFF, OFF_RACK)[off]


def _pair_tier(cp: _Class, cx: _Class) -> int:
    """Tier of a lone log backup of class ``cx`` for a primary of class ``cp``."""
    if _Domains.disjoint(cp, cx):
        return FULL
    return RACK if cp[0] != cx[0] else SAME_RACK


def order_spares(topology: Topology, primary: str, spares: Iterable[str], *,
                 prefer_original_rack: bool = False,
                 unhealthy: Collection[str] = frozenset()) -> tuple[str, ...]:
    """All ``spares`` ordered for a relaunch of a rank that ran on ``primary``."""
    d = _domains(topology)
    d.rack_of(primary, "node")
    spares = tuple(spares)
    sick = frozenset(unhealthy)
    if (spares, sick) not in d.spares:  # a cached split was made of checked spares
        for s in spares:
            d.rack_of(s, "spare")
    return _order_spares(d, primary, spares, prefer_original_rack, sick)


def _order_spares(d: _Domains, primary: str, spares: Iterable[str], prefer: bool,
                  unhealthy: frozenset[str]) -> tuple[str, ...]:
    home = d.rack[primary]
    pc = d.cls(primary)
    prefer_home = prefer and home not in unhealthy
    if d.uniform:
        key_ = (tuple(spares), unhealthy)
        ix = d.spares.get(key_)
        if ix is None:
            if len(d.spares) >= 4:
                d.spares.clear()
            ix = d.spares[key_] = SpareSplit(d, key_[0], unhealthy)
        return order_uniform(d, primary, ix, prefer_home)

    def key(s: str) -> tuple[bool, bool, bool, int, str]:
        sick = s in unhealthy or d.rack[s] in unhealthy
        away = not (prefer_home and d.rack[s] == home)
        return sick, away, not d.disjoint(pc, d.cls(s)), d.dist(primary, s), s

    return tuple(sorted(set(spares), key=key))


def compute_placement(topology: Topology, rank_nodes: Mapping[int, str],
                      spares: Iterable[str] = (), *, replicas: int = 2,
                      prefer_original_rack: bool = False,
                      unhealthy: Collection[str] = frozenset(),
                      no_backups: Collection[str] = frozenset()) -> dict[int, RankPlacement]:
    """Backup group and ordered spare list for every rank of one job.

    ``rank_nodes`` maps rank -> node (several ranks may share a node); ``replicas`` is
    the number of copies besides the primary (0-8: log backup, then mirrors);
    ``unhealthy`` names racks or nodes known to be sick (default: all healthy); it orders
    spares only, backups are drawn from working nodes and spares whatever their health
    (re-plan after a drain). ``no_backups`` names spares that hold no backup role and
    come last in every spare order: their agent cannot serve now (none registered, or
    the node is draining), so they are spares only should they recover. Raises
    PlacementError on a replica count that is not an integer 0-8, an empty rank map, a
    negative rank, a node or spare missing from the topology, a spare listed twice, a
    spare that also runs ranks or a node in ``no_backups`` that is no spare.
    """
    if (isinstance(replicas, bool) or not isinstance(replicas, int)
            or not 0 <= replicas <= MAX_REPLICAS):
        raise PlacementError(f"replicas: expected an integer 0-{MAX_REPLICAS}, got {replicas!r}")
    d = _domains(topology)
    ranks, working, spare_list = _validate(d, rank_nodes, spares)
    outside = sorted(set(no_backups) - set(spare_list))
    if outside:
        raise PlacementError(f"{', '.join(outside)}: only a spare can be kept from backups")
    sick = frozenset(unhealthy) | frozenset(no_backups)
    pool = sorted({*working, *spare_list} - set(no_backups))
    loads = BackupLoads(d, pool)
    backups = _assign_backups(d, ranks, pool, rank_nodes, loads, min(replicas, 2))
    if replicas > 2:
        _add_mirrors(d, ranks, rank_nodes, backups, loads, replicas - 2)
    racks = sorted({d.rack[n] for n in pool})
    out: dict[int, RankPlacement] = {}
    # A spare order depends on the primary's rack and power domain only (spares never
    # run ranks, so no spare is the primary): one sort per class, not per rank.
    orders: dict[tuple[_Class, bool], tuple[str, ...]] = {}
    for r in ranks:
        p, chosen = rank_nodes[r], backups[r]
        reason = _reason(d, p, chosen, replicas, racks, len(pool))
        group = BackupGroup(r, p, chosen[0] if chosen else None, tuple(chosen[1:]),
                            degraded=bool(reason), reason=reason)
        ck = (d.cls(p), p in sick)
        if ck not in orders:
            orders[ck] = _order_spares(d, p, spare_list, prefer_original_rack, sick)
        out[r] = RankPlacement(group, orders[ck])
    return out


def _validate(d: _Domains, rank_nodes: Mapping[int, str],
              spares: Iterable[str]) -> tuple[list[int], list[str], list[str]]:
    if not rank_nodes:
        raise PlacementError("rank map is empty: a job needs at least one rank")
    for r, n in rank_nodes.items():
        if isinstance(r, bool) or not isinstance(r, int):
            raise PlacementError(f"rank {r!r} is not an integer")
        if r < 0:
            raise PlacementError(f"rank {r} is negative")
        d.rack_of(n, f"rank {r}: node")
    working = set(rank_nodes.values())
    spare_list = list(spares)
    seen: set[str] = set()
    for s in spare_list:
        d.rack_of(s, "spare")
        if s in working:
            raise PlacementError(f"spare {s!r} also runs ranks: a spare must be idle")
        if s in seen:
            raise PlacementError(f"spare {s!r} is listed twice")
        seen.add(s)
    return sorted(rank_nodes), sorted(working), spare_list


class BackupLoads:
    """Backup roles per pool node; each class keeps its nodes sorted by (load, name).

    Tiers and disjointness depend on (rack, power) classes only, and all nodes of a class
    are equally far from any primary (see dist), so a class's least-loaded node outside
    the group is its only contender. The classes' heads are also kept in (load, name)
    order: a pick walks them from the lightest and stops once no later head can beat its
    best (no lighter load left, and the best already as few hops away as any node outside
    the primary's rack can be), a few classes where a scan of all would cost O(classes).
    Build one with :meth:`of` to hand to :func:`replace_dead_backups` for many groups of
    one job.
    """

    def __init__(self, d: _Domains, pool: Iterable[str],
                 initial: Mapping[str, int] | None = None) -> None:
        nodes = sorted(set(pool))
        self.domains = d
        self.cls = {n: d.cls(n) for n in nodes}
        self.load = {n: (initial.get(n, 0) if initial else 0) for n in nodes}
        self.by_class: dict[_Class, list[tuple[int, str]]] = {}
        self.count: dict[int, int] = {}  # nodes per load value, for the lightest load
        for n in nodes:
            self.by_class.setdefault(self.cls[n], []).append((self.load[n], n))
            self.count[self.load[n]] = self.count.get(self.load[n], 0) + 1
        for entries in self.by_class.values():
            entries.sort()
        # Every class's head (its (load, name)-first node) by load, then name: a pick scans
        # these in order and stops once no later class can win, not after every class.
        self.heads: dict[int, list[tuple[str, _Class]]] = {}
        for c, entries in self.by_class.items():
            self.heads.setdefault(entries[0][0], []).append((entries[0][1], c))
        for row in self.heads.values():
            row.sort()

    def ordered(self) -> Iterator[tuple[int, str, _Class]]:
        """(load, name, class) of every class's head, lightest then by name."""
        for load in sorted(self.heads):
            for name, c in self.heads[load]:
                yield load, name, c

    @classmethod
    def of(cls, topology: Topology, pool: Iterable[str],
           loads: Mapping[str, int]) -> BackupLoads:
        """The pool's nodes that sit in a rack of ``topology``, with their current loads."""
        d = _domains(topology)
        return cls(d, [n for n in pool if n in d.rack], loads)

    def lightest(self) -> int:
        """The smallest load of any pool node."""
        return min(v for v, c in self.count.items() if c)

    def head(self, c: _Class, skip: Collection[str]) -> tuple[int, str] | None:
        """The (load, name)-first node of class ``c`` not in ``skip``."""
        for entry in self.by_class[c]:
            if entry[1] not in skip:
                return entry
        return None

    def bump(self, n: str, delta: int) -> None:
        """Add ``delta`` roles to pool node ``n``."""
        c = self.cls[n]
        nodes = self.by_class[c]
        before = nodes[0]
        nodes.remove((self.load[n], n))
        self.count[self.load[n]] -= 1
        self.load[n] += delta
        self.count[self.load[n]] = self.count.get(self.load[n], 0) + 1
        bisect.insort(nodes, (self.load[n], n))
        if nodes[0] != before:
            row = self.heads[before[0]]
            del row[bisect.bisect_left(row, (before[1], c))]
            if not row:
                del self.heads[before[0]]
            bisect.insort(self.heads.setdefault(nodes[0][0], []), (nodes[0][1], c))


def _assign_backups(d: _Domains, ranks: list[int], pool: list[str],
                    rank_nodes: Mapping[int, str], loads: BackupLoads,
                    roles: int) -> dict[int, list[str]]:
    """Log backup (``roles`` >= 1) and first mirror (``roles`` == 2) of every rank, balanced."""
    if roles == 0 or len(pool) <= roles:  # no choice: the other node, if any, is the log backup
        out: dict[int, list[str]] = {}
        for r in ranks:
            out[r] = [n for n in pool if n != rank_nodes[r]][:roles]
            for n in out[r]:
                loads.bump(n, 1)
        return out

    cls, by_class = loads.cls, loads.by_class
    size = {c: len(nodes) for c, nodes in by_class.items()}
    classes = sorted(size, key=str)
    best_cache: dict[_Class, int] = {}
    room: dict[tuple[_Class, _Class], int] = {}  # best tier once (p, x) are fixed

    def free(c: _Class, *taken: _Class) -> bool:
        return size[c] > sum(c == t for t in taken)

    def best_of(tiers: Iterable[int]) -> int:
        best = -1
        for t in tiers:
            best = max(best, t)
            if best == FULL:  # nothing beats it: stop scanning, classes can be many
                break
        return best

    def best_with(pc: _Class, xc: _Class) -> int:
        if (pc, xc) not in room:
            room[(pc, xc)] = best_of(_class_tier(pc, xc, c) for c in classes
                                     if free(c, pc, xc))
        return room[(pc, xc)]

    def best_tier(p: str) -> int:
        pc = cls[p]
        if pc not in best_cache:
            if roles == 1:
                best_cache[pc] = best_of(_pair_tier(pc, c) for c in classes if free(c, pc))
            else:
                best_cache[pc] = best_of(best_with(pc, c) for c in classes if free(c, pc))
        return best_cache[pc]

    # Eligibility is decided only for the classes a pick reaches: a rack-disjoint tier
    # allows most of them, and a pick stops after a few.
    verdicts: dict[tuple[_Class, _Class | None, int], dict[_Class, bool]] = {}

    def ok(memo: dict[_Class, bool], pc: _Class, oc: _Class | None, t: int, c: _Class) -> bool:
        v = memo.get(c)
        if v is None:
            if roles == 1:
                v = _pair_tier(pc, c) >= t
            else:  # a first pick must leave room for the second
                v = (best_with(pc, c) if oc is None else _class_tier(pc, c, oc)) >= t
            memo[c] = v
        return v

    def pick(p: str, other: str | None, t: int) -> str:
        # The heads in (load, name) order; a class whose head is p or other offers its
        # next node. Stops when no later head can beat the best (load, hops, name): a
        # rack-disjoint tier puts every candidate at least d.near(p) hops away, a lower
        # one (a job on one or two racks: few classes) may allow p's rack.
        pc, oc = cls[p], (cls[other] if other else None)
        memo = verdicts.setdefault((pc, oc, t), {})
        near = d.near(p) if t >= RACK_ONLY else 1
        best: tuple[int, int, str] | None = None
        for load_x, x, c in loads.ordered():
            if best is not None and best < (load_x, near, x):
                break
            if not ok(memo, pc, oc, t, c):
                continue
            if x in (p, other):
                nxt = next((e for e in by_class[c] if e[1] not in (p, other)), None)
                if nxt is None:
                    continue
                load_x, x = nxt
            h = d.dist(p, x)
            if best is None or (load_x, h, x) < best:
                best = (load_x, h, x)
        assert best is not None  # the tier t was computed as reachable
        return best[2]

    chosen: dict[int, list[str]] = {}
    for r in ranks:
        p, t = rank_nodes[r], best_tier(rank_nodes[r])
        chosen[r] = []
        for _ in range(roles):
            x = pick(p, chosen[r][0] if chosen[r] else None, t)
            loads.bump(x, 1)
            chosen[r].append(x)

    load = loads.load
    moved = True
    while moved:  # ends: every move lowers sum(load**2) by at least 2
        moved = False
        for r in ranks:
            # No node can be two lighter than a role holder within one of the lightest
            # pool node: skip the pick (most ranks, after the first pass).
            floor = loads.lightest() + 1
            if all(load[x] <= floor for x in chosen[r]):
                continue
            p, t = rank_nodes[r], best_tier(rank_nodes[r])
            for role in range(roles):
                a = chosen[r][role]
                b = pick(p, chosen[r][1 - role] if roles == 2 else None, t)
                if load[a] - load[b] >= 2:
                    chosen[r][role] = b
                    loads.bump(a, -1)
                    loads.bump(b, 1)
                    moved = True
    return chosen


def _add_mirrors(d: _Domains, ranks: list[int], rank_nodes: Mapping[int, str],
                 backups: dict[int, list[str]], loads: BackupLoads, extra: int) -> None:
    """Append up to ``extra`` mirrors to every group in ``backups``, greedily in rank order."""
    classes = sorted(loads.by_class, key=str)
    for r in ranks:
        p = rank_nodes[r]
        group = [p, *backups[r]]
        for _ in range(extra):
            # Set lookups, not pairwise d.disjoint: this loop runs ranks * mirrors * classes.
            racks = {loads.cls[n][0] for n in group}
            powers = {loads.cls[n][1] for n in group} - {None}
            best: tuple[bool, bool, int, int, str] | None = None
            for c in classes:
                shares_rack = c[0] in racks
                shares_domain = shares_rack or c[1] in powers
                if best is not None and (shares_domain, shares_rack) > best[:2]:
                    continue  # cannot win: skip the head lookup
                head = loads.head(c, group)
                if head is None:
                    continue
                key = (shares_domain, shares_rack, head[0], d.dist(p, head[1]), head[1])
                if best is None or key < best:
                    best = key
            if best is None:  # every pool node is in the group already
                break
            group.append(best[4])
            backups[r].append(best[4])
            loads.bump(best[4], 1)


def _shares(d: _Domains, members: dict[str, str], attr: str) -> str:
    """E.g. 'log backup and checkpoint mirror share rack r2' for members sharing ``attr``."""
    by_value: dict[str, list[str]] = {}
    for role, node in members.items():
        value = d.rack[node] if attr == "rack" else d.topology.power_domains.get(node)
        if value is not None:
            by_value.setdefault(value, []).append(role)
    parts = []
    for value, roles in sorted(by_value.items()):
        if len(roles) > 1:
            who = " and ".join([", ".join(roles[:-1]), roles[-1]])
            parts.append(f"{who} share {attr} {value}")
    return "; ".join(parts)


def _reason(d: _Domains, p: str, backups: list[str], replicas: int, racks: list[str],
            pool_size: int) -> str:
    """Empty for a complete group of pairwise domain-disjoint members, else one line."""
    if replicas == 0:
        return ""
    if not backups:
        return "job has 1 node: no backup possible"
    if replicas == 1:  # any node but the primary is the one copy asked for
        return ""
    mirrors = (["checkpoint mirror"] if replicas == 2
               else [f"checkpoint mirror {i}" for i in range(1, replicas)])
    members = {"primary": p, **dict(zip(["log backup", *mirrors], backups, strict=False))}
    same_rack = _shares(d, members, "rack")
    if len(backups) < replicas:
        got = ("no checkpoint mirror" if replicas == 2
               else f"{len(backups) - 1} of {replicas - 1} checkpoint mirrors")
        tail = f"; {same_rack}" if same_rack else ""
        return f"job has {pool_size} nodes: {got} possible{tail}"
    if same_rack:
        spans = f"job spans {len(racks)} rack{'s' if len(racks) > 1 else ''} ({', '.join(racks)})"
        return f"{spans}: {same_rack}"
    same_power = _shares(d, members, "power domain")
    if not same_power:
        return ""
    if replicas == 2:  # the tiers make this a fact about the pool, not about greed
        return (f"no two backups for {p} differ from it and each other in both rack and "
                f"power domain; rack-disjoint only: {same_power}")
    return f"rack-disjoint only: {same_power}"


def replace_dead_backups(topology: Topology, group: BackupGroup, dead: Collection[str],
                         pool: Iterable[str], loads: Mapping[str, int] | BackupLoads
                         ) -> BackupGroup | None:
    """The group with every dead backup (log backup or mirror) replaced, None if none died.

    Each replacement is a live pool node outside the group, chosen as a new mirror is:
    domain-disjoint from every remaining member if one is, else rack-disjoint from every
    one, then least loaded (``loads``: backup roles per node in the job), then fewest
    hops from the primary, then name. A role with no candidate is left empty and the
    group marked degraded. The primary is never replaced here: a dead primary means the
    rank is relaunched elsewhere, and the group follows the new primary then.

    ``loads`` may be a :class:`BackupLoads` of the same pool (``pool`` is then ignored):
    it is updated in place (new roles added, dead ones removed), so one index serves a
    job's groups one after the other, a replacement walking a few classes, not the pool.
    """
    if not any(b in dead for b in (group.log_backup, *group.ckpt_mirrors) if b):
        return None
    d = _domains(topology)
    idx = loads if isinstance(loads, BackupLoads) else BackupLoads.of(topology, pool, loads)
    members = [m for m in (group.primary, group.log_backup, *group.ckpt_mirrors)
               if m and m not in dead]
    dead_set = set(dead)

    placed = group.primary in d.rack
    # Tier-0 candidates are outside the primary's rack when it is a member.
    near = 0 if not placed else d.near(group.primary) if group.primary in members else 1

    def pick() -> str | None:
        mcls = [d.cls(m) for m in members if m in d.rack]
        skip = dead_set.union(members)
        best: tuple[int, int, int, str] | None = None
        # Heads in (load, name) order: once a tier-0 best beats every later head, stop.
        for load, name, c in idx.ordered():
            if best is not None and best[0] == 0 and best[1:] < (load, near, name):
                break
            tier = 0 if all(d.disjoint(c, m) for m in mcls) else \
                1 if all(c[0] != m[0] for m in mcls) else 2
            if best is not None and tier > best[0]:
                continue
            head = (load, name) if name not in skip else idx.head(c, skip)
            if head is None:
                continue
            hops = d.dist(group.primary, head[1]) if placed else 0
            key = (tier, head[0], hops, head[1])
            if best is None or key < best:
                best = key
        if best is None:
            return None
        members.append(best[3])
        idx.bump(best[3], 1)
        return best[3]

    log_backup = group.log_backup
    if log_backup is not None and log_backup in dead:
        log_backup = pick()
    mirrors = []
    for m in group.ckpt_mirrors:
        if m in dead:
            new = pick()
            if new is not None:
                mirrors.append(new)
        else:
            mirrors.append(m)
    for b in (group.log_backup, *group.ckpt_mirrors):
        if b and b in dead_set and b in idx.load and idx.load[b] > 0:
            idx.bump(b, -1)
    short = (log_backup is None) != (group.log_backup is None) or \
        len(mirrors) < len(group.ckpt_mirrors)
    return BackupGroup(group.rank, group.primary, log_backup, tuple(mirrors),
                       degraded=short or group.degraded,
                       reason="too few live nodes to replace every dead backup" if short
                       else group.reason)
