"""Recovery plans: which ranks to relaunch where, in which order, and when to give up.

Pure: no I/O. The coordinator (recovery issue) feeds it the verdicts, the job's rank
entries and where each rank's checkpoints are, persists the plans it returns in etcd
(``plans/<id>``) and carries them out step by step.

Rules:
- the node is the unit: a DEAD node's ranks all move to one target (one plan per rank,
  each with its next epoch; together they are one *move*), taken from their spare order:
  a spare that is not dead, not unhealthy (SUSPECT, DEGRADED, DRAIN) and not taken by
  another plan; outside the dead node's rack, unless ``prefer_original_rack`` and that
  rack is healthy (no other dead or unhealthy node in it); among those, a spare that
  already holds the newest checkpoints of the most of those ranks first (least
  transfer), then the spare order;
- a node with no usable spare, or a dead batch-script node, escalates the whole job
  (``scontrol requeue``; every rank then restores its newest committed checkpoint);
- a HUNG rank is restarted on its own node;
- the queue is cluster-wide and bounded by ``max_concurrent_recoveries`` moves (nodes),
  largest restore first; a move starts whole; a plan counts as running until its rank
  is launched **and restored**,
  not until its replay ends (a restored rank may wait in replay for a neighbour whose
  plan is still queued; holding the queue meanwhile would deadlock them);
- a plan whose rank is not running again within ``recovery_timeout_sec``, or that stalls
  (a HUNG verdict) while it re-executes its lost work, escalates;
- a started plan whose target dies before it is done has ``failed``: the rank, now on a
  dead node with the plan's epoch, gets a new plan with the next epoch; a queued plan
  whose target died is given another target instead (``retarget``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from raps_slurm.core.records import Reader, dump
from raps_slurm.errors import RecordError

STATES = ("queued", "running", "restored", "done", "escalated", "failed")
ACTIVE = ("queued", "running", "restored")


@dataclass(frozen=True)
class RankSite:
    """Where one rank runs now and where it may go."""

    rank: int
    node: str
    epoch: int
    spares: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """``plans/<id>``: relaunch one rank of one job on ``target`` with ``epoch``."""

    plan_id: str
    job: str
    rank: int
    source: str
    target: str
    epoch: int
    reason: str
    restore_bytes: int
    state: str = "queued"
    created_at: float = 0.0
    started_at: float | None = None
    restored_at: float | None = None
    finished_at: float | None = None
    note: str = ""
    run: int = 0  # the job run (Slurm restart count) the plan belongs to
    detected_at: float | None = None  # when the fault verdict was given
    planned: bool = False  # a move off a live node drained for health (not a failure)
    # the rank's last reported step when the plan was made (None: it reported none): the
    # relaunched rank has caught up once it reports this step again
    progress: int | None = None

    @property
    def active(self) -> bool:
        """Queued, launching or restoring: not yet finished one way or the other."""
        return self.state in ACTIVE

    def to_json(self) -> bytes:
        """The etcd value."""
        return dump({"plan_id": self.plan_id, "job": self.job, "rank": self.rank,
                     "source": self.source, "target": self.target, "epoch": self.epoch,
                     "reason": self.reason, "restore_bytes": self.restore_bytes,
                     "state": self.state, "created_at": self.created_at,
                     "started_at": self.started_at, "restored_at": self.restored_at,
                     "finished_at": self.finished_at, "note": self.note, "run": self.run,
                     "detected_at": self.detected_at, "planned": self.planned,
                     "progress": self.progress})

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> Plan:
        """Decode; RecordError naming the key and the field if malformed."""
        r = Reader(key, raw)
        plan = cls(r.text("plan_id"), r.text("job"), r.integer("rank", 0, 2**31 - 1),
                   r.text("source"), r.text("target"), r.integer("epoch", 1),
                   r.text("reason"), r.integer("restore_bytes"), r.choice("state", STATES),
                   r.num("created_at"), r.opt_num("started_at"), r.opt_num("restored_at"),
                   r.opt_num("finished_at"), r.text("note", empty=True), r.integer("run"),
                   r.opt_num("detected_at"))
        planned = r.data.get("planned", False)
        if not isinstance(planned, bool):
            raise RecordError(f"{key}: field 'planned': expected true or false, "
                              f"got {planned!r:.40}")
        plan = replace(plan, planned=planned, progress=r.opt_integer("progress"))
        if not plan.job.isdigit():
            raise RecordError(f"{key}: field 'job': expected a job id, got {plan.job!r:.40}")
        return plan


@dataclass(frozen=True)
class Escalation:
    """The job cannot be recovered rank by rank: requeue it whole."""

    job: str
    reason: str


def rack_of(racks: Mapping[str, Collection[str]], node: str) -> str | None:
    """The rack holding ``node`` (first by name), None if it is in none."""
    for name in sorted(racks):
        if node in racks[name]:
            return name
    return None


def choose_target(site: RankSite, *, dead: Collection[str], unhealthy: Collection[str],
                  taken: Collection[str], racks: Mapping[str, Collection[str]],
                  prefer_original_rack: bool, holders: Collection[str]) -> str | None:
    """The spare to relaunch ``site``'s rank on, None if none is usable."""
    bad = set(dead) | set(unhealthy) | set(taken)
    usable = [s for s in site.spares if s not in bad and s != site.node]
    if not usable:
        return None
    home = rack_of(racks, site.node)
    home_nodes = set(racks.get(home, ())) if home else set()
    home_healthy = home is not None and not (home_nodes - {site.node}) & (set(dead)
                                                                         | set(unhealthy))
    if prefer_original_rack and home_healthy:
        allowed = usable
    else:
        allowed = [s for s in usable if s not in home_nodes]
    if not allowed:
        return None
    held = [s for s in allowed if s in holders]
    return held[0] if held else allowed[0]


