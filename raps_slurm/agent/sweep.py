"""Deletes the node-local checkpoint dirs of jobs the coordinator purged (tombstones)."""

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


def sweep_purged(store: StateStore, keys: Keys, root: Path) -> list[str]:
    """Delete the dirs of purged jobs under ``root``; returns their job ids."""
    mine = local_jobs(root)
    if not mine:
        return []
    tombstones: dict[str, float] = {}
    for kv in store.get_prefix(keys.purged_prefix()):
        try:
            tombstones[keys.split(kv.key)[1]] = float(json.loads(kv.value)["purged_at"])
        except (ValueError, KeyError, TypeError, IndexError):
            log.warning("ignoring malformed tombstone %s", kv.key)
    registered = {j for j in mine if store.get(keys.job(j)) is not None}
    gone = sweep(mine, tombstones, registered)
    for job in gone:
        shutil.rmtree(root / f"job-{job}", ignore_errors=True)
        log.info("deleted the local checkpoint data of purged job %s", job)
    return gone
