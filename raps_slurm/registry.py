"""Registered jobs as ``rapsctl show job --json`` prints them (a public contract).

Shape of one job (extra keys may be added, none of these removed or renamed)::

    {"job_id": "12", "restart_count": 0, "owner_uid": 1000, "state": "mapped",
     "ranks": [{"rank": 0, "node": "n1", "epoch": 1, "status": "assigned",
                "group": {"primary": "n1", "log_backup": "n3", "ckpt_mirrors": ["n5"],
                          "degraded": null},
                "spares": ["n6", "n4"]}],
     "spares": ["n4", "n6"]}

``state``: ``registered`` (waiting for the leader's rank map), ``mapped``,
``map-error`` (see ``map_error``), ``ended`` (Slurm ended this run; the keys stay
until the job is finished for good and the grace period is over).
"""

from __future__ import annotations

from typing import Any

from raps_slurm.core.jobs import JobRecord, RankEntry, RankMap, group_dict, group_from_json
from raps_slurm.core.requeue import EscalationRecord
from raps_slurm.errors import RapsError, RecordError
from raps_slurm.store import Keys, StateStore


class UnknownJob(RapsError):
    """No RAPS registration for this job id."""


def job_ids(store: StateStore, keys: Keys) -> list[str]:
    """Ids of every registered job, in numeric order."""
    ids = {keys.split(kv.key)[1] for kv in store.get_prefix(keys.jobs_prefix())
           if len(keys.split(kv.key)) == 2}
    return sorted(ids, key=lambda j: (len(j), j))


def job_view(store: StateStore, keys: Keys, job_id: str) -> dict[str, Any]:
    """One job in the public shape; UnknownJob if it is not registered.

    Reads the record and everything below it in one snapshot (one range read over
    ``jobs/<id>`` covers the record and its prefix).
    """
    if not (job_id.isascii() and job_id.isdigit()):
        raise UnknownJob(f"invalid job id {job_id!r}: expected a number")
    key = keys.job(job_id)
    kvs = [kv for kv in store.get_prefix(key) if kv.key == key or kv.key.startswith(key + "/")]
    by_key = {kv.key: kv for kv in kvs}
    if key not in by_key:
        raise UnknownJob(f"job {job_id} is not registered with raps-slurm "
                         "(not submitted with --raps, or finished and purged)")
    record = JobRecord.from_json(key, by_key[key].value)
    if record.job_id != job_id:
        raise RecordError(f"{key}: field 'job_id': expected {job_id!r}, got {record.job_id!r}")
    map_kv = by_key.get(keys.job_map(job_id))
    rank_map = RankMap.from_json(map_kv.key, map_kv.value) if map_kv is not None else None
    current = rank_map is not None and rank_map.restart_count == record.restart_count
    ranks: list[dict[str, Any]] = []
    if current and rank_map is not None and not rank_map.error:
        for rank in range(len(rank_map.nodes)):
            rk, gk = keys.job_rank(job_id, rank), keys.job_group(job_id, rank)
            if rk not in by_key or gk not in by_key:
                continue  # a map being rewritten: the next read shows it whole
            entry = RankEntry.from_json(rk, by_key[rk].value)
            group = group_from_json(gk, by_key[gk].value, rank)
            ranks.append({"rank": rank, "node": entry.node, "epoch": entry.epoch,
                          "status": entry.status, "group": group_dict(group),
                          "spares": list(entry.spares)})
    escalation: dict[str, Any] | None = None
    esc_kv = by_key.get(keys.job_escalation(job_id))
    if esc_kv is not None:
        try:
            esc = EscalationRecord.from_json(esc_kv.key, esc_kv.value)
            escalation = {"run": esc.run, "reason": esc.reason, "at": esc.at,
                          "requeued_at": esc.requeued_at, "requeues": len(esc.requeues),
                          "gave_up": esc.gave_up or None, "exclude": list(esc.exclude),
                          "num_nodes": esc.num_nodes}
        except RecordError as exc:
            escalation = {"error": str(exc)}
    if record.state == "ended":
        state = "ended"
    elif not current or rank_map is None:
        state = "registered"
    else:
        state = "map-error" if rank_map.error else "mapped"
    return {"job_id": record.job_id, "restart_count": record.restart_count,
            "owner_uid": record.owner_uid, "user": record.user, "name": record.name,
            "state": state, "nodes": list(record.nodes),
            "spec": record.spec.to_dict(),
            "replicas": rank_map.replicas if current and rank_map is not None else None,
            "registered_at": record.registered_at, "ended_at": record.ended_at,
            "exit_code": record.exit_code,
            "map_error": rank_map.error if current and rank_map is not None else "",
            "built_by": rank_map.built_by if current and rank_map is not None else "",
            "mapped_at": rank_map.built_at if current and rank_map is not None else None,
            "ranks": ranks,
            "spares": list(rank_map.spares) if current and rank_map is not None else [],
            "escalation": escalation}
