"""etcd upkeep: the compaction target, the size warning, and the leader's pass on the
in-memory store (which keeps history and compacts like etcd)."""

from __future__ import annotations

import pytest

from raps_slurm.config import parse_config
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.hygiene import Hygiene
from raps_slurm.core.hygiene import compaction_target, keep_samples, size_warning
from raps_slurm.errors import StoreError
from raps_slurm.store import Keys, MemoryStore
from raps_slurm.testing import FakeClock


def test_compaction_target_is_the_newest_sample_past_the_retention() -> None:
    samples = [(0.0, 10), (300.0, 50), (600.0, 90), (900.0, 120)]
    assert compaction_target(samples, 900.0, 3600.0, 0) is None
    assert compaction_target(samples, 3900.0, 3600.0, 0) == 50
    assert compaction_target(samples, 3900.0, 3600.0, 50) is None   # done already
    assert compaction_target(samples, 9999.0, 3600.0, 50) == 120
    assert compaction_target(samples, 9999.0, 0.0, 0) is None         # compaction off
    assert keep_samples(samples, 3900.0, 3600.0) == [(300.0, 50), (600.0, 90), (900.0, 120)]


def test_size_warning() -> None:
    assert size_warning(100, 0) is None
    assert size_warning(79, 100) is None
    line = size_warning(90 * 2**20, 100 * 2**20)
    assert line is not None and "90% of its quota 100 MiB" in line


def test_leader_compacts_what_is_older_than_the_retention() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    keys = Keys()
    cfg = parse_config({"store": {"compaction_retention_sec": 60,
                                  "compaction_interval_sec": 10,
                                  "space_quota_bytes": 4096}})
    lead = Leadership(store, keys.leader(), 10, {"name": "a"}, clock=clock)
    h = Hygiene(cfg, store, lead, monotonic=clock)
    assert h.step() == []                      # not leading
    assert lead.step()
    first = store.put("/raps/v1/x", b"1")
    lines: list[str] = []
    for _ in range(8):                         # 80 s of passes, a write in each
        lines += h.step()
        store.put("/raps/v1/x", b"v" * 1000)
        clock.advance(10)
        assert lead.step()
    assert any(line.startswith("etcd history compacted to revision") for line in lines)
    assert 0 < h.compacted < store.current_revision()
    with pytest.raises(StoreError):
        store.watch_prefix("/raps/v1/", start_revision=first).next(0.1)
    assert any("of its quota" in line for line in lines)  # 8 KB of history on a 4 KB quota
    assert h.last is not None and h.last.db_size > 0
