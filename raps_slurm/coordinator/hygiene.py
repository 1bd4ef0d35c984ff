"""The leader's etcd upkeep: compaction, size and alarms (``raps_slurm.core.hygiene``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from raps_slurm.config import Config
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.metrics import Metrics
from raps_slurm.core.hygiene import compaction_target, keep_samples, size_warning
from raps_slurm.errors import StoreError
from raps_slurm.store import StateStore, StoreStatus

log = logging.getLogger("raps.coordinator.hygiene")


class Hygiene:
    """Call :meth:`step` every loop; it acts every ``store.compaction_interval_sec``."""

    def __init__(self, cfg: Config, store: StateStore, leadership: Leadership,
                 metrics: Metrics | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.store, self.leadership, self.metrics = cfg, store, leadership, metrics
        self._mono = monotonic
        self._next = 0.0
        self._samples: list[tuple[float, int]] = []
        self.compacted = 0           # the revision of this leader's last compaction
        self.last: StoreStatus | None = None
        self._warned = False

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
        return out
