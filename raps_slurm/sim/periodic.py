"""``global`` and ``scr``: coordinated checkpoints and a whole-job restart after a failure.

Both live in the same cluster as ``raps`` (:func:`~raps_slurm.sim.trace.node_timeline`): a
finite set of nodes that fail (alone or a whole rack at once), stay down for their repair
time and come back; a requeued job waits ``cluster.queue_wait_s`` holding no node, then
needs live nodes (its own live ones first) and waits for repairs when the cluster has too
few.

The job computes ``interval_s`` then writes a checkpoint of ``delta`` seconds. A failure of
a node it computes on throws away what was computed since the last completed checkpoint
and costs a restart, which a failure of a node the restart holds starts over:

- global: a requeue: queue wait, then the job's nodes, start-up and job state / PFS read
  (with ``global.restart_s`` the whole restart holds the nodes: Daly's model exactly);
- scr: a relaunch of the whole step inside the allocation, each dead node replaced by a
  live spare (``relaunch_s`` + node state / partner link); with too few live spares a
  requeue for the job's nodes and spares. Each node's checkpoint has one copy on its
  partner (:func:`partners`: the same-numbered node in the next rack): when a node and
  its partner die before the job is restored, that checkpoint is gone and the job falls back
  to its last PFS flush (every ``flush_every`` checkpoints, blocking) or its beginning;
- step (``raps-run --restart-mode step``): scr's relaunch inside the allocation with RAPS's
  costs: a blocking incremental save, copies on ``checkpoint.replicas`` holders in the
  next racks (:meth:`PeriodicSim._chain`), RAPS's detection before the relaunch, every rank restored
  from the newest common checkpoint (the replaced node pulls its copy from a holder), no
  message logging. A checkpoint serves the restart once its delta reached the holders
  (``lag``); a failure before that goes back one more interval. When a node and every
  holder of its copy are down, the job is requeued and waits until one of them is
  repaired (its disk holds the copy), as raps does.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from raps_slurm.sim.detect import detection_delays
from raps_slurm.sim.intervals import DEFAULT_FLUSH, pinned
from raps_slurm.sim.results import StrategyResult
from raps_slurm.sim.scenario import RapsSpec, Scenario
from raps_slurm.sim.trace import FAIL, Layout, Outage

GB = 1e9
RUN, QUEUE, HOLD, NODES, DONE = "run", "queue", "hold", "nodes", "done"


@dataclass(frozen=True)
class Costs:
    """What a checkpoint and a restart cost, and what they move."""

    delta: float               # blocking checkpoint
    queue: float               # a requeue: waiting without nodes
    hold: float                # a requeue: start-up and restore, holding the nodes
    relaunch: float = -1.0     # scr, step: relaunch inside the allocation (-1: never, global)
    flush: float = 0.0         # scr: blocking PFS flush of the whole job's state
    flush_every: int = 0       # scr: every Nth checkpoint is flushed (0: never)
    pfs_restore: float = 0.0   # scr: extra time to read the flushed checkpoint back
    spares: int = 0            # spare nodes allocated with the job
    copies: int = -1           # step: holders of each node's copy (-1: scr's one partner)
    lag: float = 0.0           # step: a checkpoint's delta reaches its holders this later
    # Traffic and storage, for the report.
    pfs_bytes_per_ckpt: float = 0.0     # global: the whole state each checkpoint
    pfs_bytes_per_restart: float = 0.0  # global: read back at each restart
    net_bytes_per_ckpt: float = 0.0     # scr, step: every node's copy to its partner(s)
    flush_bytes: float = 0.0            # scr: the whole state each flush
    storage_gb: float = 0.0

    @property
    def restart(self) -> float:
        """A whole requeue when no failure interrupts it."""
        return self.queue + self.hold


def global_costs(s: Scenario, nodes: int) -> Costs:
    """Costs of coordinated checkpoints to the PFS for a job of ``nodes``."""
    g = s.global_
    state = s.job.state_gb_per_node * nodes
    delta = g.checkpoint_s if g.checkpoint_s >= 0 else state / g.pfs_write_gbps
    if g.restart_s >= 0:
        queue, hold = 0.0, g.restart_s
    else:
        queue, hold = s.cluster.queue_wait_s, s.job.reinit_s + state / g.pfs_read_gbps
    return Costs(delta, queue, hold, pfs_bytes_per_ckpt=state * GB,
                 pfs_bytes_per_restart=state * GB,
                 storage_gb=state * s.checkpoint.generations)


def scr_costs(s: Scenario, nodes: int) -> Costs:
    """Costs of node-local checkpoints with a partner copy for a job of ``nodes``."""
    c = s.scr
    every = c.flush_every if c.flush_every >= 0 else DEFAULT_FLUSH
    per = s.job.state_gb_per_node
    state = per * nodes
    restore = c.relaunch_s + per / c.partner_gbps
    return Costs(per / c.local_gbps + per / c.partner_gbps, s.cluster.queue_wait_s, restore,
                 relaunch=restore, flush=state / s.global_.pfs_write_gbps,
                 flush_every=every, pfs_restore=state / s.global_.pfs_read_gbps,
                 spares=s.raps.spares, net_bytes_per_ckpt=per * nodes * GB,
                 flush_bytes=state * GB,
                 storage_gb=2 * state * s.checkpoint.generations
                 + (state if every else 0.0))


def step_costs(s: Scenario, nodes: int) -> Costs:
    """Costs of ``raps-run --restart-mode step`` for a job of ``nodes``: RAPS's save and
    restore figures (``step.*``, else ``raps.*``), its detection, no logging."""
    r, st = s.raps, s.step
    per = s.job.state_gb_per_node
    save = (st.incr_s_per_gb if st.incr_s_per_gb >= 0 else r.incr_s_per_gb) * per
    # Without a measured rate: survivors decode their local copy while the replaced node
    # pulls its own and decodes it, so the pull gates the restart.
    restore = per / st.restore_gbps if st.restore_gbps > 0 else \
        per * r.storage_ratio / r.node_net_gbps + per / r.restore_gbps
    detect = detection_mean(r)
    delta_gb = per * s.job.change_rate * r.storage_ratio
    replicas = s.checkpoint.replicas
    gens = 1 + (s.checkpoint.generations - 1) * s.job.change_rate
    return Costs(save, detect + s.cluster.queue_wait_s, s.job.reinit_s + restore,
                 relaunch=detect + st.relaunch_s + restore, spares=r.spares,
                 copies=replicas, lag=delta_gb * replicas / r.node_net_gbps,
                 net_bytes_per_ckpt=delta_gb * replicas * nodes * GB,
                 storage_gb=per * r.storage_ratio * gens * (1 + replicas) * nodes)


def detection_mean(r: RapsSpec) -> float:
    """Crash -> DEAD verdict: ``raps.detect_s``, else the mean of the coordinator's
    detector over crash phases (:func:`~raps_slurm.sim.detect.detection_delays`)."""
    if r.detect_s >= 0:
        return r.detect_s
    delays = detection_delays(r)
    return sum(delays) / len(delays)


def partners(layout: Layout) -> list[int]:
    """Each working position's partner: the same-numbered node of the job in the next rack
    (wrapping), so that a rack event never takes a node and its partner, as SCR's
    partner sets span failure groups; within one rack, the next node."""
    by_rack: dict[str, list[int]] = {}
    for i, x in enumerate(layout.working):
        by_rack.setdefault(layout.rack[x], []).append(i)
    racks = list(by_rack.values())
    n = len(layout.working)
    if len(racks) < 2:
        return [(i + 1) % n for i in range(n)]
    out = [0] * n
    for k, members in enumerate(racks):
        nxt = racks[(k + 1) % len(racks)]
        for j, i in enumerate(members):
            out[i] = nxt[j % len(nxt)]
    return out


class PeriodicSim:
    """One seed of one job under ``global`` or ``scr`` (see the module docstring)."""

    def __init__(self, name: str, s: Scenario, layout: Layout, timeline: list[Outage],
                 horizon: float, costs: Costs, work_s: float | None = None) -> None:
        self.name, self.s, self.layout, self.timeline = name, s, layout, timeline
        self.horizon, self.c, self.work_s = horizon, costs, work_s
        self.tau = pinned(s, name)
        if self.tau <= 0:
            raise ValueError(f"{name}: no checkpoint interval (the runner chooses one)")
        self.working = list(layout.working)
        self.spares = list(layout.spares[:costs.spares])
        self.n = len(self.working)
        # Position of each working node and the spare set, so that an event costs what it
        # touches, not the job's size; ``free`` holds the cluster's other nodes by number
        # (a requeue takes the lowest-numbered live ones, as trace.allocate does).
        self.pos = {x: i for i, x in enumerate(self.working)}
        self.spare_set = set(self.spares)
        self.index = {x: i for i, x in enumerate(layout.nodes)}
        self.free = [i for i, x in enumerate(layout.nodes)
                     if x not in self.pos and x not in self.spare_set]
        heapq.heapify(self.free)
        self.partner = partners(layout)
        # step: working positions by rack, racks in cluster order (the holders' places)
        self.rack_order = list(dict.fromkeys(layout.rack[x] for x in layout.nodes))
        self.rack_index = {r: k for k, r in enumerate(self.rack_order)}
        self.rack_pos: dict[str, list[int]] = {}
        for i, x in enumerate(self.working):
            self.rack_pos.setdefault(layout.rack[x], []).append(i)
        self.partnered: dict[int, set[int]] = {}   # position -> positions it is partner of
        for i, j in enumerate(self.partner):
            self.partnered.setdefault(j, set()).add(i)
        self.down: set[str] = set()
        self.phase, self.phase_end = RUN, 0.0
        self.t_seg = 0.0          # start of the current segment (RUN)
        self.n_flush = 0          # checkpoints since the last flush
        self.useful = self.flushed = self.lost = self.ckpt_time = 0.0
        self.ckpts = self.flushes = self.restarts = self.interrupted = self.fallbacks = 0
        self.failures = self.events = 0
        self.fault_t = self.fault_done = 0.0
        self.failed: set[int] = set()   # positions whose node died since the last restore
        self.partner_lost = False
        self.t_ckpt = -math.inf   # when the newest checkpoint was written (step's lag)
        # step: the nodes that died since the last restore, by position, the positions
        # that held their copies then, and for each node whose every copy is down, the
        # nodes one of which must come back first
        self.dead_node: dict[int, str] = {}
        self.dead_chain: dict[int, list[int]] = {}
        self.wait_for: list[set[str]] = []
        self.requeues: dict[str, int] = {}   # step: whole-job requeues by cause
        self.finished: float | None = None
        self.recoveries: list[float] = []
        self.stops: list[float] = []

    # ------------------------------------------------------------------ computing
    def _advance(self, until: float) -> None:
        """Complete every segment (and the job's last piece) that ends by ``until``."""
        tau, delta, f_every = self.tau, self.c.delta, self.c.flush_every
        while True:
            left = math.inf if self.work_s is None else self.work_s - self.useful
            if left <= tau + 1e-9:  # the last piece needs no checkpoint after it
                if self.t_seg + left <= until:
                    self.useful = float(self.work_s or 0.0)
                    self.finished = self.t_seg + left
                    self.phase = DONE
                return
            seg = tau + delta
            if not f_every or self.n_flush == 0:  # jump whole blocks between flushes
                per = max(f_every, 1)
                block = seg * per + (self.c.flush if f_every else 0.0)
                k = math.floor((until - self.t_seg) / block)
                if not math.isinf(left):
                    k = min(k, (math.ceil(left / tau - 1e-9) - 1) // per)
                if k >= 1:
                    self.t_seg += k * block
                    self.t_ckpt = self.t_seg
                    self.useful += k * per * tau
                    self.ckpts += k * per
                    self.ckpt_time += k * (block - per * tau)
                    if f_every:
                        self.flushes += k
                        self.flushed = self.useful
                    continue
            flush = self.c.flush if f_every and self.n_flush + 1 == f_every else 0.0
            if self.t_seg + seg + flush > until:
                return
            self.t_seg += seg + flush
            self.t_ckpt = self.t_seg
            self.useful += tau
            self.ckpts += 1
            self.ckpt_time += delta + flush
            self.n_flush += 1
            if flush or (f_every and self.n_flush == f_every):
                self.n_flush = 0
                self.flushes += 1
                self.flushed = self.useful

    def _progress(self, until: float) -> None:
        """Phase changes that happen by ``until``."""
        while True:
            if self.phase == RUN:
                self._advance(until)
                return
            if self.phase not in (QUEUE, HOLD) or self.phase_end > until:
                return
            t = self.phase_end
            if self.phase == QUEUE:
                self._allocate(t)
            else:
                self.phase, self.t_seg = RUN, t
                self.failed.clear()
                self.partner_lost = False
                self.dead_node.clear()
                self.dead_chain.clear()
                self.wait_for.clear()
                self.stops.append(t - self.fault_t)
                self.recoveries.append(t - self.fault_t + self.fault_done)

    # ------------------------------------------------------------------ faults
    def _fault(self, t: float, dead: list[int]) -> None:
        if self.phase == RUN:
            p = t - self.t_seg
            done = min(p, self.tau)
            self.lost += done
            self.ckpt_time += max(0.0, p - self.tau)
            self.fault_t, self.fault_done = t, done
            self.restarts += 1
            if t - self.t_ckpt < self.c.lag and self.useful >= self.tau - 1e-9:
                # The newest checkpoint has not reached the holders: the one before it.
                self.useful -= self.tau
                self.lost += self.tau
                self.fault_done += self.tau
        else:
            self.interrupted += 1
        self.failed.update(dead)
        if self.c.copies >= 0:
            self._copies_lost(dead)
        elif self.c.relaunch >= 0 and not self.partner_lost and self.n > 1 and any(
                self.partner[i] in self.failed for i in self.failed):
            # A node and its partner are gone: back to the last flush (or the beginning).
            self.partner_lost = True
            self.fallbacks += 1
            self.lost += self.useful - self.flushed
            self.fault_done += self.useful - self.flushed
            self.useful = self.flushed
            self.n_flush = 0
        self._restart(t)

    def _chain(self, i: int) -> list[int]:
        """step: the positions holding position ``i``'s copies, one in each of the next
        racks that hold working nodes (as RAPS's backup groups span fault domains and are
        rebuilt after a move); with too few racks, the next positions in ``i``'s own."""
        own = self.layout.rack[self.working[i]]
        k0, nr = self.rack_index[own], len(self.rack_order)
        out: list[int] = []
        for k in range(1, nr if self.c.copies else 1):
            members = self.rack_pos.get(self.rack_order[(k0 + k) % nr])
            if members:
                out.append(members[i % len(members)])
                if len(out) == self.c.copies:
                    return out
        members = self.rack_pos[own]
        at = members.index(i)
        for m in range(1, min(len(members), self.c.copies - len(out) + 1)):
            out.append(members[(at + m) % len(members)])
        return out

    def _copies_lost(self, dead: list[int]) -> None:
        """step: a node whose every copy is down (it and all its holders died since the
        last restore) holds the restart until one of those nodes is repaired (after a
        requeue: a failed node leaves the allocation)."""
        for i in dead:
            if i not in self.dead_node:
                self.dead_node[i] = self.working[i]
                self.dead_chain[i] = self._chain(i)
        for i, node in self.dead_node.items():
            chain = self.dead_chain[i]
            if all(j in self.dead_node for j in chain):
                group = {node, *(self.dead_node[j] for j in chain)}
                if group not in self.wait_for:
                    self.wait_for.append(group)

    def _holes(self) -> list[int]:
        """Positions whose node is down (the down set is small: the outages under way)."""
        return sorted(self.pos[x] for x in self.down if x in self.pos)

    def _place(self, i: int, node: str) -> None:
        old = self.working[i]
        del self.pos[old]
        heapq.heappush(self.free, self.index[old])
        self.working[i] = node
        self.pos[node] = i
        if self.c.copies >= 0:
            self.rack_pos[self.layout.rack[old]].remove(i)
            self.rack_pos.setdefault(self.layout.rack[node], []).append(i)
        # SCR rebuilds its partner sets at a restart: the new node and every node whose
        # copy it holds must keep their partner in another rack.
        self._repartner(i)
        for k in list(self.partnered.get(i, ())):
            self._repartner(k)

    def _repartner(self, i: int) -> None:
        """Move position ``i``'s partner along the partner chain to another rack."""
        rack, node = self.layout.rack, self.working
        j, hops = self.partner[i], 0
        while (rack[node[j]] == rack[node[i]] or j == i) and hops < 8:
            j, hops = self.partner[j], hops + 1
        if j != self.partner[i] and j != i:
            self.partnered[self.partner[i]].discard(i)
            self.partner[i] = j
            self.partnered.setdefault(j, set()).add(i)

    def _set_spares(self, spares: list[str]) -> None:
        for x in self.spare_set.difference(spares):
            heapq.heappush(self.free, self.index[x])
        self.spares = spares
        self.spare_set = set(spares)

    def _restart(self, t: float) -> None:
        holes = self._holes()
        extra = self.c.pfs_restore if self.partner_lost else 0.0
        if self.c.relaunch >= 0 and not self.wait_for and len(self.spares) - len(
                self.spare_set & self.down) >= len(holes):
            live = [x for x in self.spares if x not in self.down]
            for i, x in zip(holes, live, strict=False):
                self.spare_set.discard(x)
                self._place(i, x)
            self._set_spares(live[len(holes):])
            self.phase, self.phase_end = HOLD, t + self.c.relaunch + extra
            return
        if self.c.copies >= 0:
            why = "no copy" if self.wait_for else "no spare"
            self.requeues[why] = self.requeues.get(why, 0) + 1
        self.phase, self.phase_end = QUEUE, t + self.c.queue

    def _allocate(self, t: float) -> None:
        """Nodes for the requeued job: its live nodes keep their place (and their
        checkpoints), holes take its live spares, then the lowest-numbered live others
        (:func:`~raps_slurm.sim.trace.allocate`, without walking the whole cluster)."""
        if any(group <= self.down for group in self.wait_for):
            self.phase = NODES  # a checkpoint is only on dead nodes: a repair retries
            return
        holes = self._holes()
        live_spares = [x for x in self.spares if x not in self.down]
        need = len(holes) + self.c.spares - len(live_spares)
        mine = self.n - len(holes) + len(live_spares)
        if len(self.layout.nodes) - len(self.down) - mine < need:
            self.phase = NODES  # a repair retries
            return
        fresh = list(live_spares)
        skipped: list[int] = []
        nodes = self.layout.nodes
        while len(fresh) < len(holes) + self.c.spares:
            k = heapq.heappop(self.free)
            if nodes[k] in self.down:
                skipped.append(k)
            else:
                fresh.append(nodes[k])
        for k in skipped:
            heapq.heappush(self.free, k)
        self.spare_set.difference_update(fresh)
        for i, x in zip(holes, fresh, strict=False):
            self._place(i, x)
        self._set_spares(fresh[len(holes):])
        extra = self.c.pfs_restore if self.partner_lost else 0.0
        self.phase, self.phase_end = HOLD, t + self.c.hold + extra

    # ------------------------------------------------------------------ the run
    def simulate(self) -> StrategyResult:
        """Run to the horizon (or until the work is done) and return the result."""
        tl, i, end = self.timeline, 0, self.horizon
        while i < len(tl) and self.phase != DONE:
            t = tl[i].at
            if t >= end:
                break
            self._progress(t)
            if self.phase == DONE:
                break
            j = i
            failed_now: list[str] = []
            repaired = False
            while j < len(tl) and tl[j].at == t:
                o = tl[j]
                if o.kind == FAIL:
                    self.down.add(o.node)
                    failed_now.append(o.node)
                else:
                    self.down.discard(o.node)
                    repaired = True
                j += 1
            i = j
            if self.phase in (RUN, HOLD):
                hit = [x for x in failed_now if x in self.pos or x in self.spare_set]
                if hit:
                    self.events += 1
                    self.failures += len(hit)
                    if self.spare_set.intersection(hit):
                        self._set_spares([x for x in self.spares if x not in self.down])
                    dead = sorted(self.pos[x] for x in hit if x in self.pos)
                    if dead:
                        self._fault(t, dead)
            elif self.phase == NODES and repaired:
                self.events += 1
                self._allocate(t)
        if self.phase != DONE:
            self._progress(end)
        if self.phase == RUN:  # the horizon ends inside a segment: what it computed counts
            p = end - self.t_seg
            left = math.inf if self.work_s is None else self.work_s - self.useful
            self.useful += min(p, self.tau, left)
            self.ckpt_time += max(0.0, p - self.tau)
        return self._result()

    def _result(self) -> StrategyResult:
        wall = self.finished if self.finished is not None else self.horizon
        if self.work_s is None:
            wall = self.horizon
        c = self.c
        return StrategyResult(
            strategy=self.name, wall_s=wall, useful_s=self.useful, nodes=self.n,
            allocated_nodes=self.n + c.spares, lost_work_s=self.lost,
            checkpoint_s=self.ckpt_time, checkpoints=self.ckpts, failures=self.failures,
            job_failures=self.restarts, escalations=sum(self.requeues.values()),
            escalation_kinds=dict(self.requeues), interrupted_restarts=self.interrupted,
            recoveries=self.recoveries, stops=self.stops, storage_gb=c.storage_gb,
            pfs_tb=(self.ckpts * c.pfs_bytes_per_ckpt + self.restarts * c.pfs_bytes_per_restart
                    + self.flushes * c.flush_bytes) / 1e12,
            network_tb=self.ckpts * c.net_bytes_per_ckpt / 1e12,
            events=self.events + self.failures,
            unfinished=int(self.work_s is not None and self.finished is None),
            fallbacks=self.fallbacks)


def simulate_periodic(name: str, s: Scenario, layout: Layout, timeline: list[Outage],
                      horizon: float, costs: Costs, work_s: float | None = None
                      ) -> StrategyResult:
    """One seed of a checkpoint/restart strategy; ``work_s`` ends a trace job once done."""
    return PeriodicSim(name, s, layout, timeline, horizon, costs, work_s).simulate()
