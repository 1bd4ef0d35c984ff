"""Recovery ops of the agent's local API: what ``raps-run`` (the job's owner, never root
by necessity, never an etcd client: docs/architecture.md, Trust boundaries) asks about
its job, and what it and the ranks report about a recovery.

``job_layout {job}``  only the job's owner: ``ready`` once the coordinator mapped the
    job's current run; then ``run`` (restart count), ``size``, ``ranks`` as
    ``[rank, node, epoch]``, ``spares``; ``error`` when the job cannot be mapped.
``job_plans {job}``  only the job's owner: the job's recovery plans (``plan_id``, ``run``,
    ``rank``, ``target``, ``epoch``, ``state``), ``escalated`` (the run the leader
    requeues, or null) and ``gave_up`` (why RAPS stopped requeueing the job, or "").
``job_step {job, run, phase}``  only the job's owner (``raps-run --restart-mode step``):
    ``stopping`` before it kills the job's MPI step for a restart, ``started`` once it
    started one; the agent stamps the time in ``reports/ranks/<node>/<job>/steps/<run>``,
    so that the leader does not take the ranks' silence during a restart for a hang.
``recovery_event {job, rank, epoch, phase, detail}``  ``launched`` and ``launch_failed``
    (the step ended before the rank restored): the job's owner, for a plan that exists;
    ``running`` and ``caught_up``: only the registered rank with that epoch (its first
    progress report after the restore, and its first at its pre-fault progress). First
    report wins; ``restored`` is written by the agent itself when it restores a
    relaunched rank. Each report is charged as an etcd write of the job
    (:mod:`raps_slurm.agent.quota`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import typing
from collections.abc import Callable

from raps_slurm.agent.api_schema import EPOCH, JOB, RANK, Check, Refused
from raps_slurm.agent.local_api import (
    Extension,
    Peer,
    RankTable,
    close_fds,
    registered_epoch,
    require_owner,
)
from raps_slurm.agent.quota import JobQuotas
from raps_slurm.core.jobs import JobRecord, RankEntry, RankMap
from raps_slurm.core.planner import Plan, PlanEvent, plan_id
from raps_slurm.core.requeue import EscalationRecord
from raps_slurm.errors import RecordError, StoreError
from raps_slurm.store import Keys, StateStore

log = logging.getLogger("raps.agent")

_PHASE: Check = (lambda v: v in ("launched", "launch_failed", "running", "caught_up",
                                 "checkpointed"),
                 "'launched', 'launch_failed', 'running', 'caught_up' or 'checkpointed'")
_STEP_PHASE: Check = (lambda v: v in ("stopping", "started"), "'stopping' or 'started'")
_RUN: Check = (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31,
               "a run number 0..2^31-1")
_DETAIL: Check = (lambda v: isinstance(v, dict) and len(json.dumps(v)) <= 4096,
                  "an object of at most 4 KiB")


def record_event(store: StateStore, keys: Keys, node: str, pid: str, phase: str,
                 detail: dict[str, object], at: float | None = None) -> bool:
    """Write ``reports/phases/<node>/<pid>/<phase>`` if the plan exists and this node has
    not yet reported the phase.

    Returns True when written. An etcd failure is logged, not raised: a report must never
    fail the rank's restore or launch (the leader then times the plan out).
    """
    try:
        kv = store.get(keys.plan(pid))
        if kv is None or not Plan.from_json(kv.key, kv.value).active:
            return False  # no plan (a requeued run restores on its own), or one given up
        event = PlanEvent(pid, phase, time.time() if at is None else at, node, detail)
        wrote = store.create(keys.plan_event(node, pid, phase), event.to_json())
    except (StoreError, RecordError) as exc:
        log.warning("plan %s: phase %s not recorded: %s", pid, phase, exc)
        return False
    if wrote:
        log.info("plan %s: %s on %s %s", pid, phase, node, json.dumps(detail, default=str))
    return wrote


class RecoveryOps:
    """The handlers."""

    def __init__(self, store: StateStore, keys: Keys, node: str, ranks: RankTable,
                 owner_of: Callable[[str], int | None],
                 quotas: JobQuotas | None = None) -> None:
        self.store, self.keys, self.node, self.ranks = store, keys, node, ranks
        self._owner_of = owner_of
        self.quotas = quotas if quotas is not None else JobQuotas()

    def extensions(self) -> dict[str, Extension]:
        """What :class:`LocalApiServer` serves for recovery."""
        return {
            "job_layout": Extension({"job": JOB}, self.layout),
            "job_plans": Extension({"job": JOB}, self.plans),
            "job_step": Extension({"job": JOB, "run": _RUN, "phase": _STEP_PHASE},
                                  self.step),
            "recovery_event": Extension({"job": JOB, "rank": RANK, "epoch": EPOCH,
                                         "phase": _PHASE, "detail": _DETAIL}, self.event),
        }

    def layout(self, f: dict[str, object], peer: Peer, fds: list[int]
               ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job = typing.cast(str, f["job"])
        require_owner(self._owner_of, peer, job)
        not_ready: dict[str, object] = {"ok": True, "ready": False}
        kv = self.store.get(self.keys.job(job))
        mkv = self.store.get(self.keys.job_map(job))
        if kv is None or mkv is None:
            return not_ready, []
        try:
            record = JobRecord.from_json(kv.key, kv.value)
            rank_map = RankMap.from_json(mkv.key, mkv.value)
            entries = [RankEntry.from_json(e.key, e.value)
                       for e in self.store.get_prefix(self.keys.job_ranks_prefix(job))]
        except RecordError as exc:
            raise Refused("record", f"job {job}: {exc}") from None
        if rank_map.restart_count != record.restart_count:
            return not_ready, []
        if rank_map.error:
            return {"ok": True, "ready": True, "run": record.restart_count,
                    "error": rank_map.error, "size": 0, "ranks": [], "spares": []}, []
        size = len(rank_map.nodes)
        ranks = sorted((e.rank, e.node, e.epoch) for e in entries if e.rank < size)
        if len(ranks) != size:
            return not_ready, []  # the map is written last, but an entry may lag a read
        return {"ok": True, "ready": True, "run": record.restart_count, "error": "",
                "size": size, "ranks": [list(r) for r in ranks],
                "spares": list(rank_map.spares)}, []

    def plans(self, f: dict[str, object], peer: Peer, fds: list[int]
              ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job = typing.cast(str, f["job"])
        require_owner(self._owner_of, peer, job)
        out = []
        prefix = self.keys.plans_prefix()
        for kv in self.store.get_prefix(self.keys.job_plans_prefix(job)):
            if "/" in kv.key[len(prefix):]:
                continue  # a phase report
            try:
                p = Plan.from_json(kv.key, kv.value)
            except RecordError as exc:
                log.warning("job_plans: %s", exc)
                continue
            if p.job == job:
                out.append({"plan_id": p.plan_id, "run": p.run, "rank": p.rank,
                            "target": p.target, "epoch": p.epoch, "state": p.state,
                            "planned": p.planned})
        escalated, gave_up = None, ""
        ekv = self.store.get(self.keys.job_escalation(job))
        if ekv is not None:
            try:
                rec = EscalationRecord.from_json(ekv.key, ekv.value)
                escalated, gave_up = rec.run, rec.gave_up
            except RecordError as exc:
                log.warning("job_plans: %s", exc)
        return {"ok": True, "plans": out, "escalated": escalated, "gave_up": gave_up}, []

    def step(self, f: dict[str, object], peer: Peer, fds: list[int]
             ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, run = typing.cast(str, f["job"]), typing.cast(int, f["run"])
        phase = typing.cast(str, f["phase"])
        require_owner(self._owner_of, peer, job)
        # only the job's current run: one key per run the job really had
        rkv = self.store.get(self.keys.job(job))
        try:
            current = JobRecord.from_json(rkv.key, rkv.value).restart_count if rkv else None
        except RecordError as exc:
            raise Refused("record", f"job {job}: {exc}") from None
        if current != run:
            raise Refused("run", f"job {job} is in run {current}, not {run}")
        key = self.keys.job_step(self.node, job, run)
        value: dict[str, object] = {"stopping_at": None, "started_at": None}
        kv = self.store.get(key)
        if kv is not None:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                old = json.loads(kv.value)
                value.update({k: old.get(k) for k in value
                              if isinstance(old.get(k), (int, float))})
        value[f"{phase}_at"] = time.time()  # this agent's clock, not the caller's
        raw = json.dumps(value).encode()
        self.store.put(key, self.quotas.write("job_step", job, peer.uid, raw))
        return {"ok": True}, []

    def event(self, f: dict[str, object], peer: Peer, fds: list[int]
              ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        epoch, phase = typing.cast(int, f["epoch"]), typing.cast(str, f["phase"])
        if phase in ("launched", "launch_failed", "checkpointed"):
            require_owner(self._owner_of, peer, job)
        else:
            registered = registered_epoch(self.ranks, peer, job, rank)
            if registered is not None and registered != epoch:
                raise Refused("epoch", f"epoch {epoch} is not the registered epoch "
                                       f"{registered} of rank {rank} of job {job}")
        detail = typing.cast(dict[str, object], f["detail"])
        self.quotas.write("recovery_event", job, peer.uid, json.dumps(detail).encode())
        wrote = record_event(self.store, self.keys, self.node, plan_id(job, rank, epoch),
                             phase, detail)
        return {"ok": True, "recorded": wrote}, []
