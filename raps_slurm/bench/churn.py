"""``rapsctl bench churn``: a simulated week of what RAPS writes to etcd, against a quota.

A throw-away etcd (data in /dev/shm, ``--quota-backend-bytes`` = ``--quota``) receives, on
a virtual clock and as fast as it takes them, what a cluster of ``--nodes`` writes in
``--days``: every agent's health sample each ``detection.telemetry_interval_sec`` (a real
sample of this machine, so a real size), every rank's message-log figures each
``messagelog.stats_interval_sec``, a checkpoint generation record per rank per
``checkpoint.interval_sec`` (the oldest beyond ``max_generations`` deleted), jobs arriving
and purged (record, rank map, groups, rank entries, tombstone), failures (verdict, history
event, a plan and its three phase reports). The leader's :class:`Hygiene` runs on the same
virtual clock and compacts as configured; history events past the window are deleted as
the leader's weights pass does. Prints one JSON object: the largest database size seen
against the quota, and whether etcd ever refused a write (NOSPACE).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from raps_slurm.agent.probes import collect
from raps_slurm.config import parse_config
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.hygiene import Hygiene
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.history import FailureEvent, expired
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry, RankMap, group_to_json
from raps_slurm.core.planner import Plan, PlanEvent
from raps_slurm.errors import StoreError
from raps_slurm.model import BackupGroup
from raps_slurm.store import Delete, EtcdStore, Keys, Put, TxnOp
from raps_slurm.testing import EtcdServer

_BATCH = 128  # etcd's default --max-txn-ops


def parse_quota(text: str) -> int:
    """'256MiB', '1g', '4096' -> bytes (binary units); ValueError naming what is allowed."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"{text!r} is not a size like 256MiB") from None


class _Writer:
    """Batches operations into transactions; counts them; notes a refused write."""

    def __init__(self, store: EtcdStore) -> None:
        self.store, self.ops = store, 0
        self.pending: list[TxnOp] = []
        self.keys: set[str] = set()
        self.nospace = ""

    def add(self, op: TxnOp) -> None:
        if op.key in self.keys:  # a transaction names a key once: the repeat goes next
            self.flush()
        self.pending.append(op)
        self.keys.add(op.key)
        if len(self.pending) >= _BATCH:
            self.flush()

    def flush(self) -> None:
        self.keys = set()
        if not self.pending or self.nospace:
            self.pending = []
            return
        try:
            self.store.transaction([], self.pending)
            self.ops += len(self.pending)
        except StoreError as exc:
            if "space exceeded" in str(exc).lower() or "nospace" in str(exc).lower():
                self.nospace = str(exc)
            else:
                raise
        self.pending = []


