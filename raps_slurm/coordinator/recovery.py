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
  and marked done after; a leader that finds it not done asks again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from raps_slurm.config import Config
from raps_slurm.coordinator.cycle import JobView
from raps_slurm.coordinator.election import Leadership
from raps_slurm.core import planner, requeue
from raps_slurm.core.jobs import RankEntry, group_to_json
from raps_slurm.core.planner import Escalation, Plan, PlanEvent, RankSite
from raps_slurm.core.requeue import EscalationRecord
from raps_slurm.errors import RecordError, SlurmCommandError
from raps_slurm.model import JobInfo, Topology
from raps_slurm.store import Guard, Keys, KeyValue, Put, StateStore
from raps_slurm.store.base import MAX_TXN_OPS, TxnOp

log = logging.getLogger("raps.coordinator")
LAUNCH_NOTE = "the rank's step on"  # how follow_events notes a launch that failed
_PLANS_PER_TXN = MAX_TXN_OPS // 6  # a started plan guards and writes three keys
GIVE_UP_GRACE_SEC = 30.0  # raps-run ends a job RAPS gave up on; else it is cancelled


@dataclass
class PlanBook:
    """Every plan under ``plans/`` with its key-value (for guards) and reported phases."""

    plans: dict[str, tuple[Plan, KeyValue]]
    events: dict[str, dict[str, PlanEvent]]
    bad: list[str]

    def of_job(self, job: str, run: int) -> list[Plan]:
        """The plans of one job run."""
        return [p for p, _ in self.plans.values() if p.job == job and p.run == run]


def read_plans(store: StateStore, keys: Keys) -> PlanBook:
    """Decode ``plans/``, then the phase reports (``reports/plans/``); malformed values
    are listed, not fatal."""
    book = PlanBook({}, {}, [])
    plans, events = keys.plans_prefix(), keys.plan_events_prefix()
    for prefix in (plans, events):
        for kv in store.get_prefix(prefix):
            _read_plan_key(book, kv, prefix == events, kv.key[len(prefix):].split("/"))
    return book


def _read_plan_key(book: PlanBook, kv: KeyValue, event: bool, rest: list[str]) -> None:
    """One plan (``plans/<id>``) or phase report (``reports/plans/<id>/<phase>``)."""
    try:
        if not event and len(rest) == 1:
            plan = Plan.from_json(kv.key, kv.value)
            if plan.plan_id != rest[0]:
                raise RecordError(f"{kv.key}: field 'plan_id': expected {rest[0]!r}")
            book.plans[plan.plan_id] = (plan, kv)
        elif event and len(rest) == 2:
            ev = PlanEvent.from_json(kv.key, kv.value)
            book.events.setdefault(rest[0], {})[ev.phase] = ev
    except RecordError as exc:
        book.bad.append(str(exc))