def _node_target(node: str, sites: list[RankSite], *, dead: Collection[str],
                 unhealthy: Collection[str], taken: Collection[str],
                 racks: Mapping[str, Collection[str]], prefer_original_rack: bool,
                 holders: Mapping[int, Collection[str]]) -> str | None:
    """One spare for all of a node's ranks: chosen as for its lowest rank (ranks of one
    node share their spare order), preferring a spare that holds the newest checkpoint
    of every rank, then of the most ranks."""
    counts: dict[str, int] = {}
    for site in sites:
        for h in set(holders.get(site.rank, ())):
            counts[h] = counts.get(h, 0) + 1
    best = max(counts.values(), default=0)
    held = {h for h, c in counts.items() if c == best} if best else set()
    return choose_target(sites[0], dead=dead, unhealthy=unhealthy, taken=taken, racks=racks,
                         prefer_original_rack=prefer_original_rack, holders=held)


def plan_dead_node(job: str, node: str, sites: Iterable[RankSite], *, batch_host: str,
                   dead: Collection[str], unhealthy: Collection[str],
                   taken: Collection[str], racks: Mapping[str, Collection[str]],
                   prefer_original_rack: bool, holders: Mapping[int, Collection[str]],
                   sizes: Mapping[int, int], now: float, run: int = 0,
                   detected_at: float | None = None) -> list[Plan] | Escalation:
    """Plans moving every rank of ``job`` that ran on the dead ``node`` to one spare node
    (one plan per rank, each with its own next epoch: one move), or an escalation."""
    if node == batch_host:
        return Escalation(job, f"the batch script's node {node} is dead")
    mine = sorted((s for s in sites if s.node == node), key=lambda s: s.rank)
    if not mine:
        return []
    target = _node_target(node, mine, dead=dead, unhealthy=unhealthy, taken=taken,
                          racks=racks, prefer_original_rack=prefer_original_rack,
                          holders=holders)
    if target is None:
        ranks = ",".join(str(s.rank) for s in mine)
        return Escalation(job, f"no usable spare node for the ranks of {node} "
                               f"(rank{'s' if len(mine) > 1 else ''} {ranks}) of job {job}")
    return [Plan(plan_id(job, site.rank, site.epoch + 1), job, site.rank, node, target,
                 site.epoch + 1, f"node {node} is dead", sizes.get(site.rank, 0),
                 created_at=now, run=run, detected_at=detected_at) for site in mine]


