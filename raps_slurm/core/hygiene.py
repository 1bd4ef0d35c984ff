"""etcd hygiene decisions: which revision to compact to, when to warn about size. Pure.

RAPS writes continuously (health samples, checkpoint generations, verdicts, plans), and
etcd keeps every old value until its history is compacted; the database file only grows
until then, and at ``--quota-backend-bytes`` etcd raises NOSPACE and refuses writes. The
leader samples (time, revision) every ``store.compaction_interval_sec`` and compacts to
the newest sample at least ``store.compaction_retention_sec`` old, the way etcd's own
periodic auto-compaction does: a watch may resume from any revision of the retention.
"""

from __future__ import annotations

from collections.abc import Sequence

WARN_SHARE = 0.8  # of the quota: the leader logs a warning above it


def compaction_target(samples: Sequence[tuple[float, int]], now: float, retention: float,
                      done: int) -> int | None:
    """The revision to compact to (the newest sample at least ``retention`` old), None when
    there is none newer than ``done``, the last compaction."""
    old = [rev for t, rev in samples if now - t >= retention]
    if not old or retention <= 0:
        return None
    target = max(old)
    return target if target > done else None


def keep_samples(samples: Sequence[tuple[float, int]], now: float,
                 retention: float) -> list[tuple[float, int]]:
    """Samples still needed: the newest one past the retention and every younger one."""
    old = [s for s in samples if now - s[0] >= retention]
    young = [s for s in samples if now - s[0] < retention]
    return ([max(old, key=lambda s: s[1])] if old else []) + young


def size_warning(db_size: int, quota: int) -> str | None:
    """A line when the database is above WARN_SHARE of the quota, else None."""
    if quota <= 0 or db_size < WARN_SHARE * quota:
        return None
    return (f"etcd database {db_size / 2**20:.1f} MiB is {db_size / quota:.0%} of its quota "
            f"{quota / 2**20:.0f} MiB: at the quota etcd refuses writes (NOSPACE); check "
            f"compaction (store.compaction_retention_sec) and defragment")