class Recovery:
    """The recovery pass; :meth:`step` is called once per leader cycle."""

    def __init__(self, cfg: Config, store: StateStore, keys: Keys, leadership: Leadership, *,
                 job_info: Callable[[str], JobInfo], requeue: Callable[[str], None],
                 start_now: Callable[[str], None] = lambda job: None,
                 update_pending: Callable[[str, list[str] | None, int | None], None]
                 = lambda job, exclude, num_nodes: None,
                 cancel: Callable[[str], None] = lambda job: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.store, self.keys, self.leadership = cfg, store, keys, leadership
        self._job_info, self._requeue, self._clock = job_info, requeue, clock
        self._start_now, self._update_pending, self._cancel = start_now, update_pending, cancel
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
            asked = _asked_to_escalate(view)
            if asked:
                done.append(self._escalate(job, rec.restart_count, book, asked))
                continue
            late = planner.overdue(plans, now, self.cfg.recovery.recovery_timeout_sec)
            if late:
                done.append(self._escalate(job, rec.restart_count, book,
                                           f"plan {late[0].plan_id} not done within "
                                           f"{self.cfg.recovery.recovery_timeout_sec}s"))
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
            for plan in result:
                key = self.keys.plan(plan.plan_id)
                if self.leadership.commit([Guard(key, 0)], [Put(key, plan.to_json())]):
                    log.warning("plan %s: rank %d of job %s from dead %s to %s, epoch %d",
                                plan.plan_id, plan.rank, job, node, plan.target, plan.epoch)
                    out.append(f"plan {plan.plan_id} queued")
                    book.plans[plan.plan_id] = (plan, KeyValue(key, b"", 0, 0, None))
                taken.add(plan.target)
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
            for plan in planner.plan_migration(
                    job, node, draining[node][0], sites, dead=dead, unhealthy=unhealthy,
                    taken=taken, racks=racks,
                    prefer_original_rack=self.cfg.recovery.prefer_original_rack,
                    holders=holders, sizes={}, now=now, run=run):
                key = self.keys.plan(plan.plan_id)
                if self.leadership.commit([Guard(key, 0)], [Put(key, plan.to_json())]):
                    log.warning("plan %s: rank %d of job %s moves off %s (drained: %s) to %s",
                                plan.plan_id, plan.rank, job, node, draining[node][0],
                                plan.target)
                    out.append(f"plan {plan.plan_id} queued (planned)")
                    book.plans[plan.plan_id] = (plan, KeyValue(key, b"", 0, 0, None))
                taken.add(plan.target)
        return out

    def _plan_hung(self, job: str, view: JobView, plans: list[Plan], book: PlanBook,
                   dead: set[str], now: float) -> list[str]:
        """A rank HUNG on a live node: relaunched there from its checkpoint (raps-run kills
        the old step's srun; the old copy, fenced by the new epoch, is killed by its agent).
        Only a verdict newer than the rank's last plan counts: the old one stays in etcd."""
        assert view.record is not None
        out = []
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
            began = max([view.record.registered_at,
                         *(p.started_at or 0.0 for p in mine if p.epoch == entry.epoch)])
            if last is not None and last < began:
                continue
            size = max((r.total_size for r in view.ckpts.get(rank, [])), default=0)
            plan = planner.plan_hung_rank(job, RankSite(rank, entry.node, entry.epoch,
                                                        entry.spares),
                                          size, now, view.record.restart_count, detected_at=at)
            key = self.keys.plan(plan.plan_id)
            if self.leadership.commit([Guard(key, 0)], [Put(key, plan.to_json())]):
                log.warning("plan %s: hung rank %d of job %s relaunched on %s, epoch %d",
                            plan.plan_id, rank, job, entry.node, plan.epoch)
                book.plans[plan.plan_id] = (plan, KeyValue(key, b"", 0, 0, None))
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
            key = self.keys.plan(plan.plan_id)
            if self.leadership.commit([Guard(key, 0)], [Put(key, plan.to_json())]):
                log.warning("plan %s: rank %d of job %s could not start on %s; now %s",
                            plan.plan_id, rank, job, entry.node, target)
                book.plans[plan.plan_id] = (plan, KeyValue(key, b"", 0, 0, None))
                out.append(f"plan {plan.plan_id} queued")
        return out

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
            moved = RankEntry(plan.rank, plan.target, plan.epoch, "relaunched",
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

    # -- escalation -------------------------------------------------------------------

    def _escalate(self, job: str, run: int, book: PlanBook, reason: str) -> str:
        """Record the escalation (with what the requeued run asks Slurm for, or why RAPS
        gives up), mark the run's active plans escalated, then requeue the job."""
        now = self._clock()
        key = self.keys.job_escalation(job)
        kv = self.store.get(key)
        prev = _decode(kv)
        if prev is None or prev.run != run:
            rec = requeue.escalate(prev, run, reason, now,
                                   max_requeues=self.cfg.recovery.max_requeues,
                                   window=float(self.cfg.recovery.requeue_window_sec))
            rec = dataclasses.replace(rec, **self._shape(job))
            guard = Guard(key, kv.mod_revision if kv is not None else 0)
            if not self.leadership.commit([guard], [Put(key, rec.to_json())]):
                return f"job {job}: escalation raced; retry next cycle"
            if rec.gave_up:
                log.error("job %s run %d: %s", job, run, rec.gave_up)
            else:
                log.error("job %s run %d escalates to a whole-job requeue: %s%s", job, run,
                          reason, _shape_text(rec))
        else:
            rec = prev
        for plan, pkv in [book.plans[p] for p in sorted(book.plans)]:
            if plan.job == job and plan.run == run and plan.active:
                self.leadership.commit([Guard(pkv.key, pkv.mod_revision)], [Put(
                    pkv.key, planner.advance(plan, "escalated", now,
                                             rec.gave_up or reason).to_json())])
        if rec.gave_up:
            return self._gave_up(job, rec) or f"job {job}: raps gave up"
        return self._requeue_job(job, run) or f"job {job}: escalated ({reason})"

    def _shape(self, job: str) -> dict[str, Any]:
        """``exclude`` and ``num_nodes`` for the requeued run of ``job``."""
        view = self._views.get(job)
        if view is None or view.record is None:
            return {}
        working = (len(set(view.rank_map.nodes)) if view.rank_map is not None
                   and view.rank_map.nodes else len(set(view.record.nodes)))
        everyone = ({n for nodes in self._topology.racks().values() for n in nodes}
                    if self._topology is not None else set(view.record.nodes))
        exclude = set(view.record.nodes) & self._dead
        available = len(everyone - self._dead - self._unhealthy - exclude)
        nodes, count = requeue.requeue_shape(view.record.nodes, working, self._dead, available)
        return {"exclude": nodes, "num_nodes": count}

    def _escalations(self, job: str, run: int) -> list[str]:
        """An escalation of this run recorded but not yet carried out: ask Slurm (again),
        or end a job RAPS gave up on."""
        rec = _decode(self.store.get(self.keys.job_escalation(job)))
        if rec is None or rec.run != run:
            return []
        if rec.gave_up:
            line = self._gave_up(job, rec)
            return [line] if line else []
        if rec.requeued_at is not None:
            return []
        return [self._requeue_job(job, run)]

    def _gave_up(self, job: str, rec: EscalationRecord) -> str:
        """raps-run reads ``gave_up`` through its agent, prints it in the job's output,
        stops the ranks and exits non-zero, so Slurm marks the job FAILED. If the job still
        runs ``GIVE_UP_GRACE_SEC`` later (its batch script's node is dead, say), it is
        cancelled."""
        if rec.cancelled_at is not None or self._clock() - rec.at < GIVE_UP_GRACE_SEC:
            return ""
        try:
            if self._job_info(job).state not in ("RUNNING", "PENDING", "SUSPENDED"):
                return ""
            self._cancel(job)
        except SlurmCommandError as exc:
            return f"job {job}: cannot cancel it after giving up ({exc})"
        key = self.keys.job_escalation(job)
        kv = self.store.get(key)
        if kv is not None:
            self.leadership.commit([Guard(key, kv.mod_revision)], [Put(key, dataclasses.replace(
                rec, cancelled_at=self._clock()).to_json())])
        log.error("job %s cancelled: %s", job, rec.gave_up)
        return f"job {job}: cancelled (raps gave up)"

    def _lift(self, job: str, kv: KeyValue, rec: EscalationRecord, view: JobView
              ) -> list[str]:
        """A released run that has not started, excluded from nodes that are back (their
        DEAD verdict cleared): Slurm may be holding it for want of them (a count that
        needs them), and would for ever: the exclusion shrinks to the nodes still dead."""
        back = [n for n in rec.exclude if n not in self._dead]
        started = view.rank_map is not None and view.rank_map.restart_count > rec.run
        if not back or started:
            return []
        still = [n for n in rec.exclude if n in self._dead]
        try:
            if self._job_info(job).state != "PENDING":
                return []
            self._update_pending(job, still, None)
            self._start_now(job)
        except SlurmCommandError as exc:
            return [f"job {job}: cannot lift the requeued run's exclusions yet ({exc})"]
        self.leadership.commit([Guard(kv.key, kv.mod_revision)], [Put(
            kv.key, dataclasses.replace(rec, exclude=tuple(still)).to_json())])
        log.warning("job %s: %s back, no longer excluded from the requeued run", job,
                    ",".join(back))
        return [f"job {job}: requeued run may use {','.join(back)} again"]

    def _release(self, job: str, kv: KeyValue, view: JobView) -> list[str]:
        """A job requeued by an escalation waits out Slurm's requeue delay (BeginTime):
        once Slurm shows it pending again, apply what the run asks for (dead nodes
        excluded, fewer nodes) and start it."""
        rec = _decode(kv)
        if rec is None or rec.requeued_at is None:
            return []
        if rec.released_at is not None:
            return self._lift(job, kv, rec, view)
        try:
            if self._job_info(job).state != "PENDING":
                return []  # still completing; next cycle
            if rec.exclude or rec.num_nodes is not None:
                self._update_pending(job, list(rec.exclude) or None, rec.num_nodes)
            self._start_now(job)
        except SlurmCommandError as exc:
            return [f"job {job}: cannot start the requeued job yet ({exc})"]
        self.leadership.commit([Guard(kv.key, kv.mod_revision)], [Put(
            kv.key, dataclasses.replace(rec, released_at=self._clock()).to_json())])
        log.warning("job %s: requeued run starts now%s", job, _shape_text(rec))
        return [f"job {job}: requeued run released"]

    def _requeue_job(self, job: str, run: int) -> str:
        key = self.keys.job_escalation(job)
        try:
            self._requeue(job)
        except SlurmCommandError as exc:
            log.error("job %s: requeue failed: %s", job, exc)
            return f"job {job}: requeue failed ({exc})"
        kv = self.store.get(key)
        rec = _decode(kv)
        if kv is not None and rec is not None and rec.run == run:
            self.leadership.commit([Guard(key, kv.mod_revision)], [Put(
                key, requeue.requeued(rec, self._clock()).to_json())])
        log.error("job %s run %d requeued: its ranks restore their newest checkpoints", job, run)
        return f"job {job}: requeued"


def _decode(kv: KeyValue | None) -> EscalationRecord | None:
    if kv is None:
        return None
    try:
        return EscalationRecord.from_json(kv.key, kv.value)
    except RecordError as exc:
        log.error("skipping malformed value: %s", exc)
        return None


def _shape_text(rec: EscalationRecord) -> str:
    parts = []
    if rec.exclude:
        parts.append(f"excluding {','.join(rec.exclude)} (DEAD)")
    if rec.num_nodes is not None:
        parts.append(f"asking for {rec.num_nodes} nodes")
    return f" ({'; '.join(parts)})" if parts else ""


def _run_of(kv: KeyValue) -> int | None:
    rec = _decode(kv)
    return rec.run if rec is not None else None


def plans_in_order(plans: Iterable[Plan]) -> list[Plan]:
    """Plans by job (numerically), then creation time."""
    return sorted(plans, key=lambda p: (int(p.job), p.created_at, p.plan_id))


def _asked_to_escalate(view: JobView) -> str:
    """The reason of the first ESCALATE verdict that speaks for this run: from the rank's
    current epoch on its current node, after the run registered ('' if none). A runtime
    escalates what no single relaunch mends (a message that contradicts the log, a
    receive that waited ``recv_timeout_sec``): the run restarts from its checkpoints. One
    written with ``requeue`` false (a sender that could not serve a replay) is not acted
    on."""
    assert view.record is not None
    for rank, (at, epoch, node, reason, asks) in sorted(view.escalated.items()):
        entry = view.entries.get(rank)
        if entry is None or at < view.record.registered_at or not asks:
            continue
        if epoch == entry[0].epoch and node == entry[0].node:
            return f"rank {rank} on {node} escalated: {reason}"
    return ""
