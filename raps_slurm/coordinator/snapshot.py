"""What one coordinator cycle reads from etcd: every registered job with its rank map,
groups and the reports agents wrote about it (:func:`read_snapshot`)."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field

from raps_slurm.core.checkpoints import CkptRecord, of_job_nodes
from raps_slurm.core.jobs import JobRecord, RankEntry, RankMap, group_from_json
from raps_slurm.errors import RecordError
from raps_slurm.model import BackupGroup
from raps_slurm.store import Keys, KeyValue, StateStore

log = logging.getLogger("raps.coordinator")


@dataclass
class JobView:
    """Everything the snapshot holds about one job."""

    record_kv: KeyValue | None = None
    record: JobRecord | None = None
    rank_map: RankMap | None = None
    epochs: dict[int, int] = field(default_factory=dict)
    ranks: int = 0
    groups: dict[int, tuple[BackupGroup, KeyValue]] = field(default_factory=dict)
    entries: dict[int, tuple[RankEntry, KeyValue]] = field(default_factory=dict)
    ckpts: dict[int, list[CkptRecord]] = field(default_factory=dict)
    escalation: KeyValue | None = None
    hung: dict[int, float] = field(default_factory=dict)  # rank -> time of its HUNG verdict
    hung_last: dict[int, float] = field(default_factory=dict)  # rank -> its last heartbeat then
    # rank -> an ESCALATE verdict its runtime or agent wrote: (at, epoch, node, reason,
    # requeue, lost); ``lost``: its agent found no checkpoint generation whole
    escalated: dict[int, tuple[float, int | None, str, str, bool, bool]] = field(
        default_factory=dict)
    # rank -> the epoch that finished its program (``peers/<rank>`` says ``done``): its
    # silence after that is the end of the job, not a hang
    done: dict[int, int] = field(default_factory=dict)
    # run -> (stopping_at, started_at) of its MPI step's latest restart (raps-run
    # --restart-mode step): the ranks are silent in between, and not hung for it
    steps: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)


@dataclass
class Snapshot:
    """The jobs prefix at one revision, decoded; malformed values listed, not fatal."""

    jobs: dict[str, JobView]
    bad: list[str]
    refused: list[str] = field(default_factory=list)  # reports from nodes not of the job


# kinds under reports/ranks/<node>/<job>/ (the last part: a rank, or a run for steps)
_REPORTS = ("verdicts", "peers", "msgstats", "steps")


def job_nodes(view: JobView) -> set[str]:
    """The nodes whose reports about the job the leader accepts: its allocation, its
    rank map's nodes and spares, and where its ranks run."""
    out = set(view.record.nodes) if view.record is not None else set()
    if view.rank_map is not None:
        out.update(view.rank_map.nodes, view.rank_map.spares)
    out.update(entry.node for entry, _ in view.entries.values())
    return out


def members(g: BackupGroup) -> list[str]:
    """The nodes of a backup group: primary, log backup, checkpoint mirrors."""
    return [m for m in (g.primary, g.log_backup, *g.ckpt_mirrors) if m]


def read_snapshot(store: StateStore, keys: Keys) -> Snapshot:
    """Decode every job key under the prefix from one consistent read, then the job
    reports from two more: checkpoint records (``reports/jobs/``) and what each node
    reported about ranks (``reports/ranks/<node>/``).

    Reports are what agents may write (docs/store.md, Roles): only report kinds are read
    there, never a record, map, rank or group an agent put there, and a node's report
    about a job counts only if the node is one of the job's (:func:`job_nodes`), a
    checkpoint record only if its primary is one of any run's; others are listed in
    ``refused``.
    """
    jobs: dict[str, JobView] = {}
    bad: list[str] = []
    refused: list[str] = []
    own = [(kv, keys.split(kv.key), False) for kv in store.get_prefix(keys.jobs_prefix())]
    reported = [(kv, keys.split(kv.key)[1:], True)
                for kv in store.get_prefix(keys.job_reports_root())]
    for kv, parts, report in own + reported:
        if len(parts) < 2 or ((parts[2] if len(parts) > 2 else "") == "ckpt") != report:
            continue  # checkpoint records only under reports/, the job's own keys only under jobs/
        if not (parts[1].isascii() and parts[1].isdigit()):
            bad.append(f"{kv.key}: job id {parts[1]!r} is not a number")
            continue
        view = jobs.setdefault(parts[1], JobView())
        try:
            _read_job_key(view, kv, parts)
        except RecordError as exc:
            bad.append(str(exc))
    for job_id, view in jobs.items():
        if view.ckpts and view.record is not None:
            nodes = job_nodes(view) | view.record.all_nodes
            for rank, records in view.ckpts.items():
                view.ckpts[rank], foreign = of_job_nodes(records, nodes)
                refused.extend(f"{keys.ckpt(job_id, rank, r.generation)}: its primary "
                               f"{r.primary} is not a node of job {job_id}" for r in foreign)
    members: dict[str, set[str]] = {}  # job -> job_nodes: once per job, not per report
    for kv in store.get_prefix(keys.rank_reports_root()):
        parts = keys.split(kv.key)[2:]  # <node>/<job>/<kind>/<rank>
        if len(parts) != 4 or parts[2] not in _REPORTS or not (
                parts[3].isascii() and parts[3].isdigit()):
            continue
        about = jobs.get(parts[1])  # (a purged job's, left by a node that was down: its
        if about is None:          # agent deletes them when it sees the tombstone)
            continue
        if parts[1] not in members:
            members[parts[1]] = job_nodes(about)
        if parts[0] not in members[parts[1]]:
            refused.append(f"{kv.key}: from {parts[0]}, not a node of job {parts[1]}")
            continue
        try:
            _read_node_report(about, kv, parts[2], int(parts[3]), parts[0])
        except RecordError as exc:
            bad.append(str(exc))
    return Snapshot(jobs, bad, refused)


