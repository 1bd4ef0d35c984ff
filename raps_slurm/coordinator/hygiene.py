"""The leader's etcd upkeep: compaction, size, alarms, and the pause of the reports of the
job that writes most when etcd passes its watermark (``raps_slurm.core.hygiene``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from raps_slurm.config import Config
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.metrics import Metrics
from raps_slurm.core.budget import WRITE_OVERHEAD
from raps_slurm.core.hygiene import (
    ReportPause,
    compaction_target,
    keep_samples,
    next_pause_level,
    report_pauses,
    size_warning,
)
from raps_slurm.core.jobs import JobRecord
from raps_slurm.errors import RecordError, StoreError
from raps_slurm.store import Delete, Guard, Keys, Put, StateStore, StoreStatus

log = logging.getLogger("raps.coordinator.hygiene")


class Hygiene:
    """Call :meth:`step` every loop; it acts every ``store.compaction_interval_sec``."""

    def __init__(self, cfg: Config, store: StateStore, leadership: Leadership,
                 metrics: Metrics | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.store, self.leadership, self.metrics = cfg, store, leadership, metrics
        self.keys = Keys(cfg.store.prefix)
        self._mono = monotonic
        self._wall: Callable[[], float] = time.time
        self._next = 0.0
        self._samples: list[tuple[float, int]] = []
        self.compacted = 0           # the revision of this leader's last compaction
        self.last: StoreStatus | None = None
        self._warned = False
        self._paused_seen = True  # a former leader may have paused jobs: look once

    def step(self) -> list[str]:
        """One pass when due and leading; what it did or found, one line each."""
        now = self._mono()
        if now < self._next or not self.leadership.is_leader():
            return []
        sc = self.cfg.store
        self._next = now + sc.compaction_interval_sec
        out = []
        try:
            st = self.store.status()
            self.last = st
            since = max((rev for _, rev in self._samples), default=0)
            self._samples.append((now, st.revision))
            target = compaction_target(self._samples, now, sc.compaction_retention_sec,
                                       self.compacted)
            self._samples = keep_samples(self._samples, now, sc.compaction_retention_sec)
            if target is not None:
                self.store.compact(target)
                self.compacted = target
                out.append(f"etcd history compacted to revision {target}")
        except StoreError as exc:
            return [f"etcd upkeep: {exc}"]
        if self.metrics is not None:
            self.metrics.etcd_db.set(st.db_size)
            self.metrics.etcd_db_in_use.set(st.db_size_in_use)
            self.metrics.etcd_quota.set(sc.space_quota_bytes)
        warning = size_warning(st.db_size, sc.space_quota_bytes)
        if warning and not self._warned:
            log.warning("%s", warning)
            out.append(warning)
        self._warned = warning is not None
        if st.alarms:
            line = f"etcd alarms raised: {', '.join(st.alarms)} (writes refused until cleared)"
            log.error("%s", line)
            out.append(line)
        try:
            out += self._pauses(st, since)
        except StoreError as exc:
            out.append(f"etcd upkeep: report pauses: {exc}")
        return out

    def _pauses(self, st: StoreStatus, since: int) -> list[str]:
        """Pause the heaviest writer above the watermark, resume all below the resume
        share; what it did, one line each."""
        sc, k = self.cfg.store, self.keys
        quota = sc.space_quota_bytes
        if quota <= 0:
            return []
        # Below the resume share with nothing paused (the usual case) costs no read.
        if st.db_size_in_use < sc.report_resume_share * quota and not self._paused_seen:
            return []
        jobs: dict[str, JobRecord] = {}
        revs: dict[str, int] = {}
        paused: set[str] = set()
        paused_at: int | None = None
        for kv in self.store.get_prefix(k.jobs_prefix()):
            parts = k.split(kv.key)
            if len(parts) == 2:
                try:
                    jobs[parts[1]] = JobRecord.from_json(kv.key, kv.value)
                    revs[parts[1]] = kv.mod_revision
                except RecordError:
                    continue
            elif len(parts) == 3 and parts[2] == "paused":
                paused.add(parts[1])
                try:
                    at = ReportPause.from_json(kv.key, kv.value).in_use
                except RecordError:
                    at = st.db_size_in_use
                paused_at = max(at, paused_at or 0)
        self._paused_seen = bool(paused)
        if self.metrics is not None:
            self.metrics.reports_paused.set(len(paused))
        written: dict[str, int] = {}
        if st.db_size_in_use >= next_pause_level(quota, sc.report_watermark_share, paused_at):
            written = self._written_since(since)
        decision = report_pauses(st.db_size_in_use, quota, sc.report_watermark_share,
                                 sc.report_resume_share, written, paused, paused_at)
        out = []
        for job in decision.resume:
            if self.leadership.commit([], [Delete(k.job_paused(job))]):
                line = (f"reports of job {job} resumed: etcd holds "
                        f"{st.db_size_in_use / 2**20:.1f} MiB in use, below "
                        f"store.report_resume_share={sc.report_resume_share:g} of its quota")
                log.warning("%s", line)
                out.append(line)
        if decision.resume:
            self._paused_seen = False
            if self.metrics is not None:
                self.metrics.reports_paused.set(0)
        heavy = decision.pause
        if heavy is not None and heavy in jobs:
            record = jobs[heavy]
            pause = ReportPause(heavy, self._wall(), st.db_size_in_use, quota, written[heavy],
                                record.user or f"uid {record.owner_uid}")
            # Guarded by the job's record: a job purged meanwhile gets no pause key.
            if self.leadership.commit([Guard(k.job(heavy), revs[heavy])],
                                      [Put(k.job_paused(heavy), pause.to_json())]):
                self._paused_seen = True
                line = (pause.line() + f" (watermark store.report_watermark_share="
                        f"{sc.report_watermark_share:g})")
                log.error("%s", line)
                out.append(line)
                if self.metrics is not None:
                    self.metrics.report_pauses.inc()
                    self.metrics.reports_paused.set(len(paused) + 1)
        return out

    def _written_since(self, revision: int) -> dict[str, int]:
        """Bytes of each job's reports written after ``revision`` (a key written several
        times counts once: its latest value)."""
        k = self.keys
        written: dict[str, int] = {}
        for kv in self.store.get_prefix(k.reports_prefix()):
            if kv.mod_revision <= revision:
                continue
            parts = k.split(kv.key)
            # reports/jobs/<job>/... and reports/ranks/<node>/<job>/...
            if len(parts) > 3 and parts[1] == "jobs":
                job = parts[2]
            elif len(parts) > 4 and parts[1] == "ranks":
                job = parts[3]
            else:
                continue
            written[job] = written.get(job, 0) + len(kv.value) + WRITE_OVERHEAD
        return written
