"""The plans under ``plans/`` and the phases nodes report for them
(``reports/plans/``), read in one pass: the recovery pass, ``rapsctl plans`` and the
user door read them so."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from raps_slurm.core.planner import Plan, PlanEvent
from raps_slurm.errors import RecordError
from raps_slurm.store import Keys, KeyValue, StateStore


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


def plans_in_order(plans: Iterable[Plan]) -> list[Plan]:
    """Plans by job (numerically), then creation time."""
    return sorted(plans, key=lambda p: (int(p.job), p.created_at, p.plan_id))