def plan_migration(job: str, node: str, why: str, sites: Iterable[RankSite], *,
                   dead: Collection[str], unhealthy: Collection[str], taken: Collection[str],
                   racks: Mapping[str, Collection[str]], prefer_original_rack: bool,
                   holders: Mapping[int, Collection[str]], sizes: Mapping[int, int],
                   now: float, run: int = 0) -> list[Plan]:
    """``planned`` plans moving ``job``'s ranks off ``node``, alive but drained for health
    (``why``), together to one spare chosen as for a dead node. Never an escalation: with
    no usable spare the ranks stay where they are (their node still works); the batch
    script stays too."""
    mine = sorted((s for s in sites if s.node == node), key=lambda s: s.rank)
    if not mine:
        return []
    target = _node_target(node, mine, dead=dead, unhealthy=set(unhealthy) | {node},
                          taken=taken, racks=racks,
                          prefer_original_rack=prefer_original_rack, holders=holders)
    if target is None:
        return []
    return [Plan(plan_id(job, site.rank, site.epoch + 1), job, site.rank, node, target,
                 site.epoch + 1, f"planned: {node} drained: {why}", sizes.get(site.rank, 0),
                 created_at=now, run=run, planned=True) for site in mine]


def migration_ready(plan: Plan, events: Mapping[str, PlanEvent], now: float,
                    wait: float) -> bool:
    """A planned plan starts once raps-run reported the rank ``checkpointed`` (it saved and
    stopped), or ``wait`` seconds after it was made (the rank then restores its newest
    earlier checkpoint and replays, as after a crash)."""
    return not plan.planned or CHECKPOINTED in events or now - plan.created_at >= wait


def plan_hung_rank(job: str, site: RankSite, size: int, now: float, run: int = 0,
                   detected_at: float | None = None) -> Plan:
    """A HUNG rank: restarted in place on its own node from its checkpoint (its node's
    supervisor does it, with no new Slurm step)."""
    return Plan(plan_id(job, site.rank, site.epoch + 1), job, site.rank, site.node, site.node,
                site.epoch + 1, f"rank {site.rank} is hung", size, created_at=now, run=run,
                detected_at=detected_at)


def move_of(plan: Plan) -> tuple[str, int, str, str, float]:
    """The node move a plan belongs to: the plans one pass made for the ranks of one node
    going to one target (job, run, source, target, creation time). A move is the unit of
    ``max_concurrent_recoveries`` and starts as a whole."""
    return plan.job, plan.run, plan.source, plan.target, plan.created_at


def to_start(plans: Iterable[Plan], max_concurrent: int) -> list[Plan]:
    """Queued plans to start now, whole moves at a time: the largest restores first, as
    many moves as the bound allows beside the ones still launching or restoring (a move
    counts while any of its plans is ``running``; restored ones do not count)."""
    every = list(plans)
    running = {move_of(p) for p in every if p.state == "running"}
    room = max(0, max_concurrent - len(running))
    moves: dict[tuple[str, int, str, str, float], list[Plan]] = {}
    for p in every:
        if p.state == "queued":
            moves.setdefault(move_of(p), []).append(p)
    order = sorted(moves.items(), key=lambda kv: (
        kv[0] not in running,  # the rest of a move already started goes first, beyond room
        -sum(p.restore_bytes for p in kv[1]), kv[0][4], min(p.plan_id for p in kv[1])))
    out: list[Plan] = []
    for key, group in order:
        if key not in running:
            if room == 0:
                break
            room -= 1
        out.extend(sorted(group, key=lambda p: p.rank))
    return out


def restore_early(plan: Plan, node: str) -> bool:
    """Whether ``node``'s agent restores the plan's rank before the rank asks: the plan
    started and moves the rank here after a fault. A planned move's rank saves once more
    before it stops, so its newest generation is not made yet."""
    return plan.target == node and plan.state == "running" and not plan.planned


def overdue(plans: Iterable[Plan], now: float, timeout: float,
            hung: Mapping[int, float] | None = None) -> list[Plan]:
    """Active plans whose jobs escalate: not running again (``restored``) within
    ``timeout`` of the plan, or, once running again, stalled: judged HUNG (``hung``: rank
    -> time of its verdict) after it restored. The re-execution of the lost work has no
    time limit of its own: with checkpoints minutes apart it can take longer than any
    fixed one, and the detector judges a rank that stops making progress."""
    out = []
    for p in plans:
        if p.state not in ACTIVE:
            continue
        if p.state == "restored":
            at = (hung or {}).get(p.rank)
            if at is not None and p.restored_at is not None and at > p.restored_at:
                out.append(p)
        elif now - p.created_at > timeout:
            out.append(p)
    return out


