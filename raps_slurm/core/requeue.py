"""Whole-job requeues: when RAPS gives up, and what the requeued run asks Slurm for.
Pure: no I/O.

A requeue is the fallback when a job cannot be recovered node by node. Two things keep
it from looping:

- the requeued run excludes every node of the job's allocation that is under a DEAD
  verdict (Slurm's ``ExcNodeList``): an admin may have resumed such a node in Slurm while
  RAPS still holds it dead, and the next run would be placed on it again. If the nodes
  left in the cluster cannot hold the job's node count, the run asks for fewer nodes,
  at most as many fewer as it had spares (``NumNodes``): it keeps its ranks and runs
  with fewer spares rather than waiting for the dead nodes to return;
- after ``recovery.max_requeues`` requeues within ``recovery.requeue_window_sec``, RAPS
  gives up: the job fails with the reason, which ``rapsctl show job`` and the job's
  output (raps-run) show;
- a rank whose checkpoint was found damaged on every holder (generations exist, none
  whole, every holder answered) makes RAPS give up at once: no requeue can restore it.
  (One whose holders were out of reach escalates like any other case: a requeue, which
  may find them back, within the budget above.)
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from raps_slurm.errors import RecordError


@dataclass(frozen=True)
class EscalationRecord:
    """``jobs/<id>/escalation``: the last whole-job requeue decided for the job.

    ``requeues``: when each requeue of the job was asked of Slurm (the window's
    history); ``gave_up``: why RAPS stopped requeueing ("" while it has not);
    ``exclude`` / ``num_nodes``: what the requeued run asks Slurm for (applied while the
    job is pending, before it is released); ``lost``: the rank whose checkpoint was found
    damaged on every holder, when that is why the run escalated."""

    run: int
    reason: str
    at: float
    requeued_at: float | None = None
    released_at: float | None = None
    requeues: tuple[float, ...] = ()
    gave_up: str = ""
    exclude: tuple[str, ...] = ()
    num_nodes: int | None = None
    cancelled_at: float | None = None
    lost: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> bytes:
        """The etcd value."""
        return json.dumps({**self.extra, "run": self.run, "reason": self.reason, "at": self.at,
                           "requeued_at": self.requeued_at, "released_at": self.released_at,
                           "requeues": list(self.requeues), "gave_up": self.gave_up,
                           "exclude": list(self.exclude), "num_nodes": self.num_nodes,
                           "cancelled_at": self.cancelled_at, "lost": self.lost}).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> EscalationRecord:
        """Decode; RecordError naming the key and the field if malformed. Fields this
        version added are optional (records written before them stay readable)."""
        try:
            d = json.loads(raw)
        except ValueError as exc:
            raise RecordError(f"{key}: not JSON ({exc})") from None
        if not isinstance(d, dict):
            raise RecordError(f"{key}: expected a JSON object")

        def num(name: str, optional: bool = True) -> float | None:
            v = d.get(name)
            if v is None and optional:
                return None
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise RecordError(f"{key}: field {name!r}: expected a number, got {v!r:.40}")
            return float(v)

        run = d.get("run")
        if isinstance(run, bool) or not isinstance(run, int) or run < 0:
            raise RecordError(f"{key}: field 'run': expected an integer >= 0, got {run!r:.40}")
        requeues = d.get("requeues") or []
        exclude = d.get("exclude") or []
        nn = d.get("num_nodes")
        if not isinstance(requeues, list) or not all(
                isinstance(t, int | float) and not isinstance(t, bool) for t in requeues):
            raise RecordError(f"{key}: field 'requeues': expected a list of times")
        if not isinstance(exclude, list) or not all(isinstance(n, str) for n in exclude):
            raise RecordError(f"{key}: field 'exclude': expected a list of node names")
        if nn is not None and (isinstance(nn, bool) or not isinstance(nn, int) or nn < 1):
            raise RecordError(f"{key}: field 'num_nodes': expected an integer >= 1 or null")
        lost = d.get("lost")
        if lost is not None and (isinstance(lost, bool) or not isinstance(lost, int)
                                 or lost < 0):
            raise RecordError(f"{key}: field 'lost': expected a rank (integer >= 0) or null, "
                              f"got {lost!r:.40}")
        known = {"run", "reason", "at", "requeued_at", "released_at", "requeues", "gave_up",
                 "exclude", "num_nodes", "cancelled_at", "lost"}
        return cls(run, str(d.get("reason") or ""), num("at", False) or 0.0,
                   num("requeued_at"), num("released_at"),
                   tuple(float(t) for t in requeues), str(d.get("gave_up") or ""),
                   tuple(exclude), nn, num("cancelled_at"), lost,
                   {k: v for k, v in d.items() if k not in known})


def recent(requeues: Iterable[float], now: float, window: float) -> tuple[float, ...]:
    """The requeue times inside the window ending ``now``."""
    return tuple(t for t in requeues if now - t <= window)


def give_up(previous: EscalationRecord | None, reason: str, now: float, max_requeues: int,
            window: float, lost: int | None = None) -> str:
    """Why RAPS stops requeueing this job now ("" when it requeues once more): rank
    ``lost``'s checkpoint is damaged on every holder, or RAPS already asked Slurm for
    ``max_requeues`` requeues within ``window`` seconds."""
    if lost is not None:
        return (f"rank {lost}'s checkpoint is damaged on every holder: {reason}; its state "
                "since the job began is lost, so resubmit the job to start it again")
    history = recent(previous.requeues if previous else (), now, window)
    if len(history) < max_requeues:
        return ""
    return (f"raps gave up after {len(history)} whole-job requeue"
            f"{'s' if len(history) != 1 else ''} within {window:g}s "
            f"(recovery.max_requeues={max_requeues}); last: {reason}")


def escalate(previous: EscalationRecord | None, run: int, reason: str, now: float, *,
             max_requeues: int, window: float, lost: int | None = None) -> EscalationRecord:
    """The record of a new escalation of ``run``: the history carried over (inside the
    window), ``gave_up`` set when the requeue budget is spent or ``lost`` (the rank whose
    checkpoint is damaged on every holder, when that is why ``run`` escalates)."""
    history = recent(previous.requeues if previous else (), now, window)
    return EscalationRecord(run, reason, now, requeues=history, lost=lost,
                            gave_up=give_up(previous, reason, now, max_requeues, window,
                                            lost))


def requeued(record: EscalationRecord, now: float) -> EscalationRecord:
    """The record once Slurm took the requeue: the time joins the history."""
    if record.requeued_at is not None:
        return record
    return replace(record, requeued_at=now, requeues=(*record.requeues, now))


def requeue_shape(allocated: Collection[str], working: int, dead: Collection[str],
                  available: int) -> tuple[tuple[str, ...], int | None]:
    """What the requeued run asks Slurm for: (nodes to exclude, node count or None to keep
    the job's own).

    ``allocated``: the nodes of the run that escalates; ``working``: how many of them ran
    ranks (the rest were spares, or unusable); ``dead``: nodes under a DEAD verdict;
    ``available``: cluster nodes that could run the job now (not dead, not drained or
    down, not excluded). Dead nodes of the allocation are excluded. The node count drops
    only when ``available`` cannot meet it, and never below ``working``: the ranks keep
    their nodes, the run has fewer spares.
    """
    exclude = tuple(sorted(set(allocated) & set(dead)))
    want = len(set(allocated))
    count = max(working, min(available, want))
    return exclude, count if count < want else None
