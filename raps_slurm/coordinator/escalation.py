"""Escalation of a job run to a whole-job requeue, the half of the leader's recovery
pass (:class:`~raps_slurm.coordinator.recovery.Recovery`) that asks Slurm: recorded in
``jobs/<id>/escalation`` before the requeue and marked done after, the requeued run
released with dead nodes excluded, and a job RAPS gave up on cancelled if it runs on."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from raps_slurm.config import Config
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.plan_book import PlanBook
from raps_slurm.coordinator.snapshot import JobView
from raps_slurm.core import planner, requeue
from raps_slurm.core.requeue import EscalationRecord
from raps_slurm.errors import RecordError, SlurmCommandError
from raps_slurm.model import JobInfo, Topology
from raps_slurm.store import Guard, Keys, KeyValue, Put, StateStore

log = logging.getLogger("raps.coordinator")
GIVE_UP_GRACE_SEC = 30.0  # raps-run ends a job RAPS gave up on; else it is cancelled


class Escalations:
    """The escalation half of :class:`~raps_slurm.coordinator.recovery.Recovery` (which
    sets these attributes, and ``_views`` to ``_topology`` on every pass)."""

    cfg: Config
    store: StateStore
    keys: Keys
    leadership: Leadership
    _job_info: Callable[[str], JobInfo]
    _requeue: Callable[[str], None]
    _start_now: Callable[[str], None]
    _update_pending: Callable[[str, list[str] | None, int | None], None]
    _cancel: Callable[[str], None]
    _clock: Callable[[], float]
    _views: dict[str, JobView]
    _dead: set[str]
    _unhealthy: set[str]
    _topology: Topology | None

    def _escalate(self, job: str, run: int, book: PlanBook, reason: str,
                  lost: int | None = None) -> str:
        """Record the escalation (with what the requeued run asks Slurm for, or why RAPS
        gives up), mark the run's active plans escalated, then requeue the job. ``lost``:
        the rank whose checkpoint could not be restored, when that is the reason."""
        now = self._clock()
        key = self.keys.job_escalation(job)
        kv = self.store.get(key)
        prev = decode_escalation(kv)
        if prev is None or prev.run != run:
            rec = requeue.escalate(prev, run, reason, now,
                                   max_requeues=self.cfg.recovery.max_requeues,
                                   window=float(self.cfg.recovery.requeue_window_sec),
                                   lost=lost)
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
        rec = decode_escalation(self.store.get(self.keys.job_escalation(job)))
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
        rec = decode_escalation(kv)
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
        rec = decode_escalation(kv)
        if kv is not None and rec is not None and rec.run == run:
            self.leadership.commit([Guard(key, kv.mod_revision)], [Put(
                key, requeue.requeued(rec, self._clock()).to_json())])
        log.error("job %s run %d requeued: its ranks restore their newest checkpoints", job, run)
        return f"job {job}: requeued"


def decode_escalation(kv: KeyValue | None) -> EscalationRecord | None:
    """The escalation record in ``kv`` (``jobs/<id>/escalation``); None if absent or
    malformed (logged)."""
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
