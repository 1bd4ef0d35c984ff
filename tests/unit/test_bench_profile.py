"""The benchmarks' cluster profile (``raps_slurm/bench/cluster.py``): the test profile
with production detection, and with ``quiet`` the background keys at their defaults."""

from __future__ import annotations

from pathlib import Path

from raps_slurm.bench.cluster import QUIET, profile
from raps_slurm.config import Config, load_config


def _value(cfg: Config, section: str, key: str) -> object:
    return getattr(getattr(cfg, section), key)


def test_quiet_keeps_the_background_at_the_defaults(tmp_path: Path) -> None:
    defaults = Config()
    (tmp_path / "loud").mkdir()
    loud = load_config(str(profile(tmp_path / "loud", 1.0)))
    quiet = load_config(str(profile(tmp_path, 1.0, quiet=True)))
    for section, key in QUIET:
        assert _value(quiet, section, key) == _value(defaults, section, key), key
        assert _value(loud, section, key) != _value(defaults, section, key), key
    # the rest stays the bench's: production node detection, the test's rank detection
    for cfg in (loud, quiet):
        assert cfg.detection.kernel_heartbeat_interval_sec == 1.0
        assert cfg.detection.app_heartbeat_interval_sec == loud.detection.app_heartbeat_interval_sec
        assert cfg.checkpoint.interval_sec == loud.checkpoint.interval_sec