def _read_job_key(view: JobView, kv: KeyValue, parts: tuple[str, ...]) -> None:
    """One key under ``jobs/<job>/`` (or a checkpoint record) into ``view``."""
    if len(parts) == 2:
        record = JobRecord.from_json(kv.key, kv.value)
        if record.job_id != parts[1]:
            raise RecordError(f"{kv.key}: field 'job_id': expected {parts[1]!r}, "
                              f"got {record.job_id!r}")
        view.record_kv, view.record = kv, record
    elif parts[2:] == ("map",):
        view.rank_map = RankMap.from_json(kv.key, kv.value)
    elif parts[2] == "ranks" and len(parts) == 4:
        entry = RankEntry.from_json(kv.key, kv.value)
        view.epochs[entry.rank] = entry.epoch
        view.entries[entry.rank] = (entry, kv)
        view.ranks += 1
    elif parts[2:] == ("escalation",):
        view.escalation = kv
    elif parts[2] == "verdicts" and len(parts) == 4 and parts[3].isdigit():
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            v = json.loads(kv.value)
            if v.get("kind") == "HUNG":
                view.hung[int(parts[3])] = float(v["at"])
                last = (v.get("evidence") or {}).get("last_app_heartbeat_at")
                if isinstance(last, (int, float)):
                    view.hung_last[int(parts[3])] = float(last)
    elif parts[2] == "ckpt" and len(parts) == 5:
        rec = CkptRecord.from_json(kv.key, kv.value)
        view.ckpts.setdefault(rec.rank, []).append(rec)
    elif parts[2] == "groups" and len(parts) == 4 and parts[3].isdigit():
        rank = int(parts[3])
        view.groups[rank] = (group_from_json(kv.key, kv.value, rank), kv)


def _read_node_report(view: JobView, kv: KeyValue, kind: str, rank: int, node: str) -> None:
    """What ``node`` (one of the job's) reported about one rank."""
    if kind == "verdicts":
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            v = json.loads(kv.value)
            if v.get("kind") != "ESCALATE":
                return
            epoch, requeue = v.get("epoch"), v.get("requeue", True)
            lost = v.get("lost", False)
            for name, flag in (("requeue", requeue), ("lost", lost)):
                if not isinstance(flag, bool):  # (absent: an older agent's)
                    raise RecordError(f"{kv.key}: field {name!r}: expected "
                                      f"true or false, got {flag!r:.40}")
            at = float(v["at"])
            if rank in view.escalated and view.escalated[rank][0] >= at:
                return  # the newest of the nodes' escalations of this rank
            view.escalated[rank] = (
                at, epoch if isinstance(epoch, int) else None, node,
                str((v.get("evidence") or {}).get("reason", ""))[:300], requeue, lost)
    elif kind == "steps":
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            v = json.loads(kv.value)
            stop, start = (v.get(k) for k in ("stopping_at", "started_at"))
            if not all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))
                       for x in (stop, start)):
                raise RecordError(f"{kv.key}: expected stopping_at and started_at, numbers "
                                  "or null")
            old = view.steps.get(rank, (None, None))
            view.steps[rank] = (_later(old[0], stop), _later(old[1], start))
    elif kind == "peers":
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            p = json.loads(kv.value)
            if p.get("done") is True and isinstance(p.get("epoch"), int):
                view.done[rank] = max(view.done.get(rank, 0), p["epoch"])


def _later(a: float | None, b: float | None) -> float | None:
    """The later of two optional times."""
    return b if a is None else a if b is None else max(a, b)
