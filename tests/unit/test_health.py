"""Node health policy (raps_slurm.core.health): thresholds, hysteresis, persistence, DRAIN."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raps_slurm.agent.probes import collect
from raps_slurm.config import DetectionConfig
from raps_slurm.core.health import (
    MAX_REASON_LEN,
    HealthLevel,
    HealthPolicy,
    HealthSettings,
    HealthVerdict,
    door_rejections,
)
from raps_slurm.testing.sysfs import make_tree

OK, DEGRADED, DRAIN = HealthLevel.OK, HealthLevel.DEGRADED, HealthLevel.DRAIN
INTERVAL = 30.0


class Feed:
    """Feeds one node's samples every INTERVAL seconds and keeps the verdicts."""

    def __init__(self, policy: HealthPolicy | None = None, node: str = "n1") -> None:
        self.policy = policy or HealthPolicy()
        self.node = node
        self.t = 1000.0
        self.verdicts: list[HealthVerdict] = []

    def __call__(self, **fields: Any) -> HealthVerdict | None:
        self.t += INTERVAL
        sample = {"at": self.t, "interval_sec": INTERVAL, **fields}
        v = self.policy.observe(self.node, sample, now=self.t)
        if v is not None:
            self.verdicts.append(v)
        return v

    def temps(self, *values: float | None) -> list[HealthVerdict | None]:
        return [self(nvme_temps_c=None if t is None else {"nvme0": t}) for t in values]

    @property
    def levels(self) -> list[HealthLevel]:
        return [v.level for v in self.verdicts]

    @property
    def level(self) -> HealthLevel:
        status = self.policy.status(self.node, self.t)
        assert status is not None
        return status.level


def test_from_config_takes_thresholds_and_interval() -> None:
    cfg = DetectionConfig(smart_temperature_c=65.0, retransmit_ratio_threshold=0.02,
                          telemetry_interval_sec=10.0)
    s = HealthSettings.from_config(cfg)
    assert (s.nvme_temp_c, s.retransmit_ratio, s.interval_sec) == (65.0, 0.02, 10.0)
    assert HealthSettings.from_config(DetectionConfig()).nvme_temp_c == 70.0


@pytest.mark.parametrize("kwargs", [
    {"persist_samples": 0}, {"recovery_samples": 0}, {"ratio_margin": 1.0},
    {"retransmit_ratio": 0.0}, {"temp_margin_c": -1.0}, {"disk_hard_percent": 80.0},
    {"interval_sec": 0.0},
])
def test_bad_settings_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="HealthSettings"):
        HealthSettings(**kwargs)


def test_below_threshold_is_ok_at_threshold_degraded() -> None:
    feed = Feed()
    assert feed.temps(69.9) == [None]
    v = feed.temps(70.0)[0]
    assert v is not None
    assert (v.node, v.level, v.previous) == ("n1", DEGRADED, OK)
    assert v.reason == "raps: nvme0 temp 70C >= 70C"
    assert v.at == feed.t and 31 <= v.score <= 80


def test_degraded_reason_names_device_and_values() -> None:
    feed = Feed()
    v = feed.temps(72.0)[0]
    assert v is not None and v.reason == "raps: nvme0 temp 72C > 70C"
    assert v.conditions == ("nvme0 temp 72C > 70C",)


def test_hysteresis_and_recovery_to_ok() -> None:
    feed = Feed(HealthPolicy(HealthSettings(persist_samples=100)))
    feed.temps(72.0, 69.0, 67.5, 71.0, 67.0)    # 67.0 is not below 70 - 3
    assert feed.levels == [DEGRADED]
    feed.temps(66.9, 60.0)                      # clean, but not for 3 samples yet
    assert feed.levels == [DEGRADED]
    status = feed.policy.status("n1", feed.t)
    assert status is not None and status.reason == "raps: recovering, 2/3 clean samples"
    v = feed.temps(60.0)[0]
    assert v is not None and (v.level, v.previous) == (OK, DEGRADED)
    assert v.reason == "raps: healthy" and v.score == 100 and v.conditions == ()


def test_oscillation_around_threshold_gives_one_degraded_then_one_drain() -> None:
    feed = Feed()
    feed.temps(*[69.5, 70.5] * 20)
    assert feed.levels == [DEGRADED, DRAIN]
    feed2 = Feed(HealthPolicy(HealthSettings(persist_samples=1000)))
    feed2.temps(*[69.5, 70.5] * 20)
    assert feed2.levels == [DEGRADED]


