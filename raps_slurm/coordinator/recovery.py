"""The leader's recovery pass: plans for dead nodes' ranks, started within the bound,
followed through the phases nodes report, escalated to a requeue when they cannot finish.

Decisions come from :mod:`raps_slurm.core.planner`; this module reads etcd (the jobs
snapshot, ``plans/``) and writes what was decided with guarded transactions, so every
step is idempotent and a new leader finishes what an old one started:

- a plan is created only where its key is absent (ids are ``<job>-<rank>-<epoch>``);
- starting a plan moves the rank entry to the target with the new epoch *and* marks the
  plan running in one transaction, guarded by both revisions (the launcher, which reads
  the plan through its agent, then starts the rank there);
- an escalation is recorded (``jobs/<id>/escalation``) before Slurm is asked to requeue
  and marked done after; a leader that finds it not done asks again
  (:mod:`raps_slurm.coordinator.escalation`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from raps_slurm.config import Config
from raps_slurm.coordinator.election import Leadership

# re-exported (the "as" ones): rapsctl, the user door and the tests take them from here
from raps_slurm.coordinator.escalation import GIVE_UP_GRACE_SEC as GIVE_UP_GRACE_SEC
from raps_slurm.coordinator.escalation import Escalations, decode_escalation
from raps_slurm.coordinator.plan_book import PlanBook
from raps_slurm.coordinator.plan_book import plans_in_order as plans_in_order
from raps_slurm.coordinator.plan_book import read_plans as read_plans
from raps_slurm.coordinator.snapshot import JobView
from raps_slurm.core import planner
from raps_slurm.core.jobs import RankEntry, group_to_json
from raps_slurm.core.planner import Escalation, Plan, RankSite
from raps_slurm.errors import RecordError, SlurmCommandError
from raps_slurm.model import JobInfo, Topology
from raps_slurm.store import Guard, Keys, KeyValue, Put, StateStore
from raps_slurm.store.base import MAX_TXN_OPS, TxnOp

log = logging.getLogger("raps.coordinator")
LAUNCH_NOTE = "the rank's step on"  # how follow_events notes a launch that failed
_PLANS_PER_TXN = MAX_TXN_OPS // 6  # a started plan guards and writes three keys


class Recovery(Escalations):
    """The recovery pass; :meth:`step` is called once per leader cycle."""

    def __init__(self, cfg: Config, store: StateStore, keys: Keys, leadership: Leadership, *,
                 job_info: Callable[[str], JobInfo], requeue: Callable[[str], None],
                 start_now: Callable[[str], None] = lambda job: None,
                 update_pending: Callable[[str, list[str] | None, int | None], None]
                 = lambda job, exclude, num_nodes: None,
                 cancel: Callable[[str], None] = lambda job: None,
                 step_of: Callable[[str, int], int | None] = lambda job, rank: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.store, self.keys, self.leadership = cfg, store, keys, leadership
        self._job_info, self._requeue, self._clock = job_info, requeue, clock
        self._start_now, self._update_pending, self._cancel = start_now, update_pending, cancel
        self._step_of = step_of  # a rank's last reported step: a plan's pre-fault progress
        self._reported: set[str] = set()
        # What this pass knows, for escalations: what the requeued run asks Slurm for.
        self._views: dict[str, JobView] = {}
        self._dead: set[str] = set()
        self._unhealthy: set[str] = set()
        self._topology: Topology | None = None

    def step(self, jobs: dict[str, JobView], dead: set[str], unhealthy: set[str],
             dead_at: dict[str, float], topology: Topology | None,
             registered: set[str] | None = None,
             draining: dict[str, tuple[str, float]] | None = None) -> list[str]:
        """One pass over every running job; returns what it did (for the cycle status).

        ``registered``: nodes whose agent holds a live registration (None: not known);
        a spare without one cannot run a rank and is no target."""
        book = read_plans(self.store, self.keys)
        if registered is not None and topology is not None:
            everyone = {n for nodes in topology.racks().values() for n in nodes}
            unhealthy = unhealthy | (everyone - registered - dead)
        self._views, self._dead, self._unhealthy, self._topology = jobs, dead, unhealthy, topology
        done: list[str] = self._lost_targets(book, dead, unhealthy, topology)
        for line in book.bad:
            if line not in self._reported:
                log.error("skipping malformed value: %s", line)
                self._reported.add(line)
        for line in book.refused:
            if line not in self._reported:
                log.warning("ignoring a report: %s", line)
                self._reported.add(line)
        now = self._clock()
        views = jobs
        done.extend(self._follow(book))
        for job, view in sorted(views.items(), key=lambda kv: int(kv[0])):
            if view.escalation is not None:
                done.extend(self._release(job, view.escalation, view))
            rec, m = view.record, view.rank_map
            if rec is None or m is None or rec.state != "running" or m.error or \
                    m.restart_count != rec.restart_count:
                continue
            if view.escalation is not None and _run_of(view.escalation) == rec.restart_count:
                # this run is being requeued: nothing to plan, only Slurm to ask (again)
                done.extend(self._escalations(job, rec.restart_count))
                continue
            plans = book.of_job(job, rec.restart_count)
            stopped = planner.cancelled(plans, book.events)
            if stopped:
                plan, request = stopped[0]
                who = str(request.detail.get("who", "?"))[:64]
                why = str(request.detail.get("reason", ""))[:200]
                done.append(self._escalate(job, rec.restart_count, book,
                                           f"plan {plan.plan_id} cancelled by {who}"
                                           + (f": {why}" if why else "")))
                continue
            asked, lost = _asked_to_escalate(view)
            if asked:
                done.append(self._escalate(job, rec.restart_count, book, asked, lost))
                continue
            late = planner.overdue(plans, now, self.cfg.recovery.recovery_timeout_sec,
                                   view.hung)
            if late:
                p = late[0]
                why = (f"plan {p.plan_id}: rank {p.rank} judged HUNG while re-executing its "
                       "lost work" if p.state == "restored" else
                       f"plan {p.plan_id}: rank {p.rank} not running again within "
                       f"{self.cfg.recovery.recovery_timeout_sec}s")
                done.append(self._escalate(job, rec.restart_count, book, why))
                continue
            if dead and topology is not None:
                done.extend(self._plan(job, view, plans, book, dead, unhealthy, dead_at,
                                       topology, now))
            if draining and topology is not None:
                done.extend(self._plan_moves(job, view, book.of_job(job, rec.restart_count),
                                             book, draining, dead, unhealthy, topology, now))
            if view.hung:
                done.extend(self._plan_hung(job, view, book.of_job(job, rec.restart_count),
                                            book, dead, now))
            if topology is not None:
                done.extend(self._replan_failed_launches(
                    job, view, book.of_job(job, rec.restart_count), book, dead, unhealthy,
                    topology, now))
        done.extend(self._start(book, views, now))
        return done

    # -- following reported phases ------------------------------------------------

    def _follow(self, book: PlanBook) -> list[str]:
        out = []
        for pid, (plan, kv) in sorted(book.plans.items()):
            new = planner.follow_events(plan, book.events.get(pid, {}))
            if new == plan:
                continue
            if self.leadership.commit([Guard(kv.key, kv.mod_revision)],
                                      [Put(kv.key, new.to_json())]):
                book.plans[pid] = (new, kv)  # revision is stale now: no second write this pass
                log.info("plan %s: %s -> %s", pid, plan.state, new.state)
                out.append(f"plan {pid} {new.state}")
        return out

    # -- targets that died ----------------------------------------------------------------

    def _lost_targets(self, book: PlanBook, dead: set[str], unhealthy: set[str],
                      topology: Topology | None) -> list[str]:
        """A started plan whose target died has failed (the rank gets a new plan with the
        next epoch); a queued one is given another target."""
        out = []
        now = self._clock()
        chosen: dict[tuple[str, int, str, str, float], str | None] = {}  # per move
        for pid, (plan, kv) in sorted(book.plans.items()):
            if not plan.active or plan.target not in dead or plan.target == plan.source:
                continue
            if plan.state == "queued" and topology is not None:
                move = planner.move_of(plan)
                if move not in chosen:
                    # The whole move goes to one new target: its own plans do not count
                    # as taken.
                    racks = {name: set(nodes) for name, nodes in topology.racks().items()}
                    site = RankSite(plan.rank, plan.source, plan.epoch - 1,
                                    self._spares_of(plan))
                    taken = planner.taken_spares(
                        [p for p, _ in book.plans.values() if planner.move_of(p) != move],
                        plan.job, plan.run)
                    chosen[move] = planner.choose_target(
                        site, dead=dead, unhealthy=unhealthy, taken=taken, racks=racks,
                        prefer_original_rack=self.cfg.recovery.prefer_original_rack,
                        holders=())
                target = chosen[move]
                if target is not None:
                    new = dataclasses.replace(plan, target=target,
                                              note=f"target {plan.target} died; now {target}")
                    if self.leadership.commit([Guard(kv.key, kv.mod_revision)],
                                              [Put(kv.key, new.to_json())]):
                        book.plans[pid] = (new, kv)
                        out.append(f"plan {pid} retargeted to {target}")
                    continue
            new = planner.advance(plan, "failed", now, f"target {plan.target} died")
            if self.leadership.commit([Guard(kv.key, kv.mod_revision)],
                                      [Put(kv.key, new.to_json())]):
                book.plans[pid] = (new, kv)
                log.warning("plan %s failed: its target %s died", pid, plan.target)
                out.append(f"plan {pid} failed")
        return out

    def _spares_of(self, plan: Plan) -> tuple[str, ...]:
        kv = self.store.get(self.keys.job_rank(plan.job, plan.rank))
        if kv is None:
            return ()
        try:
            return RankEntry.from_json(kv.key, kv.value).spares
        except RecordError:
            return ()

    # -- new plans -------------------------------------------------------------------

    def _plan(self, job: str, view: JobView, plans: list[Plan], book: PlanBook,
              dead: set[str], unhealthy: set[str], dead_at: dict[str, float],
              topology: Topology, now: float) -> list[str]:
        assert view.record is not None
        run = view.record.restart_count
        planned = {p.rank for p in plans if p.active}
        planned |= {p.rank for p in plans
                    if p.epoch > view.epochs.get(p.rank, 0)}  # created, not yet started
        hit = sorted({e.node for e, _ in view.entries.values()
                      if e.node in dead and e.rank not in planned})
        if not hit:
            return []
        try:
            info = self._job_info(job)
        except SlurmCommandError as exc:
            return [f"job {job}: cannot read it from Slurm to plan ({exc})"]
        sites = [RankSite(e.rank, e.node, e.epoch, e.spares)
                 for e, _ in view.entries.values() if e.rank not in planned]
        holders: dict[int, tuple[str, ...]] = {}
        sizes: dict[int, int] = {}
        for rank, recs in view.ckpts.items():
            good = [r for r in recs if r.state != "bad"]
            if good:
                newest = max(good, key=lambda r: r.generation)
                holders[rank] = tuple(h for h in newest.holders if h not in newest.bad)
                sizes[rank] = newest.total_size
        racks = {name: set(nodes) for name, nodes in topology.racks().items()}
        out = []
        taken = planner.taken_spares(plans, job, run)
        for node in hit:
            result = planner.plan_dead_node(
                job, node, sites, batch_host=info.batch_host, dead=dead, unhealthy=unhealthy,
                taken=taken, racks=racks,
                prefer_original_rack=self.cfg.recovery.prefer_original_rack,
                holders=holders, sizes=sizes, now=now, run=run, detected_at=dead_at.get(node))
            if isinstance(result, Escalation):
                out.append(self._escalate(job, run, book, result.reason))
                return out
            for plan in self._queue(book, result):
                log.warning("plan %s: rank %d of job %s from dead %s to %s, epoch %d",
                            plan.plan_id, plan.rank, job, node, plan.target, plan.epoch)
                out.append(f"plan {plan.plan_id} queued")
            taken.update(plan.target for plan in result)
        return out

    def _plan_moves(self, job: str, view: JobView, plans: list[Plan], book: PlanBook,
                    draining: dict[str, tuple[str, float]], dead: set[str],
                    unhealthy: set[str], topology: Topology, now: float) -> list[str]:
        """Ranks on a live node drained for health while this run ran: ``planned`` plans to
        spares (raps-run has them checkpoint and stop first; ``_start`` waits for that).
        A verdict older than the run moves nothing: the job started there anyway (an admin
        resumed the node), and the verdict stays in etcd until the node is healthy again."""
        assert view.record is not None
        run = view.record.restart_count
        draining = {n: v for n, v in draining.items() if v[1] >= view.record.registered_at}
        busy = {p.rank for p in plans if p.active or p.epoch > view.epochs.get(p.rank, 0)}
        sites = [RankSite(e.rank, e.node, e.epoch, e.spares)
                 for e, _ in view.entries.values()
                 if e.node in draining and e.node not in dead and e.rank not in busy]
        if not sites:
            return []
        holders = {rank: tuple(max(recs, key=lambda r: r.generation).holders)
                   for rank, recs in view.ckpts.items() if recs}
        racks = {name: set(nodes) for name, nodes in topology.racks().items()}
        taken = planner.taken_spares(plans, job, run)
        out = []
        for node in sorted({s.node for s in sites}):
            made = planner.plan_migration(
                job, node, draining[node][0], sites, dead=dead, unhealthy=unhealthy,
                taken=taken, racks=racks,
                prefer_original_rack=self.cfg.recovery.prefer_original_rack,
                holders=holders, sizes={}, now=now, run=run)
            for plan in self._queue(book, made):
                log.warning("plan %s: rank %d of job %s moves off %s (drained: %s) to %s",
                            plan.plan_id, plan.rank, job, node, draining[node][0],
                            plan.target)
                out.append(f"plan {plan.plan_id} queued (planned)")
            taken.update(plan.target for plan in made)
        return out

    def _plan_hung(self, job: str, view: JobView, plans: list[Plan], book: PlanBook,
                   dead: set[str], now: float) -> list[str]:
        """A rank HUNG on a live node: relaunched there from its checkpoint (raps-run kills
        the old step's srun; the old copy, fenced by the new epoch, is killed by its agent).
        Only a verdict newer than the rank's last plan counts: the old one stays in etcd."""
        assert view.record is not None
        out: list[str] = []
        stopping, started = view.steps.get(view.record.restart_count, (None, None))
        if stopping is not None and (started is None or started < stopping) and \
                now - stopping < self.cfg.recovery.recovery_timeout_sec:
            return out  # the job's MPI step is being restarted: its ranks are silent
        for rank, at in sorted(view.hung.items()):
            if rank not in view.entries:
                continue
            entry = view.entries[rank][0]
            if view.done.get(rank) == entry.epoch:
                continue  # finished its program: silent because it ended
            mine = [p for p in plans if p.rank == rank]
            if entry.node in dead or any(p.active or p.epoch > entry.epoch for p in mine) or \
                    at <= max((p.created_at for p in mine), default=0.0):
                continue
            # A silence that began before this incarnation started (the run was requeued, or
            # a plan relaunched the rank) says nothing about it: a rank whose step is slow
            # to start is a launch matter (raps-run reports launch_failed), not a hang.
            last = view.hung_last.get(rank)
            began = max([view.record.registered_at, started or 0.0,
                         *(p.started_at or 0.0 for p in mine if p.epoch == entry.epoch)])
            if last is not None and last < began:
                continue
            size = max((r.total_size for r in view.ckpts.get(rank, [])), default=0)
            plan = planner.plan_hung_rank(job, RankSite(rank, entry.node, entry.epoch,
                                                        entry.spares),
                                          size, now, view.record.restart_count, detected_at=at)
            if self._queue(book, [plan]):
                log.warning("plan %s: hung rank %d of job %s relaunched on %s, epoch %d",
                            plan.plan_id, rank, job, entry.node, plan.epoch)
                out.append(f"plan {plan.plan_id} queued")
        return out

    def _replan_failed_launches(self, job: str, view: JobView, plans: list[Plan],
                                book: PlanBook, dead: set[str], unhealthy: set[str],
                                topology: Topology, now: float) -> list[str]:
        """A rank whose step could not start on its target (the plan ``failed`` on raps-run's
        report) gets a successor plan to another spare; after ``MAX_LAUNCH_FAILURES`` of
        them, or with no spare left, the job escalates."""
        assert view.record is not None
        out: list[str] = []
        racks = {name: set(nodes) for name, nodes in topology.racks().items()}
        for rank, (entry, _) in sorted(view.entries.items()):
            mine = sorted((p for p in plans if p.rank == rank), key=lambda p: p.epoch)
            if not mine:
                continue
            last = mine[-1]
            if last.state != "failed" or not last.note.startswith(LAUNCH_NOTE) or \
                    entry.epoch != last.epoch or entry.node != last.target or \
                    entry.node in dead:
                continue
            failures = [p for p in mine if p.state == "failed" and p.note.startswith(LAUNCH_NOTE)]
            if len(failures) >= planner.MAX_LAUNCH_FAILURES:
                out.append(self._escalate(job, view.record.restart_count, book,
                                          f"rank {rank} failed to start {len(failures)} times"))
                return out
            taken = planner.taken_spares(plans, job, view.record.restart_count) | \
                {p.target for p in failures}
            site = RankSite(rank, entry.node, entry.epoch, entry.spares)
            target = planner.choose_target(
                site, dead=dead, unhealthy=unhealthy, taken=taken, racks=racks,
                prefer_original_rack=self.cfg.recovery.prefer_original_rack, holders=())
            if target is None:
                out.append(self._escalate(job, view.record.restart_count, book,
                                          f"no usable spare left for rank {rank}"))
                return out
            plan = Plan(planner.plan_id(job, rank, entry.epoch + 1), job, rank, entry.node,
                        target, entry.epoch + 1, f"its step could not start on {entry.node}",
                        last.restore_bytes, created_at=now, run=view.record.restart_count,
                        detected_at=last.finished_at)
            if self._queue(book, [plan]):
                log.warning("plan %s: rank %d of job %s could not start on %s; now %s",
                            plan.plan_id, rank, job, entry.node, target)
                out.append(f"plan {plan.plan_id} queued")
        return out

    def _queue(self, book: PlanBook, plans: list[Plan]) -> list[Plan]:
        """Write new plans, a node's move in as few transactions as the store allows (each
        guarded on its keys being absent), and book them with the revision they were
        written at, so that ``_start`` may start them in this same pass."""
        done: list[Plan] = []
        plans = [p if p.progress is not None
                 else dataclasses.replace(p, progress=self._step_of(p.job, p.rank))
                 for p in plans]
        step = MAX_TXN_OPS - 1  # the leadership guard takes one place
        for i in range(0, len(plans), step):
            chunk = plans[i:i + step]
            keys = [self.keys.plan(p.plan_id) for p in chunk]
            puts: list[TxnOp] = [Put(k, p.to_json()) for k, p in zip(keys, chunk, strict=True)]
            if not self.leadership.commit([Guard(k, 0) for k in keys], puts):
                break  # a plan of this id exists already: the next pass reads it
            kv = self.store.get(keys[0])
            rev = kv.mod_revision if kv is not None else 0  # 0: start it next pass
            for k, p in zip(keys, chunk, strict=True):
                book.plans[p.plan_id] = (p, KeyValue(k, p.to_json(), rev, rev, None))
            done.extend(chunk)
        return done

    # -- starting queued plans -----------------------------------------------------

    def _start(self, book: PlanBook, views: dict[str, JobView], now: float) -> list[str]:
        """Start queued moves within the bound: each move's plans (a node's ranks to one
        target) in as few transactions as the store allows, every one guarded by its
        plan's, rank entry's and group's revisions."""
        wait = min(self.cfg.checkpoint.interval_sec, self.cfg.recovery.recovery_timeout_sec / 2)
        every = [p for p, _ in book.plans.values()
                 if planner.migration_ready(p, book.events.get(p.plan_id, {}), now, wait)]
        out: list[str] = []
        moves: dict[tuple[str, int, str, str, float], list[tuple[list[Guard], list[TxnOp]]]] = {}
        started: dict[tuple[str, int, str, str, float], list[Plan]] = {}
        for plan in planner.to_start(every, self.cfg.recovery.max_concurrent_recoveries):
            view = views.get(plan.job)
            if view is None or view.record is None or \
                    view.record.restart_count != plan.run or plan.rank not in view.entries:
                continue  # the job was requeued or ended: the overdue pass or purge settles it
            plan_kv = book.plans[plan.plan_id][1]
            if plan_kv.mod_revision == 0:
                continue  # created this pass: its revision is unknown until the next read
            entry, entry_kv = view.entries[plan.rank]
            if entry.epoch >= plan.epoch:
                continue  # started already (a plan write lost after the entry moved)
            moved = entry.moved(plan.target, plan.epoch, "relaunched",
                                tuple(s for s in entry.spares if s != plan.target))
            ops: list[TxnOp] = [Put(entry_kv.key, moved.to_json()),
                                Put(plan_kv.key, planner.advance(plan, "running", now).to_json())]
            guards = [Guard(plan_kv.key, plan_kv.mod_revision),
                      Guard(entry_kv.key, entry_kv.mod_revision)]
            group = view.groups.get(plan.rank)
            if group is not None:
                g, gkv = group
                ops.append(Put(gkv.key, group_to_json(dataclasses.replace(g,
                                                                          primary=plan.target))))
                guards.append(Guard(gkv.key, gkv.mod_revision))
            moves.setdefault(planner.move_of(plan), []).append((guards, ops))
            started.setdefault(planner.move_of(plan), []).append(plan)
        for move, parts in moves.items():
            plans = started[move]
            ok = 0
            for i in range(0, len(parts), _PLANS_PER_TXN):
                chunk = parts[i:i + _PLANS_PER_TXN]
                if not self.leadership.commit([g for gs, _ in chunk for g in gs],
                                              [o for _, os_ in chunk for o in os_]):
                    break  # a revision moved: the rest of the move starts next pass
                ok += len(chunk)
            if ok:
                job, _, source, target, _ = move
                ranks = ",".join(str(p.rank) for p in plans[:ok])
                log.warning("move started: job %s ranks %s %s -> %s (plans %s)", job, ranks,
                            source, target, ",".join(p.plan_id for p in plans[:ok]))
                out.extend(f"plan {p.plan_id} running" for p in plans[:ok])
        return out


def _run_of(kv: KeyValue) -> int | None:
    rec = decode_escalation(kv)
    return rec.run if rec is not None else None


def _asked_to_escalate(view: JobView) -> tuple[str, int | None]:
    """The reason of the first ESCALATE verdict that speaks for this run: from the rank's
    current epoch on its current node, after the run registered ('' if none), and the rank
    if its agent found its checkpoint damaged on every holder (``lost``: the leader gives
    up; else None). A runtime escalates what no single relaunch mends (a message that
    contradicts the log, a receive that waited ``recv_timeout_sec``): the run restarts
    from its checkpoints. An agent escalates a restore that found no generation whole:
    another spare would find the same. One written with ``requeue`` false (a sender that
    could not serve a replay) is not acted on."""
    assert view.record is not None
    for rank, (at, epoch, node, reason, asks, lost) in sorted(view.escalated.items()):
        entry = view.entries.get(rank)
        if entry is None or at < view.record.registered_at or not asks:
            continue
        if epoch == entry[0].epoch and node == entry[0].node:
            return f"rank {rank} on {node} escalated: {reason}", rank if lost else None
    return "", None