def cancelled(plans: Iterable[Plan], events: Mapping[str, Mapping[str, PlanEvent]]
              ) -> list[tuple[Plan, PlanEvent]]:
    """Active plans an admin cancelled, with the request (who, why in its detail)."""
    out = []
    for p in plans:
        request = events.get(p.plan_id, {}).get(CANCELLED)
        if p.active and request is not None:
            out.append((p, request))
    return out


def advance(plan: Plan, state: str, now: float, note: str = "") -> Plan:
    """The plan in its next state with the time stamp of that step (idempotent: a plan
    already there, or further, is returned unchanged)."""
    order = {s: i for i, s in enumerate(STATES)}
    if order[state] <= order[plan.state]:
        return plan
    stamps: dict[str, Any] = {}
    if state == "running":
        stamps["started_at"] = now
    elif state == "restored":
        stamps["restored_at"] = now
    elif state in ("done", "escalated", "failed"):
        stamps["finished_at"] = now
    return replace(plan, state=state, note=note or plan.note, **stamps)


# What the launcher and the agents report about a running plan, in order; and what
# raps-run reports when the rank's step ended before the rank restored (srun could not
# start it there: slurmd down, node refusing steps).
PHASES = ("launched", "restored", "running", "caught_up")
LAUNCH_FAILED = "launch_failed"
CHECKPOINTED = "checkpointed"  # a planned move's rank saved its state and stopped
CANCELLED = "cancelled"  # an admin's `rapsctl cancel-plan`: the job escalates to a requeue
MAX_LAUNCH_FAILURES = 2  # per rank and job run; then the job escalates


@dataclass(frozen=True)
class PlanEvent:
    """``reports/phases/<node>/<id>/<phase>``: one phase of a recovery as the node that saw
    it reports it (``cancels/<id>``: an admin's cancel).

    ``launched``: raps-run started the rank on the target; ``restored``: the target's
    agent restored its checkpoint (``detail``: generation, bytes and chunks pulled, from
    whom); ``running``: the rank's first progress report after the restore, running
    again (``detail``: its step); ``caught_up``: its first progress report at its
    pre-fault progress, every message it had sent before the fault sent again (``detail``:
    messages it re-sent, messages its peers delivered to it since the checkpoint, step).
    The recovery ends there: a rank running again still has the lost work to redo.
    """

    plan_id: str
    phase: str
    at: float
    node: str
    detail: dict[str, Any]

    def to_json(self) -> bytes:
        """The etcd value."""
        return dump({"plan_id": self.plan_id, "phase": self.phase, "at": self.at,
                     "node": self.node, "detail": self.detail})

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> PlanEvent:
        """Decode; RecordError naming the key and the field if malformed."""
        r = Reader(key, raw)
        return cls(r.text("plan_id"),
                   r.choice("phase", (*PHASES, LAUNCH_FAILED, CHECKPOINTED, CANCELLED)),
                   r.num("at"),
                   r.text("node"), r.obj("detail"))


def summarize(plans: Iterable[Plan]) -> dict[str, Any]:
    """What a purged job's tombstone keeps of its plans (they are deleted with the job):
    how many by state and kind, and the seconds from fault verdict to done."""
    every = list(plans)
    states: dict[str, int] = {}
    for p in every:
        states[p.state] = states.get(p.state, 0) + 1
    took = [p.finished_at - p.detected_at for p in every
            if p.state == "done" and p.finished_at is not None and p.detected_at is not None]
    return {"plans": len(every), "states": dict(sorted(states.items())),
            "planned": sum(1 for p in every if p.planned),
            "runs": len({p.run for p in every}),
            "verdict_to_done_s": {"n": len(took),
                                  "mean": round(sum(took) / len(took), 3) if took else None,
                                  "max": round(max(took), 3) if took else None}}


def plan_id(job: str, rank: int, epoch: int) -> str:
    """The id of the plan that gives ``rank`` of ``job`` the epoch ``epoch``."""
    return f"{job}-{rank}-{epoch}"