def test_wide_oscillation_does_not_flap() -> None:
    # Crossing the whole band each time: cleared, but never clean long enough to be OK,
    # and never active long enough to drain.
    feed = Feed()
    feed.temps(*[66.0, 71.0] * 20)
    assert feed.levels == [DEGRADED]


@given(st.lists(st.floats(min_value=67.0, max_value=79.9), min_size=1, max_size=40))
def test_any_wobble_inside_the_band_never_flaps(values: list[float]) -> None:
    feed = Feed()
    feed.temps(72.0, *values)
    assert feed.levels[:1] == [DEGRADED]
    assert feed.levels in ([DEGRADED], [DEGRADED, DRAIN])


def test_persistence_drains_after_n_samples() -> None:
    feed = Feed()
    out = feed.temps(72.0, 72.4, 73.0)
    assert out[1] is None
    v = out[2]
    assert v is not None and (v.level, v.previous) == (DRAIN, DEGRADED)
    assert v.reason == "raps: nvme0 temp 73C > 70C for 3 samples"
    assert v.reason.startswith("raps: ") and len(v.reason) < 100
    assert v.score <= 30


def test_unknown_readings_hold_state_and_do_not_count() -> None:
    feed = Feed()
    feed.temps(72.0, None, None, None, 72.0)
    assert feed.levels == [DEGRADED]             # 2 real samples over, not 3
    feed.temps(None, None, None)                 # no evidence either way
    assert feed.level == DEGRADED
    assert feed.temps(72.0)[0] is not None and feed.levels == [DEGRADED, DRAIN]


def test_drain_is_sticky_until_clean() -> None:
    feed = Feed()
    feed.temps(72.0, 72.0, 72.0)
    feed.temps(68.0, 69.0, 66.0, 66.0)           # band, band, clean, clean
    assert feed.levels == [DEGRADED, DRAIN]
    feed.temps(71.0)                             # back over: the clean run starts again
    feed.temps(60.0, 60.0)
    assert feed.level == DRAIN
    v = feed.temps(60.0)[0]
    assert v is not None and (v.level, v.previous) == (OK, DRAIN)


@pytest.mark.parametrize(("fields", "reason"), [
    ({"nvme_temps_c": {"nvme1": 80.0}}, "raps: nvme1 temp 80C >= 80C"),
    ({"disk_used_percent": 99.0, "disk_raps_percent": 98.0}, "raps: ckpt disk 98% full >= 98%"),
    ({"removed": ["nvme:nvme0"], "devices": []}, "raps: device removed: nvme:nvme0"),
])
def test_hard_conditions_drain_at_once(fields: dict[str, Any], reason: str) -> None:
    feed = Feed()
    v = feed(**fields)
    assert v is not None and (v.level, v.previous) == (DRAIN, OK)
    assert v.reason == reason


def test_disk_thresholds() -> None:
    feed = Feed()
    assert feed(disk_used_percent=89.9) is None
    v = feed(disk_used_percent=91.25)
    assert v is not None and v.level == DEGRADED
    assert v.reason == "raps: ckpt disk 91.2% full >= 90%"
    feed(disk_used_percent=86.0)
    v = feed(disk_used_percent=99.0, disk_raps_percent=98.5)
    assert v is not None and v.level == DRAIN and v.reason == "raps: ckpt disk 98.5% full >= 98%"


def test_a_full_disk_drains_only_when_raps_data_fills_it() -> None:
    """No room left for RAPS (someone else's files fill the rest): DEGRADED, no longer a
    recovery target, but not drained, which would move its ranks; a sample of an agent
    that does not report RAPS's share never drains."""
    feed = Feed()
    v = feed(disk_used_percent=100.0, disk_raps_percent=3.0)
    assert v is not None and v.level == DEGRADED
    assert feed(disk_used_percent=100.0) is None
    # however long it lasts (a file system without blocks reserved for root): a full
    # disk is no fault of the node's
    for _ in range(2 * HealthSettings().persist_samples):
        assert feed(disk_used_percent=100.0, disk_raps_percent=3.0) is None
    assert feed.levels == [DEGRADED]


def test_removed_device_latches_until_seen_again() -> None:
    feed = Feed()
    feed(removed=["pci:0000:3b:00.0"], devices=["nvme:nvme0"])
    for _ in range(5):
        feed(devices=["nvme:nvme0"])
    assert feed.levels == [DRAIN]
    for _ in range(3):
        feed(devices=["nvme:nvme0", "pci:0000:3b:00.0"])
    assert feed.levels == [DRAIN, OK]


