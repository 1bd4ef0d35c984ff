"""``raps``: the job under raps-slurm, driven by the coordinator's own decision code.

What comes from ``raps_slurm.core`` and is not copied here: backup groups and spare
orders (:func:`~raps_slurm.core.placement.compute_placement`), backup replacement after
a holder dies (:func:`~raps_slurm.core.placement.replace_dead_backups`), the DEAD verdict
delay (:mod:`raps_slurm.sim.detect` runs the detector), the recovery plans, spare choice
and escalations (:func:`~raps_slurm.core.planner.plan_dead_node`), the bounded recovery
queue (:func:`~raps_slurm.core.planner.to_start`), plan states
(:func:`~raps_slurm.core.planner.advance`) and the timeout rule
(:func:`~raps_slurm.core.planner.overdue`). Plans live in a
:class:`~raps_slurm.store.memory.MemoryStore` under the coordinator's keys, as in etcd.

The cost model (each figure a scenario key, see docs/simulator.md):
- the job computes in cycles of ``interval_s`` then a blocking incremental save of
  ``incr_s_per_gb`` x node state; messaging slows computation by ``log_overhead`` (or
  by what the application's messages per step cost at RAPS's per-size speed, log_share);
  a checkpoint is usable by another node once its delta reached the holders;
- the node is the unit of placement and recovery: a node's ranks share one backup group
  and move together to one spare under one plan (the planner is given one site per node),
  spares and ``max_concurrent_recoveries`` count nodes;
- a tightly coupled job: when a node running ranks crashes, every rank waits until the
  lost ones are back (detection, plan, launch, restore, replay), then all go on;
- a restore pulls the compressed state from a live holder over ``node_net_gbps`` (nothing
  when the target holds a copy) and decodes it at ``restore_gbps``; replay re-executes the
  lost computation ``replay_speedup`` times faster than it first ran;
- an escalation requeues the job: queue wait, start-up, local restores, and every rank
  back at the newest checkpoint its holders have; the new run gets fresh spares. Spares
  are not replenished within a run (a failed node leaves the allocation).
- failures and repairs come from the cluster's timeline, the same for every strategy
  (:func:`~raps_slurm.sim.trace.node_timeline`).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import replace

from raps_slurm.core import placement, planner
from raps_slurm.core.planner import Escalation, Plan, RankSite
from raps_slurm.model import BackupGroup
from raps_slurm.sim.detect import detection_delays
from raps_slurm.sim.intervals import pinned
from raps_slurm.sim.models import messaging_overhead
from raps_slurm.sim.results import StrategyResult
from raps_slurm.sim.scenario import Scenario
from raps_slurm.sim.trace import FAIL, Layout, Outage, node_timeline
from raps_slurm.store.keys import Keys
from raps_slurm.store.memory import MemoryStore

GB = 1e9
JOB = "1"


def log_share(s: Scenario) -> float:
    """Share of compute time lost to RAPS's messaging: from the application's messages
    per step (job.step_s, job.msg_bytes) and the per-size speeds when given, else
    raps.log_overhead."""
    if s.job.step_s <= 0 or not s.job.msg_bytes:
        return s.raps.log_overhead
    return min(0.99, messaging_overhead(
        s.job.step_s, s.job.msg_bytes, s.job.msg_per_step, s.cluster.mpi_latency_us * 1e-6,
        s.cluster.mpi_gbps, s.raps.msg_sizes_b, s.raps.msg_speed))


class RapsSim:
    """One seed of one job under raps-slurm (see the module docstring)."""

    def __init__(self, s: Scenario, layout: Layout, seed: int, horizon: float,
                 work_s: float | None = None, timeline: list[Outage] | None = None) -> None:
        self.s, self.layout, self.horizon, self.work_s = s, layout, horizon, work_s
        self.timeline = timeline if timeline is not None else \
            node_timeline(s, layout, seed, horizon)
        r = s.raps
        self.now = 0.0
        self.store = MemoryStore(clock=lambda: self.now)
        self.keys = Keys()
        self._q: list[tuple[float, int, str, object]] = []
        self._seq = 0
        self.down: set[str] = set()
        self.known_dead: set[str] = set()
        self.delays = [r.detect_s] if r.detect_s >= 0 else detection_delays(r)
        self.rng = random.Random(f"{seed}/detection")
        # The planner asks only for the rack of the node it relaunches from: it gets the
        # racks holding that node, not all of them (a scan per plan at 1,000 racks).
        self.racks_of: dict[str, list[str]] = {}
        self.rack_nodes = {k: frozenset(v) for k, v in layout.topology.racks().items()}
        for k, v in self.rack_nodes.items():
            for n in v:
                self.racks_of.setdefault(n, []).append(k)
        per_node = s.job.state_gb_per_node
        # The unit of placement and recovery is the node: its ranks share one backup group
        # and move together to one spare, so the planner sees one site per node.
        self.node_gb = per_node
        self.tau = pinned(s, "raps")
        if self.tau <= 0:
            raise ValueError("raps: no checkpoint interval (the runner chooses one)")
        self.c = r.incr_s_per_gb * per_node
        delta_gb = per_node * s.job.change_rate * r.storage_ratio
        self.lag = delta_gb * s.checkpoint.replicas / r.node_net_gbps
        self.cycle = self.tau + self.c
        self.log = log_share(s)
        # job state
        self.run = 0
        self.base = 0.0            # compute kept from earlier runs
        self.u = 0.0               # run time of the current run (computing or saving)
        self.running_since: float | None = None
        self.requeuing = False
        self.waiting_nodes = False
        self.pool: set[str] = set()
        self.sites: dict[int, RankSite] = {}
        self.groups: dict[int, BackupGroup] = {}
        self.ready: dict[tuple[int, str], float] = {}   # (rank, holder) -> copy usable from
        self.on_node: dict[str, set[int]] = {}
        self.held: dict[str, set[int]] = {}             # backup node -> ranks it holds
        self.pool_list: list[str] = []
        self.loads: placement.BackupLoads | None = None
        self.epochs: dict[int, int] = {}                # rank -> newest epoch (across runs)
        # This run's plans as in the store, indexed: the active ones, the spares they take
        # (planner.taken_spares of each plan, counted) and the ranks moved off each node.
        self.active: dict[str, Plan] = {}
        self.taken: dict[str, int] = {}
        self.takes: dict[str, set[str]] = {}
        self.moved_from: dict[str, set[int]] = {}
        self.working: list[str] = []
        self.orders: dict[tuple[str, str | None], tuple[str, ...]] = {}  # this run's, by class
        self.spare_list: list[str] = []
        self.batch_host = ""
        self._runs_ckpts = 0
        self.faults: dict[str, float] = {}              # crashed node -> crash time
        self.lost_at_fault: dict[int, float] = {}       # rank -> compute to replay
        self.finish_token = 0
        self.finished_at: float | None = None
        # results
        self.lost = self.ckpts_done = 0.0
        self.failures = self.job_failures = self.escalations = self.events = 0
        self.recoveries: list[float] = []
        self.stops: list[float] = []
        self.network_bytes = 0.0
        self.escalation_kinds: dict[str, int] = {}

    # ------------------------------------------------------------------ events
    def _at(self, t: float, kind: str, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, kind, payload))

    def simulate(self) -> StrategyResult:
        """Run to the horizon (or until the work is done) and return the result."""
        end = self.horizon  # a trace job not done by then stops there, unfinished
        for o in self.timeline:
            self._at(o.at, "fail" if o.kind == FAIL else "repair", o.node)
        self._new_run(list(self.layout.working), list(self.layout.spares))
        while self._q and self.finished_at is None:
            t, _, kind, payload = heapq.heappop(self._q)
            if t > end:
                break
            self.now = t
            self.events += 1
            getattr(self, "_on_" + kind)(payload)
        return self._result(end)

    # ------------------------------------------------------------------ progress
    def _compute(self, u: float) -> float:
        k = math.floor(u / self.cycle)
        return k * self.tau + min(u - k * self.cycle, self.tau)

    def _usable(self, u: float) -> float:
        """Compute at the newest checkpoint the holders have at run time ``u``."""
        k = math.floor(max(0.0, u - self.lag) / self.cycle)
        return k * self.tau

    def _stop(self) -> None:
        if self.running_since is not None:
            self.u += self.now - self.running_since
            self.running_since = None
            self.finish_token += 1

    def _go(self) -> None:
        if self.running_since is not None or self.requeuing or self.faults:
            return
        self.running_since = self.now
        if self.work_s is not None:
            need = self.work_s / (1.0 - self.log) - self.base
            k = math.ceil(need / self.tau) - 1
            u_end = k * self.cycle + (need - k * self.tau)
            self.finish_token += 1
            self._at(self.now + max(0.0, u_end - self.u), "finish", self.finish_token)

    def _on_finish(self, token: object) -> None:
        if token == self.finish_token and self.running_since is not None:
            self._stop()
            self.finished_at = self.now

    # ------------------------------------------------------------------ runs
    def _new_run(self, working: list[str], spares: list[str]) -> None:
        self.orders = {}
        if self.groups:
            self.groups, loads = self._carry_groups(working, spares)
            # Spare orders are made when a rank needs one (_site): a requeued run of a
            # large job would otherwise sort every spare for every rack class.
            spare_of: dict[int, tuple[str, ...]] = dict.fromkeys(self.groups, ())
        else:
            places = placement.compute_placement(
                self.layout.topology, dict(enumerate(working)), spares,
                replicas=self.s.checkpoint.replicas,
                prefer_original_rack=self.s.raps.prefer_original_rack)
            self.groups = {r: p.group for r, p in places.items()}
            spare_of = {r: p.spares for r, p in places.items()}
            counts: dict[str, int] = {}
            for g in self.groups.values():
                for h in (g.log_backup, *g.ckpt_mirrors):
                    if h:
                        counts[h] = counts.get(h, 0) + 1
            loads = placement.BackupLoads.of(self.layout.topology, [*working, *spares],
                                             counts)
        for r in self.groups:
            self.epochs[r] = self.epochs.get(r, 0) + 1  # a new run registers a new epoch
        self.sites = {r: RankSite(r, working[r], self.epochs[r], spare_of[r])
                      for r in self.groups}
        self.active, self.taken, self.takes, self.moved_from = {}, {}, {}, {}
        self.working, self.spare_list = list(working), list(spares)
        self.ready = {}
        self.on_node = {}
        self.held = {}
        for r, g in self.groups.items():
            for h in (g.log_backup, *g.ckpt_mirrors):
                if h:
                    self.held.setdefault(h, set()).add(r)
        self.pool_list = [*working, *spares]
        self.loads = loads
        for r, site in self.sites.items():
            self.on_node.setdefault(site.node, set()).add(r)
        self.pool = set(working) | set(spares)
        self.batch_host = working[0]
        self.u = 0.0
        self.requeuing = False
        self._go()

    def _carry_groups(self, working: list[str], spares: list[str]
                      ) -> tuple[dict[int, BackupGroup], placement.BackupLoads]:
        """A requeued run's backup groups: each rank keeps the backups it had on nodes the
        new run still holds; a role on a node it lost (or on the rank's new node) is
        reassigned by :func:`~raps_slurm.core.placement.replace_dead_backups`, as the
        coordinator does after a node death. A full placement per requeue would cost
        O(nodes x racks) each time: a year of a large job has hundreds."""
        pool = [*working, *spares]
        gone = set(self.pool_list).difference(pool)
        groups: dict[int, BackupGroup] = {}
        counts: dict[str, int] = {}
        changed: list[int] = []
        for r, node in enumerate(working):
            g = self.groups[r]
            if g.primary != node:
                g = replace(g, primary=node)
            members = (g.log_backup, *g.ckpt_mirrors)
            if any(b and (b in gone or b == node) for b in members):
                changed.append(r)
            for b in members:
                if b and b not in gone:
                    counts[b] = counts.get(b, 0) + 1
            groups[r] = g
        loads = placement.BackupLoads.of(self.layout.topology, pool, counts)
        for r in changed:
            g = groups[r]
            new = placement.replace_dead_backups(self.layout.topology, g,
                                                 gone | {g.primary}, pool, loads)
            if new is not None:
                groups[r] = new
        return groups, loads

    def _allocate(self) -> tuple[list[str], list[str]] | None:
        """Nodes for a requeued job: each rank keeps its node while it is up, a rank on a
        dead node takes the job's first live spare, then the lowest-numbered live free
        node; spares are refilled the same way."""
        need_s = len(self.layout.spares)
        ranks = [self.sites[r].node for r in range(len(self.layout.working))]
        keep = set(ranks)
        fresh = [x for x in self.spare_list if x not in self.down and x not in keep]
        holes = [r for r, x in enumerate(ranks) if x in self.down]
        want = len(holes) + need_s
        if len(fresh) < want:
            taken = keep.union(fresh)
            for x in self.layout.nodes:
                if x not in self.down and x not in taken:
                    fresh.append(x)
                    if len(fresh) == want:
                        break
            else:
                return None
        for r, x in zip(holes, fresh, strict=False):
            ranks[r] = x
        return ranks, fresh[len(holes):want]

    def _escalate(self, reason: str, wait_until: float = 0.0) -> None:
        if self.requeuing:
            return
        self._stop()
        self.escalations += 1
        kind = ("no spare" if "no usable spare" in reason else
                "batch host" if "batch script" in reason else
                "timeout" if "not running again within" in reason else
                "no copy" if "no live copy" in reason else "other")
        self.escalation_kinds[kind] = self.escalation_kinds.get(kind, 0) + 1
        for p in list(self.active.values()):
            self._put(planner.advance(p, "escalated", self.now, reason))
        self._runs_ckpts += math.floor(self.u / self.cycle)
        usable = self._usable(self.u)
        self.lost += self._compute(self.u) - usable
        self.base += usable
        self.requeuing = True
        r = self.s.raps
        ready = max(self.now, wait_until) + self.s.cluster.queue_wait_s + self.s.job.reinit_s \
            + self.node_gb / r.restore_gbps
        self._at(ready, "resume", self.run)

    def _on_resume(self, run: object) -> None:
        if not self.requeuing:
            return
        alloc = self._allocate()
        if alloc is None:
            self.waiting_nodes = True  # a repair will retry
            return
        self.waiting_nodes = False
        for t in self.faults.values():
            self.recoveries.append(self.now - t)
            self.stops.append(self.now - t)
        self.faults.clear()
        self.lost_at_fault.clear()
        self.run += 1
        self._new_run(*alloc)

    # ------------------------------------------------------------------ failures
    def _on_fail(self, node: object) -> None:
        assert isinstance(node, str)
        self.down.add(node)
        if node not in self.pool or self.requeuing:
            return
        self.failures += 1
        if self.on_node.get(node):
            if not self.faults:
                self.job_failures += 1
            self._stop()
            self.faults[node] = self.now
            lost = self._compute(self.u) - self._usable(self.u)
            for r in self.on_node[node]:
                self.lost_at_fault[r] = lost
        self._at(self.now + self.rng.choice(self.delays), "verdict", node)

    def _on_repair(self, node: object) -> None:
        assert isinstance(node, str)
        self.down.discard(node)
        self.known_dead.discard(node)
        if self.waiting_nodes:
            self._on_resume(self.run)

    def _on_verdict(self, node: object) -> None:
        assert isinstance(node, str)
        if node not in self.down or self.requeuing:
            return
        self.known_dead.add(node)
        self._replace_backups(node)
        for p in list(self.active.values()):
            if p.target == node and p.state == "queued":
                self._retarget(p)
            elif p.target == node:
                self._put(planner.advance(p, "failed", self.now, f"target {node} is dead"))
        ranks = self.on_node.get(node, set())
        if not ranks or self.requeuing:
            self._start_plans()
            return
        sites = [self._site(r) for r in sorted(ranks)]
        holders = {r: self._holders(r) for r in ranks}
        sizes = {r: int(self.node_gb * GB) for r in ranks}
        out = planner.plan_dead_node(
            JOB, node, sites, batch_host=self.batch_host, dead=self.known_dead, unhealthy=(),
            taken=set(self.taken), racks=self._racks(node),
            prefer_original_rack=self.s.raps.prefer_original_rack, holders=holders,
            sizes=sizes, now=self.now + self.s.raps.plan_s, run=self.run, detected_at=self.now)
        if isinstance(out, Escalation):
            self._escalate(out.reason)
            return
        for plan in out:
            if not self.store.create(self.keys.plan(plan.plan_id), plan.to_json()):
                raise RuntimeError(f"plan {plan.plan_id} exists already")  # epochs only grow
            self._index(plan)
            self._at(plan.created_at + self.s.raps.recovery_timeout_s + 1e-6, "overdue",
                     plan.plan_id)
        self._start_plans()

    def _site(self, r: int) -> RankSite:
        """Rank ``r``'s site with its spare order: one order per rack and power domain of
        the node it started the run on, as compute_placement gives."""
        site = self.sites[r]
        if site.spares or not self.spare_list:
            return site
        node = self.working[r]
        ck = (self.layout.rack[node], self.layout.power.get(node))
        if ck not in self.orders:
            self.orders[ck] = placement.order_spares(
                self.layout.topology, node, self.spare_list,
                prefer_original_rack=self.s.raps.prefer_original_rack)
        site = self.sites[r] = replace(site, spares=self.orders[ck])
        return site

    def _retarget(self, p: Plan) -> None:
        site = self._site(p.rank)
        target = planner.choose_target(
            site, dead=self.known_dead, unhealthy=(),
            taken=set(self.taken) - {p.target},
            racks=self._racks(site.node), prefer_original_rack=self.s.raps.prefer_original_rack,
            holders=self._holders(p.rank))
        if target is None:
            self._escalate(f"no usable spare for rank {p.rank} of job {JOB}")
            return
        self._put(replace(p, target=target))

    def _replace_backups(self, node: str) -> None:
        """Groups that lost a backup on ``node`` get a new one, as the coordinator's cycle
        does; the copy is usable once the primary sent it."""
        copy_s = self.node_gb * self.s.raps.storage_ratio / self.s.raps.node_net_gbps
        for r in sorted(self.held.pop(node, ())):
            g = self.groups[r]
            assert self.loads is not None  # built with the run
            new = placement.replace_dead_backups(self.layout.topology, g, self.known_dead,
                                                 self.pool_list, self.loads)
            if new is None:
                continue
            for b in (new.log_backup, *new.ckpt_mirrors):
                if b and b not in (g.log_backup, *g.ckpt_mirrors):
                    self.held.setdefault(b, set()).add(r)
                    self.ready[(r, b)] = self.now + copy_s
                    self.network_bytes += copy_s * self.s.raps.node_net_gbps * GB
            self.groups[r] = new

    def _holders(self, rank: int) -> list[str]:
        g = self.groups[rank]
        return [b for b in (g.log_backup, *g.ckpt_mirrors)
                if b and b not in self.down and self.ready.get((rank, b), 0.0) <= self.now]

    # ------------------------------------------------------------------ plans
    def _racks(self, node: str) -> dict[str, frozenset[str]]:
        return {k: self.rack_nodes[k] for k in self.racks_of.get(node, ())}

    def _index(self, plan: Plan) -> None:
        # The coordinator lists plans/<job>- each pass; over a simulated year a job has
        # thousands, so the current run's are mirrored here, indexed, and written through.
        if plan.active:
            self.active[plan.plan_id] = plan
        else:
            self.active.pop(plan.plan_id, None)
        for t in self.takes.get(plan.plan_id, ()):
            self.taken[t] -= 1
            if not self.taken[t]:
                del self.taken[t]
        self.takes[plan.plan_id] = planner.taken_spares([plan], JOB, self.run)
        for t in self.takes[plan.plan_id]:
            self.taken[t] = self.taken.get(t, 0) + 1
        if plan.run == self.run:
            self.moved_from.setdefault(plan.source, set()).add(plan.rank)

    def _put(self, plan: Plan) -> None:
        self.store.put(self.keys.plan(plan.plan_id), plan.to_json())
        self._index(plan)

    def _start_plans(self) -> None:
        if self.requeuing:
            return
        # to_start looks at queued and running plans only: the active ones suffice.
        for p in planner.to_start(list(self.active.values()),
                                  self.s.raps.max_concurrent_recoveries):
            holders = self._holders(p.rank)
            r = self.s.raps
            if p.target in holders:
                pull = 0.0
            elif holders:
                pull = self.node_gb * r.storage_ratio / r.node_net_gbps
                self.network_bytes += self.node_gb * r.storage_ratio * GB
            else:
                g = self.groups[p.rank]
                copies = [m for m in (g.primary, g.log_backup, *g.ckpt_mirrors) if m]
                self._escalate(f"no live copy of rank {p.rank}'s checkpoint",
                               wait_until=self._first_repair(copies))
                return
            start = max(self.now, p.created_at)
            self._put(planner.advance(p, "running", start))
            old = self.sites[p.rank]
            self.on_node.get(old.node, set()).discard(p.rank)
            self.sites[p.rank] = replace(old, node=p.target, epoch=p.epoch)
            self.epochs[p.rank] = p.epoch
            self.on_node.setdefault(p.target, set()).add(p.rank)
            self.groups[p.rank] = replace(self.groups[p.rank], primary=p.target)
            restored = start + r.launch_s + pull + self.node_gb / r.restore_gbps
            self._at(restored, "restored", p.plan_id)

    def _first_repair(self, nodes: list[str]) -> float:
        times = [t for t, _, kind, n in self._q if kind == "repair" and n in nodes]
        return min(times) if times else self.now

    def _plan(self, plan_id: object) -> Plan | None:
        kv = self.store.get(self.keys.plan(str(plan_id)))
        return None if kv is None else Plan.from_json(kv.key, kv.value)

    def _on_restored(self, plan_id: object) -> None:
        p = self._plan(plan_id)
        if p is None or p.state != "running" or self.requeuing:
            return
        self._put(planner.advance(p, "restored", self.now))
        replay = self.lost_at_fault.get(p.rank, 0.0) / self.s.raps.replay_speedup
        self._at(self.now + replay, "done", p.plan_id)
        self._start_plans()

    def _on_done(self, plan_id: object) -> None:
        p = self._plan(plan_id)
        if p is None or p.state != "restored" or self.requeuing:
            return
        self._put(planner.advance(p, "done", self.now))
        self.lost += self.lost_at_fault.pop(p.rank, 0.0) * self._share()
        open_ranks = {q.rank for q in self.active.values() if q.run == self.run}
        for node, t in list(self.faults.items()):
            if not any(r in open_ranks for r in self._fault_ranks(node)):
                self.recoveries.append(self.now - t)
                self.stops.append(self.now - t)
                del self.faults[node]
        self._go()

    def _fault_ranks(self, node: str) -> set[int]:
        return self.moved_from.get(node, set())

    def _share(self) -> float:
        """One node's share of the job (lost work is counted in job seconds)."""
        return 1.0 / len(self.layout.working)

    def _on_overdue(self, plan_id: object) -> None:
        p = self._plan(plan_id)
        if p is not None and planner.overdue([p], self.now, self.s.raps.recovery_timeout_s):
            self._escalate(f"plan {p.plan_id} not running again within "
                           f"{self.s.raps.recovery_timeout_s:g} s")

    # ------------------------------------------------------------------ result
    def _result(self, end: float) -> StrategyResult:
        if self.finished_at is None:
            self.now = end
            self._stop()
            wall = end
        else:
            wall = self.finished_at
        compute = self.base + (self._compute(self.u) if not self.requeuing else 0.0)
        s, r = self.s, self.s.raps
        nodes = len(self.layout.working)
        ckpts = self._ckpt_count()
        per = s.job.state_gb_per_node
        gens = 1 + (s.checkpoint.generations - 1) * s.job.change_rate
        storage = per * r.storage_ratio * gens * (1 + s.checkpoint.replicas) * nodes
        delta = per * s.job.change_rate * r.storage_ratio * GB
        return StrategyResult(
            strategy="raps", wall_s=wall, useful_s=compute * (1.0 - self.log), nodes=nodes,
            allocated_nodes=nodes + len(self.layout.spares), lost_work_s=self.lost,
            checkpoint_s=ckpts * self.c, checkpoints=ckpts, failures=self.failures,
            job_failures=self.job_failures, escalations=self.escalations,
            interrupted_restarts=0, recoveries=self.recoveries, stops=self.stops,
            storage_gb=storage, pfs_tb=0.0,
            network_tb=(ckpts * nodes * delta * s.checkpoint.replicas + self.network_bytes)
            / 1e12, events=self.events, logging_s=compute * self.log,
            escalation_kinds=dict(self.escalation_kinds),
            unfinished=int(self.work_s is not None and self.finished_at is None))

    def _ckpt_count(self) -> int:
        return self._runs_ckpts + (0 if self.requeuing else math.floor(self.u / self.cycle))
