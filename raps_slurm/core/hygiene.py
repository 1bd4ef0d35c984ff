"""etcd hygiene decisions: which revision to compact to, when to warn about size. Pure.

RAPS writes continuously (health samples, checkpoint generations, verdicts, plans), and
etcd keeps every old value until its history is compacted; the database file only grows
until then, and at ``--quota-backend-bytes`` etcd raises NOSPACE and refuses writes. The
leader samples (time, revision) every ``store.compaction_interval_sec`` and compacts to
the newest sample at least ``store.compaction_retention_sec`` old, the way etcd's own
periodic auto-compaction does: a watch may resume from any revision of the retention.

Above ``store.report_watermark_share`` of the quota (etcd's bytes in use, history
included) the leader pauses the reports of the job that wrote most since its previous
look, so that etcd's NOSPACE alarm, which stops every user's writes, does not fire; below
``store.report_resume_share`` every paused job resumes (:func:`report_pauses`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from raps_slurm.core.records import Reader, dump

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


@dataclass(frozen=True)
class ReportPause:
    """``jobs/<id>/paused``: the leader stopped accepting a job's reports (agents refuse
    its writes for ranks) because etcd passed its watermark."""

    job: str
    since: float      # wall-clock seconds
    in_use: int       # etcd's bytes in use when paused
    quota: int
    written: int      # bytes of the job's reports changed since the leader's previous look
    user: str = ""

    def line(self) -> str:
        """One line for logs, refusals and ``rapsctl show status``."""
        who = f" (user {self.user})" if self.user else ""
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        return (f"reports of job {self.job}{who} paused since {at}: etcd held "
                f"{self.in_use / 2**20:.1f} MiB, {self.in_use / max(self.quota, 1):.0%} of "
                f"its quota, and this job wrote most ({self.written / 1024:.0f} KiB since "
                "the leader's previous look); they resume below store.report_resume_share")

    def to_json(self) -> bytes:
        """The etcd value."""
        return dump({"job": self.job, "since": self.since, "in_use": self.in_use,
                     "quota": self.quota, "written": self.written, "user": self.user})

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> ReportPause:
        """Decode the value at ``key``; RecordError if it is not a pause."""
        d = Reader(key, raw)
        return cls(d.text("job"), d.num("since"), d.integer("in_use"), d.integer("quota"),
                   d.integer("written"), d.text("user", empty=True))


@dataclass(frozen=True)
class PauseDecision:
    """What the leader does this look: pause one job, resume some (possibly none)."""

    pause: str | None = None
    resume: tuple[str, ...] = ()


def next_pause_level(quota: int, watermark: float, paused_at: int | None) -> float:
    """Bytes in use at which the next job is paused: the watermark, then, with jobs
    paused at ``paused_at`` (the highest use a pause recorded), half of the room left
    then.

    History only shrinks at the next compaction, so use stays above the watermark after
    the first pause whatever the paused job does; pausing one more job each look would
    pause jobs that write at their usual pace. Halving the room left keeps NOSPACE away
    while some job still writes enough to matter.
    """
    level = watermark * quota
    if paused_at is not None:
        level = max(level, paused_at + (quota - paused_at) / 2)
    return level


def report_pauses(in_use: int, quota: int, watermark: float, resume: float,
                  written: Mapping[str, int], paused: Set[str],
                  paused_at: int | None = None) -> PauseDecision:
    """Pause the heaviest writer not yet paused once ``in_use`` reaches
    :func:`next_pause_level`; resume every paused job once below ``resume`` of ``quota``.

    ``written``: bytes of each job's reports changed since the previous look; a job that
    wrote nothing is never paused (it is not what fills etcd).
    """
    if quota <= 0:
        return PauseDecision()
    if in_use < resume * quota:
        return PauseDecision(resume=tuple(sorted(paused)))
    if in_use < next_pause_level(quota, watermark, paused_at if paused else None):
        return PauseDecision()
    candidates = [(n, job) for job, n in written.items() if n > 0 and job not in paused]
    if not candidates:
        return PauseDecision()
    return PauseDecision(pause=max(candidates)[1])