def test_retransmit_ratio_needs_interval_and_traffic() -> None:
    feed = Feed()
    assert feed(tcp_retransmit_ratio=0.2, tcp_out_segs=999) is None      # too few segments
    assert feed(tcp_retransmit_ratio=0.2, tcp_out_segs=50_000, interval_sec=None) is None
    v = feed(tcp_retransmit_ratio=0.06, tcp_out_segs=10_000)
    assert v is not None and v.level == DEGRADED
    assert v.reason == "raps: tcp retransmit 6.0% >= 5.0%"
    feed(tcp_retransmit_ratio=0.041, tcp_out_segs=10_000)                # within 20 %
    feed(tcp_retransmit_ratio=0.039, tcp_out_segs=10_000)                # cleared
    feed(tcp_retransmit_ratio=0.0, tcp_out_segs=10_000)
    assert feed.levels == [DEGRADED]
    feed(tcp_retransmit_ratio=0.0, tcp_out_segs=10_000)
    assert feed.levels == [DEGRADED, OK]


def test_edac_and_nic_counts_per_interval() -> None:
    feed = Feed()
    assert feed(edac_ce={"mc0": 50}, interval_sec=None) is None   # cumulative: not judged
    assert feed(edac_ce={"mc0": 4}, nic_errors={"eth0": 9}) is None
    v = feed(edac_ce={"mc0": 5}, nic_errors={"eth0": 12})
    assert v is not None and v.level == DEGRADED
    assert v.conditions == ("mc0 5 memory CE/30s >= 5", "eth0 12 errors/30s >= 10")
    assert v.reason == "raps: mc0 5 memory CE/30s >= 5 (+1 more)"


def test_long_interval_is_scaled_down_short_one_not_up() -> None:
    feed = Feed()
    assert feed(edac_ce={"mc0": 10}, interval_sec=120.0) is None   # 2.5 per 30 s
    v = feed(edac_ce={"mc0": 5}, interval_sec=3.0)                   # not 50 per 30 s
    assert v is not None and v.conditions == ("mc0 5 memory CE/30s >= 5",)


def link(addr: str, width: int, max_width: int = 16, speed: float | None = 16.0,
         max_speed: float = 16.0) -> dict[str, Any]:
    return {"address": addr, "width": width, "max_width": max_width, "speed_gts": speed,
            "max_speed_gts": max_speed}


def test_pcie_baseline_then_lost_lanes_then_recovery() -> None:
    feed = Feed(HealthPolicy(HealthSettings(persist_samples=100)))
    narrow_slot = link("0000:af:00.0", 8)
    assert feed(pcie_degraded=[narrow_slot]) is None                 # built that way
    assert feed(pcie_degraded=[narrow_slot]) is None
    v = feed(pcie_degraded=[narrow_slot, link("0000:3b:00.0", 4)])
    assert v is not None and v.level == DEGRADED
    assert v.reason == "raps: pcie 0000:3b:00.0 x4 < x16"
    for _ in range(3):
        feed(pcie_degraded=[narrow_slot])                            # retrained to x16
    assert feed.levels == [DEGRADED, OK]
    v = feed(pcie_degraded=[link("0000:af:00.0", 4)])                # the x8 one loses lanes
    assert v is not None and v.reason == "raps: pcie 0000:af:00.0 x4 < x8"


def test_pcie_link_down_drains_and_speed_is_ignored_by_default() -> None:
    feed = Feed()
    feed(pcie_degraded=[])
    assert feed(pcie_degraded=[link("0000:5e:00.0", 16, speed=2.5)]) is None
    v = feed(pcie_degraded=[link("0000:3b:00.0", 0, speed=None)])
    assert v is not None and v.level == DRAIN
    assert v.reason == "raps: pcie 0000:3b:00.0 link down (was x16)"


def test_pcie_speed_counts_when_asked() -> None:
    feed = Feed(HealthPolicy(HealthSettings(check_pcie_speed=True)))
    feed(pcie_degraded=[])
    v = feed(pcie_degraded=[link("0000:5e:00.0", 16, speed=2.5)])
    assert v is not None and v.reason == "raps: pcie 0000:5e:00.0 2.5GT/s < 16GT/s"


def test_same_sample_twice_counts_once() -> None:
    policy = HealthPolicy()
    sample = {"at": 10.0, "interval_sec": 30.0, "nvme_temps_c": {"nvme0": 75.0}}
    results = [policy.observe("n1", sample, now=10.0 + i) for i in range(5)]
    assert [r.level if r else None for r in results] == [DEGRADED, None, None, None, None]
    older = dict(sample, at=5.0, disk_used_percent=99.0)
    assert policy.observe("n1", older, now=20.0) is None


