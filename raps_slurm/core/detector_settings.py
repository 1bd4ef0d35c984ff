"""The failure detector's parameters (:class:`DetectorSettings`) and the probe plan that
derives the probe interval and timeout from the heartbeat interval and the fence
deadline (the probe maths: :mod:`raps_slurm.core.detector`); pure, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raps_slurm.config import DetectionConfig

SUSPECT_AFTER_INTERVALS = 1.5   # silence that makes a node SUSPECT, in intervals
PROBE_FAILURES = 29             # K, see the probe maths in raps_slurm.core.detector
PROBE_TIMEOUT_INTERVALS = 0.6   # covers a 2 x 300 ms round trip at 1 s heartbeats
MIN_PROBE_INTERVAL_INTERVALS = 0.05  # never probe one node faster than I/20
PROGRESS_STRIKES = 5  # default progress window, in app intervals (the app miss threshold's)


def probe_plan(interval: float, miss_window: float, fence_margin: float,
               failures: int = PROBE_FAILURES) -> tuple[float, float]:
    """(probe_interval, probe_timeout) that put the K-th failure at the fence deadline."""
    timeout = PROBE_TIMEOUT_INTERVALS * interval
    budget = miss_window + fence_margin - SUSPECT_AFTER_INTERVALS * interval - timeout
    floor = MIN_PROBE_INTERVAL_INTERVALS * interval
    # Rounded to the microsecond so that 1.4 / 28 is 0.05, not 0.05000000000000001.
    return round(max(floor, budget / max(1, failures - 1)), 6), round(timeout, 6)


@dataclass(frozen=True)
class DetectorSettings:
    """Detector parameters; build them with :meth:`from_config`."""

    interval: float
    miss_threshold: int
    fence_margin: float
    app_interval: float
    app_miss_threshold: int
    app_progress_timeout: float = 0.0  # 0: PROGRESS_STRIKES x app_interval
    probe_interval: float = 0.05    # how often a SUSPECT node is probed (at I = 1 s)
    probe_timeout: float = 0.6      # the caller reports a probe failed after this
    probe_failures: int = PROBE_FAILURES

    def __post_init__(self) -> None:
        positive = {"interval": self.interval, "app_interval": self.app_interval,
                    "probe_interval": self.probe_interval, "probe_timeout": self.probe_timeout}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"DetectorSettings.{name}: must be > 0, got {value!r}")
        counts = {"miss_threshold": self.miss_threshold, "probe_failures": self.probe_failures,
                  "app_miss_threshold": self.app_miss_threshold}
        for name, count in counts.items():
            if count < 1:
                raise ValueError(f"DetectorSettings.{name}: must be >= 1, got {count!r}")
        if not self.app_progress_timeout >= 0:
            raise ValueError(f"DetectorSettings.app_progress_timeout: must be >= 0, "
                             f"got {self.app_progress_timeout!r}")
        if self.fence_margin < 0:
            raise ValueError(f"DetectorSettings.fence_margin: must be >= 0, "
                             f"got {self.fence_margin!r}")

    @property
    def miss_window(self) -> float:
        """Silence that makes the miss_threshold strikes: interval x miss_threshold."""
        return self.interval * self.miss_threshold

    @property
    def suspect_after(self) -> float:
        """Silence after which a node is SUSPECT (and probed)."""
        return SUSPECT_AFTER_INTERVALS * self.interval

    @property
    def app_window(self) -> float:
        """App silence after which a rank is HUNG."""
        return self.app_interval * self.app_miss_threshold

    @property
    def progress_window(self) -> float:
        """Time without a step change (and not waiting for a peer) after which a rank is
        HUNG."""
        return self.app_progress_timeout or PROGRESS_STRIKES * self.app_interval

    @classmethod
    def from_config(cls, detection_cfg: DetectionConfig) -> DetectorSettings:
        """Settings from ``config.detection``; probe parameters from :func:`probe_plan`."""
        d = detection_cfg
        interval = d.kernel_heartbeat_interval_sec
        probe_interval, probe_timeout = probe_plan(interval, interval * d.miss_threshold,
                                                   d.fence_margin_sec)
        return cls(interval=interval, miss_threshold=d.miss_threshold,
                   fence_margin=d.fence_margin_sec, app_interval=d.app_heartbeat_interval_sec,
                   app_miss_threshold=d.app_miss_threshold,
                   app_progress_timeout=d.app_progress_timeout_sec, probe_interval=probe_interval,
                   probe_timeout=probe_timeout)
