"""The plans under ``plans/`` and the phases nodes report for them
(``reports/phases/<node>/``), read in one pass: the recovery pass, ``rapsctl plans`` and the
user door read them so."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from raps_slurm.core.jobs import JobRecord
from raps_slurm.core.planner import CANCELLED, Plan, PlanEvent
from raps_slurm.errors import RecordError
from raps_slurm.store import Keys, KeyValue, StateStore


@dataclass
class PlanBook:
    """Every plan under ``plans/`` with its key-value (for guards) and reported phases."""

    plans: dict[str, tuple[Plan, KeyValue]]
    events: dict[str, dict[str, PlanEvent]]
    bad: list[str]
    refused: list[str] = field(default_factory=list)  # phases from nodes not of the job

    def of_job(self, job: str, run: int) -> list[Plan]:
        """The plans of one job run."""
        return [p for p, _ in self.plans.values() if p.job == job and p.run == run]


def read_plans(store: StateStore, keys: Keys) -> PlanBook:
    """Decode ``plans/``, the phase reports (``reports/phases/<node>/``) and the admins'
    cancels (``cancels/``); malformed values are listed, not fatal. A phase report counts
    only from a node of the plan's job (its allocation, or the plan's target)."""
    book = PlanBook({}, {}, [])
    plans = keys.plans_prefix()
    for kv in store.get_prefix(plans):
        rest = kv.key[len(plans):].split("/")
        if len(rest) == 1:
            try:
                plan = Plan.from_json(kv.key, kv.value)
                if plan.plan_id != rest[0]:
                    raise RecordError(f"{kv.key}: field 'plan_id': expected {rest[0]!r}")
                book.plans[plan.plan_id] = (plan, kv)
            except RecordError as exc:
                book.bad.append(str(exc))
    members: dict[str, set[str]] = {}
    events = keys.plan_events_prefix()
    for kv in store.get_prefix(events):
        rest = kv.key[len(events):].split("/")  # <node>/<plan>/<phase>
        entry = book.plans.get(rest[1]) if len(rest) == 3 else None
        if entry is None or rest[2] == CANCELLED:
            continue  # (a plan gone with its job; a cancel only an admin may write)
        plan = entry[0]
        if plan.job not in members:
            members[plan.job] = _job_nodes(store, keys, plan.job)
        if rest[0] not in members[plan.job] | {plan.target}:
            book.refused.append(f"{kv.key}: from {rest[0]}, not a node of job {plan.job}")
            continue
        _read_event(book, kv, rest[1], rest[0])
    cancels = keys.cancels_prefix()
    for kv in store.get_prefix(cancels):
        pid = kv.key[len(cancels):]
        if pid in book.plans:
            _read_event(book, kv, pid, None)
    return book


def _job_nodes(store: StateStore, keys: Keys, job: str) -> set[str]:
    """The job's allocation as its registration says (empty if none)."""
    kv = store.get(keys.job(job))
    if kv is None:
        return set()
    try:
        return set(JobRecord.from_json(kv.key, kv.value).nodes)
    except RecordError:
        return set()


def _read_event(book: PlanBook, kv: KeyValue, pid: str, node: str | None) -> None:
    """One phase report of ``node`` (None: an admin's cancel) about plan ``pid``."""
    try:
        ev = PlanEvent.from_json(kv.key, kv.value)
        if ev.plan_id != pid:
            raise RecordError(f"{kv.key}: field 'plan_id': expected {pid!r}")
        if node is not None and ev.node != node:
            raise RecordError(f"{kv.key}: field 'node': expected {node!r}")
        if (node is None) != (ev.phase == CANCELLED):
            raise RecordError(f"{kv.key}: field 'phase': {ev.phase!r} is not reported here")
        seen = book.events.setdefault(pid, {})
        if ev.phase not in seen or ev.at < seen[ev.phase].at:  # the first report of a phase
            seen[ev.phase] = ev
    except RecordError as exc:
        book.bad.append(str(exc))


def plans_in_order(plans: Iterable[Plan]) -> list[Plan]:
    """Plans by job (numerically), then creation time."""
    return sorted(plans, key=lambda p: (int(p.job), p.created_at, p.plan_id))