@pytest.mark.parametrize("junk", [
    {"nvme_temps_c": "hot"}, {"nvme_temps_c": {"nvme0": "72"}}, {"nvme_temps_c": {"a": True}},
    {"nvme_temps_c": {"nvme0": float("nan")}}, {"disk_used_percent": [99]},
    {"pcie_degraded": ["0000:3b:00.0", {"address": 5}, {"address": "x", "width": "8"}]},
    {"removed": "nvme0"}, {"devices": 3}, {"edac_ce": [1, 2]}, {"at": "soon"},
    {"tcp_retransmit_ratio": "0.5", "tcp_out_segs": 10_000},
])
def test_malformed_records_are_ignored(junk: dict[str, Any]) -> None:
    feed = Feed()
    feed(pcie_degraded=[])
    assert feed(**junk) is None
    assert feed.level == OK


def test_reason_fits_slurm_and_is_printable() -> None:
    feed = Feed()
    name = "nvme-" + "x" * 200 + "\u00e9\n"
    v = feed(nvme_temps_c={name: 90.0, "nvme0": 75.0})
    assert v is not None and v.level == DRAIN
    assert v.reason.startswith("raps: nvme-xxx") and v.reason.endswith("... (+1 more)")
    assert len(v.reason) <= MAX_REASON_LEN < 100
    assert v.reason.isascii() and v.reason.isprintable()


def test_worst_condition_leads_and_scores_order_by_level() -> None:
    feed = Feed()
    v1 = feed(nvme_temps_c={"nvme0": 72.0})
    v2 = feed(nvme_temps_c={"nvme0": 72.0}, removed=["net:eth0"])
    assert v1 is not None and v2 is not None
    assert v2.reason == "raps: device removed: net:eth0 (+1 more)"
    assert 100 > v1.score > 30 >= v2.score >= 0


def test_nodes_are_independent_status_and_forget() -> None:
    policy = HealthPolicy()
    assert policy.status("n1", 0.0) is None
    policy.observe("n1", {"at": 1.0, "nvme_temps_c": {"nvme0": 72.0}}, now=1.0)
    policy.observe("n2", {"at": 1.0, "nvme_temps_c": {"nvme0": 40.0}}, now=1.0)
    assert policy.nodes() == ["n1", "n2"]
    s1, s2 = policy.status("n1", 2.0), policy.status("n2", 2.0)
    assert s1 is not None and s1.level == DEGRADED and s1.at == 2.0
    assert s2 is not None and (s2.level, s2.score, s2.reason) == (OK, 100, "raps: healthy")
    policy.forget("n1")
    assert policy.nodes() == ["n2"]


def test_probe_sample_feeds_the_policy(tmp_path: Path) -> None:
    make_tree(tmp_path, nvme_temp_c=72.0, retrans=(0, 0))
    policy = HealthPolicy(HealthSettings.from_config(DetectionConfig()))
    first = collect(tmp_path, now=100.0)
    v = policy.observe("n3", first, now=100.0)
    assert v is not None and v.reason == "raps: nvme0 temp 72C > 70C"
    make_tree(tmp_path, retrans=(900, 10_000))
    second = collect(tmp_path, previous=first, now=130.0)
    assert policy.observe("n3", second.to_dict(), now=130.0) is None
    status = policy.status("n3", 130.0)
    assert status is not None
    assert status.conditions == ("nvme0 temp 72C > 70C", "tcp retransmit 9.0% >= 5.0%")


def test_door_rejections_are_read_and_bad_entries_named() -> None:
    sample = {"rejected": {"transfer": {"handshake": 3, "io": 0},
                           "local_api": {"json": 2, "Bad Kind": 1, "size": -1, "x": True},
                           "BAD DOOR": {"a": 1}, "heartbeat": [1]}}
    counts, problems = door_rejections(sample)
    assert counts == {("transfer", "handshake"): 3, ("transfer", "io"): 0,
                      ("local_api", "json"): 2}
    assert len(problems) == 5, problems
    assert any("'Bad Kind'" in p for p in problems)
    assert any("'BAD DOOR'" in p for p in problems)
    assert door_rejections({}) == ({}, [])
    assert door_rejections({"rejected": 5})[1] == [
        "rejected: expected an object of doors, got int"]


def test_door_rejections_keep_a_bounded_label_set() -> None:
    counts, problems = door_rejections(
        {"rejected": {"flood": {f"k{i}": i for i in range(100)}}})
    assert len(counts) == 64 and len(problems) == 36


def test_a_sample_with_rejections_is_judged_as_without() -> None:
    policy = HealthPolicy(HealthSettings())
    sample = {"at": 1.0, "rejected": {"transfer": {"io": 1}}}
    assert policy.observe("n1", sample, 1.0) is None