def run_churn(days: float, nodes: int, jobs_per_day: float, job_nodes: int,
              job_hours: float, failures_per_day: float, quota_bytes: int,
              retention_sec: float, interval_sec: float) -> dict[str, Any]:
    """A simulated stretch of RAPS's etcd writes against a quota; the sizes seen."""
    cfg = parse_config({"store": {"space_quota_bytes": quota_bytes,
                                  "compaction_retention_sec": retention_sec,
                                  "compaction_interval_sec": interval_sec}})
    names = [f"n{i:05d}" for i in range(1, nodes + 1)]
    sample = json.dumps(collect(Path("/"), None, None).to_dict()).encode()
    stats = json.dumps({"sent": 123456, "bytes": 987654321, "logged": 123000,
                        "spilled": 0, "buffer_mb": 12.5, "high_watermark_mb": 192,
                        "duplicates": 0, "stale": 0, "collected_to": 120000,
                        "at": 1.7e9}).encode()
    telemetry = 30.0
    stats_every, ckpt_every, keep_gens = 10.0, 600.0, 5
    window = 168 * 3600.0
    keys = Keys()
    started = time.monotonic()
    with EtcdServer(extra_args=("--quota-backend-bytes", str(quota_bytes)),
                    tmp_root="/dev/shm" if Path("/dev/shm").is_dir() else None) as etcd:
        store = EtcdStore([etcd.url])
        w = _Writer(store)
        now = [0.0]
        lead = Leadership(store, keys.leader(), 30, {"name": "churn"})
        lead.step()
        hygiene = Hygiene(cfg, store, lead, monotonic=lambda: now[0])
        jobs: dict[str, tuple[float, list[str]]] = {}   # job -> (end time, nodes)
        gens: dict[tuple[str, int], int] = {}
        history: list[FailureEvent] = []
        next_job, next_fail, job_seq, compactions = 0.0, 3600.0, 0, 0
        max_db = max_in_use = 0
        t = 0.0
        end = days * 86400.0
        while t < end and not w.nospace:
            now[0] = t
            for n in names:  # health samples
                w.add(Put(keys.node_health(n), sample))
            if jobs_per_day and t >= next_job:  # a job arrives
                job_seq += 1
                jid = str(1000 + job_seq)
                jn = [names[(job_seq * job_nodes + i) % nodes] for i in range(job_nodes)]
                spares = [names[(job_seq * job_nodes + job_nodes + i) % nodes] for i in range(2)]
                rec = JobRecord(jid, 0, 1000, tuple(jn + spares), JobSpec(spares=2),
                                registered_at=t)
                w.add(Put(keys.job(jid), rec.to_json()))
                w.add(Put(keys.job_map(jid), RankMap(jid, 0, tuple(jn), tuple(spares), 2,
                                                     built_at=t).to_json()))
                for r, node in enumerate(jn):
                    grp = BackupGroup(r, node, jn[(r + 1) % len(jn)], (spares[r % 2],))
                    w.add(Put(keys.job_group(jid, r), group_to_json(grp)))
                    w.add(Put(keys.job_rank(jid, r), RankEntry(r, node, 1, "running",
                                                               tuple(spares)).to_json()))
                jobs[jid] = (t + job_hours * 3600.0, jn)
                next_job = t + 86400.0 / jobs_per_day
            for _ in range(round(telemetry / stats_every)):  # one round of unique keys each
                for jid, (_, jn) in jobs.items():
                    for r, node in enumerate(jn):
                        w.add(Put(keys.job_msgstats(node, jid, r), stats))
                w.flush()
            for jid, (ends, jn) in list(jobs.items()):
                for r, node in enumerate(jn):
                    if t % ckpt_every < telemetry:
                        g = gens.get((jid, r), 0) + 1
                        gens[(jid, r)] = g
                        ck = CkptRecord(r, g, 1, "b3:" + "ab" * 32, 1 << 30, 700 << 20, 4000,
                                        "b3:" + "cd" * 32, node, (jn[(r + 1) % len(jn)],), 2,
                                        "committed", t)
                        w.add(Put(keys.ckpt(jid, r, g), ck.to_json()))
                        if g > keep_gens:
                            w.add(Delete(keys.ckpt(jid, r, g - keep_gens)))
                if t >= ends:  # finished and purged
                    w.flush()
                    try:
                        store.delete_prefix(keys.job_prefix(jid))
                        store.delete_prefix(keys.job_reports_prefix(jid))
                        for node in jn:
                            store.delete_prefix(keys.node_job_reports_prefix(node, jid))
                        store.delete(keys.job(jid))
                        store.put(keys.purged(jid), json.dumps({"at": t}).encode())
                    except StoreError as exc:
                        w.nospace = w.nospace or str(exc)
                    del jobs[jid]
            if failures_per_day and t >= next_fail and jobs:  # a failure in a running job
                jid, (_, jn) = sorted(jobs.items())[0]
                node = jn[0]
                e = FailureEvent("DEAD", node, t, "churn")
                history.append(e)
                w.add(Put(keys.node_verdict(node), json.dumps(
                    {"kind": "DEAD", "node": node, "at": t, "evidence": {}}).encode()))
                w.add(Put(keys.history_event(node, e.event_id()), e.to_json()))
                p = Plan(f"{jid}-0-{int(t)}", jid, 0, node, "n00001", 2, "dead", 1 << 30,
                         "done", t, t, t, t, run=0, detected_at=t)
                w.add(Put(keys.plan(p.plan_id), p.to_json()))
                for phase in ("launched", "restored", "running", "caught_up"):
                    w.add(Put(keys.plan_event("n00001", p.plan_id, phase),
                              PlanEvent(p.plan_id, phase, t, node, {"bytes": 1 << 30}).to_json()))
                next_fail = t + 86400.0 / failures_per_day
            for e in expired(history, t, window):
                w.add(Delete(keys.history_event(e.node, e.event_id())))
                history.remove(e)
            w.flush()
            if int(t) % 300 < telemetry:
                lead.step()
            try:
                for line in hygiene.step():
                    if line.startswith("etcd history compacted"):
                        compactions += 1
            except StoreError:
                pass
            if hygiene.last is not None:
                max_db = max(max_db, hygiene.last.db_size)
                max_in_use = max(max_in_use, hygiene.last.db_size_in_use)
            t += telemetry
        final = store.status()
        store.close()
    out = {"days": days, "simulated_days_done": round(t / 86400.0, 3), "nodes": nodes,
           "quota_bytes": quota_bytes, "retention_sec": retention_sec,
           "writes": w.ops, "revision": final.revision, "compactions": compactions,
           "max_db_bytes": max(max_db, final.db_size),
           "max_in_use_bytes": max(max_in_use, final.db_size_in_use),
           "final_db_bytes": final.db_size, "alarms": list(final.alarms),
           "nospace": bool(w.nospace), "health_sample_bytes": len(sample),
           "wall_s": round(time.monotonic() - started, 1)}
    return out