def follow_events(plan: Plan, events: Mapping[str, PlanEvent]) -> Plan:
    """The plan advanced as far as its reported phases take it (restored, then done once
    the rank caught up).

    A later report implies the restore happened even if its own report is missing (a rank
    without any checkpoint restores nothing and says so only by running).
    """
    if plan.state not in ("running", "restored"):
        return plan
    later = [e for e in (events.get("restored"), events.get("running"),
                         events.get("caught_up")) if e is not None]
    failed = events.get(LAUNCH_FAILED)
    if failed is not None and plan.state == "running" and not later:
        code = failed.detail.get("exit_code")
        return advance(plan, "failed", failed.at,
                       f"the rank's step on {plan.target} ended with {code} before it restored")
    if later:
        plan = advance(plan, "restored", later[0].at)
    caught_up = events.get("caught_up")
    if caught_up is not None:
        plan = advance(plan, "done", caught_up.at)
    return plan


def taken_spares(plans: Iterable[Plan], job: str, run: int) -> set[str]:
    """Spares of one job run that earlier plans already gave to a rank (or are giving)."""
    return {p.target for p in plans
            if p.job == job and p.run == run and p.state != "escalated" and p.target != p.source}


def timeline(plan: Plan, events: Mapping[str, PlanEvent]) -> list[tuple[str, float, str]]:
    """The recovery's phases in order as (phase, time, what), for ``rapsctl show plan``."""
    rows: list[tuple[str, float, str]] = []
    if plan.detected_at is not None:
        rows.append(("fault verdict", plan.detected_at, plan.reason))
    rows.append(("plan", plan.created_at,
                 f"rank {plan.rank}: {plan.source} -> {plan.target}, epoch {plan.epoch}"))
    ck = events.get(CHECKPOINTED)
    if ck is not None:
        rows.append((CHECKPOINTED, ck.at, f"generation {ck.detail.get('generation', '?')} saved "
                                          f"on {plan.source} before the move"))
    if plan.started_at is not None:
        rows.append(("start", plan.started_at, "rank entry moved to the target"))
    for phase in PHASES:
        e = events.get(phase)
        if e is None:
            continue
        what = f"on {e.node}"
        d = e.detail
        if phase == "launched":
            what = f"step on {d.get('node', plan.target)} (raps-run on {e.node})"
        elif phase == "restored":
            src = ",".join(d.get("sources") or []) or "local copy"
            what += (f": generation {d.get('generation')}, {d.get('bytes_pulled', 0)} bytes "
                     f"pulled from {src}")
        elif phase == "running":
            what += f": running again at step {d.get('step', '?')}, redoing the lost work"
        elif phase == "caught_up":
            what += (f": pre-fault progress regained at step {d.get('step', '?')}, "
                     f"{d.get('replayed', 0)} messages re-sent, {d.get('received', 0)} "
                     "received from peers" + (" (its program ended first)"
                                              if d.get("finished") else ""))
        rows.append((phase, e.at, what))
    lf = events.get(LAUNCH_FAILED)
    if lf is not None:
        rows.append((LAUNCH_FAILED, lf.at, f"step ended with {lf.detail.get('exit_code')} "
                                           f"(raps-run on {lf.node})"))
    if plan.state in ("done", "escalated", "failed") and plan.finished_at is not None:
        rows.append((plan.state, plan.finished_at, plan.note))
    return rows


def plan_dict(plan: Plan, events: Mapping[str, PlanEvent]) -> dict[str, Any]:
    """The JSON shape of one plan with its timeline (times in seconds since the epoch)."""
    rows = timeline(plan, events)
    t0 = rows[0][1] if rows else plan.created_at
    restored = events.get("restored")
    running = events.get("running")
    caught_up = events.get("caught_up")
    return {"plan_id": plan.plan_id, "job": plan.job, "run": plan.run, "rank": plan.rank,
            "source": plan.source, "target": plan.target, "epoch": plan.epoch,
            "reason": plan.reason, "state": plan.state, "note": plan.note,
            "restore_bytes": plan.restore_bytes,
            "bytes_pulled": restored.detail.get("bytes_pulled") if restored else None,
            "replayed": caught_up.detail.get("replayed") if caught_up else None,
            "received": caught_up.detail.get("received") if caught_up else None,
            "running_s": round(running.at - t0, 3) if running else None,
            "caught_up_s": round(caught_up.at - t0, 3) if caught_up else None,
            "total_s": round(caught_up.at - t0, 3) if caught_up else None,
            "timeline": [{"phase": p, "at": at, "after_s": round(at - t0, 3), "what": what}
                         for p, at, what in rows]}
