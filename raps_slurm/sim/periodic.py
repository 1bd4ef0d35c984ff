"""``global`` and ``scr``: coordinated checkpoints and a whole-job restart after a failure.

Both follow one rule, the model Daly's formula describes: the job computes
``interval_s`` then writes a checkpoint of ``delta`` seconds; a failure of any of its
nodes, during computation, checkpoint or restart, throws away what was computed since the
last completed checkpoint and costs a restart of ``restart`` seconds (which a further
failure starts over). The strategies differ only in their costs:

- global: delta = job state / PFS write bandwidth; restart = queue wait + re-init +
  job state / PFS read bandwidth;
- scr: delta = node state / local write speed + node state / partner link (every node in
  parallel); restart = fixed relaunch delay + node state / partner link, plus the queue
  wait when the job has no spare to relaunch on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raps_slurm.sim.results import StrategyResult
from raps_slurm.sim.scenario import Scenario
from raps_slurm.sim.trace import Layout, SlotFailures

GB = 1e9


@dataclass(frozen=True)
class Costs:
    """Checkpoint time, restart time, and what one checkpoint moves."""

    delta: float
    restart: float
    pfs_bytes_per_ckpt: float
    pfs_bytes_per_restart: float
    net_bytes_per_ckpt: float
    storage_gb: float


def global_costs(s: Scenario, nodes: int) -> Costs:
    """Costs of coordinated checkpoints to the PFS for a job of ``nodes``."""
    g = s.global_
    state = s.job.state_gb_per_node * nodes
    delta = g.checkpoint_s if g.checkpoint_s >= 0 else state / g.pfs_write_gbps
    restart = g.restart_s if g.restart_s >= 0 else \
        g.queue_wait_s + g.reinit_s + state / g.pfs_read_gbps
    return Costs(delta, restart, state * GB, state * GB, 0.0,
                 state * s.checkpoint.generations)


def scr_costs(s: Scenario, nodes: int) -> Costs:
    """Costs of node-local checkpoints with a partner copy for a job of ``nodes``."""
    c = s.scr
    per = s.job.state_gb_per_node
    delta = per / c.local_gbps + per / c.partner_gbps
    restart = c.relaunch_s + per / c.partner_gbps
    if s.raps.spares == 0:
        restart += s.global_.queue_wait_s
    return Costs(delta, restart, 0.0, 0.0, per * nodes * GB,
                 2 * per * nodes * s.checkpoint.generations)


def simulate_periodic(name: str, s: Scenario, layout: Layout, seed: int, horizon: float,
                      costs: Costs, work_s: float | None = None) -> StrategyResult:
    """One seed of a checkpoint/restart strategy on the job's working nodes.

    With ``work_s`` the job ends when that much is computed (trace jobs); otherwise it runs
    until ``horizon`` and only completed segments count.
    """
    tau, delta, restart = s.checkpoint.interval_s, costs.delta, costs.restart
    fails = SlotFailures(s, layout, seed, horizon if work_s is None else math.inf,
                         layout.working)
    t = useful = lost = ckpt_time = 0.0
    ckpts = restarts = interrupted = 0
    recoveries: list[float] = []
    stops: list[float] = []
    events = 0
    limit = horizon if work_s is None else math.inf
    f = fails.next_after(0.0)
    while t < limit and (work_s is None or useful < work_s - 1e-9):
        left = math.inf if work_s is None else work_s - useful
        if left > tau:  # whole segments until the next failure (or the horizon)
            seg = tau + delta
            k = math.floor((min(f, limit) - t) / seg)
            if work_s is not None:
                k = min(k, math.floor(left / tau - 1e-12))
            if k >= 1:
                t += k * seg
                useful += k * tau
                ckpts += k
                ckpt_time += k * delta
                continue
            seg_work, seg = tau, tau + delta
        else:  # the last piece of a finite job needs no checkpoint after it
            seg_work, seg = left, left
        if t + seg <= min(f, limit):
            t += seg
            useful += seg_work
            if seg > seg_work:
                ckpts += 1
                ckpt_time += delta
            continue
        if f >= limit:  # the horizon ends inside the segment: what it computed counts
            useful += min(limit - t, seg_work)
            t = limit
            break
        events += 1
        done = min(f - t, seg_work)
        lost += done
        ckpt_time += max(0.0, f - t - seg_work)
        fault = f
        t = f
        while True:  # the restart, started over by every failure during it
            f = fails.next_after(t)
            events += 1
            if f >= t + restart:
                t += restart
                break
            interrupted += 1
            t = f
        restarts += 1
        stops.append(t - fault)
        recoveries.append(t - fault + done)
        f = fails.next_after(t)
    wall = t if work_s is not None else horizon
    nodes = len(layout.working)
    return StrategyResult(
        strategy=name, wall_s=wall, useful_s=useful, nodes=nodes, allocated_nodes=nodes,
        lost_work_s=lost, checkpoint_s=ckpt_time, checkpoints=ckpts,
        failures=fails.failures, job_failures=restarts, escalations=0,
        interrupted_restarts=interrupted, recoveries=recoveries, stops=stops,
        storage_gb=costs.storage_gb,
        pfs_tb=(ckpts * costs.pfs_bytes_per_ckpt + restarts * costs.pfs_bytes_per_restart) / 1e12,
        network_tb=ckpts * costs.net_bytes_per_ckpt / 1e12, events=events + fails.failures)
