"""Deletes the node-local checkpoint dirs of jobs the coordinator purged (tombstones), and
what this node reported about them."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from raps_slurm.core.jobs import sweep
from raps_slurm.store import Keys, StateStore

log = logging.getLogger("raps.agent")


def local_jobs(root: Path) -> dict[str, float]:
    """Job id -> creation (inode change) time of each ``job-<id>`` dir under ``root``."""
    out: dict[str, float] = {}
    if not root.is_dir():
        return out
    for d in root.iterdir():
        job = d.name.removeprefix("job-")
        if d.name.startswith("job-") and job.isascii() and job.isdigit() and not d.is_symlink() \
                and d.is_dir():
            out[job] = d.stat().st_ctime
    return out


def _tombstones(store: StateStore, keys: Keys) -> dict[str, float]:
    tombstones: dict[str, float] = {}
    for kv in store.get_prefix(keys.purged_prefix()):
        try:
            tombstones[keys.split(kv.key)[1]] = float(json.loads(kv.value)["purged_at"])
        except (ValueError, KeyError, TypeError, IndexError):
            log.warning("ignoring malformed tombstone %s", kv.key)
    return tombstones


def sweep_reports(store: StateStore, keys: Keys, node: str) -> list[str]:
    """Delete what ``node`` reported about purged jobs that the leader's purge missed
    (the node was down then, or no longer of the job after a requeue); returns their ids."""
    reported: set[str] = set()
    for kv in store.get_prefix(keys.node_rank_reports_prefix(node)):
        reported.add(keys.split(kv.key)[3])  # reports/ranks/<node>/<job>/...
    for kv in store.get_prefix(keys.node_plan_events_prefix(node)):
        reported.add(keys.split(kv.key)[3].split("-", 1)[0])  # .../<job>-<rank>-<epoch>/
    if not reported:
        return []
    gone = sorted(j for j in set(_tombstones(store, keys)) & reported
                  if store.get(keys.job(j)) is None)
    for job in gone:
        store.delete_prefix(keys.node_job_reports_prefix(node, job))
        store.delete_prefix(keys.job_plan_events_prefix(node, job))
        log.info("deleted this node's reports about purged job %s", job)
    return gone


def sweep_purged(store: StateStore, keys: Keys, root: Path) -> list[str]:
    """Delete the dirs of purged jobs under ``root``; returns their job ids."""
    mine = local_jobs(root)
    if not mine:
        return []
    tombstones = _tombstones(store, keys)
    registered = {j for j in mine if store.get(keys.job(j)) is not None}
    gone = sweep(mine, tombstones, registered)
    for job in gone:
        shutil.rmtree(root / f"job-{job}", ignore_errors=True)
        log.info("deleted the local checkpoint data of purged job %s", job)
    return gone
