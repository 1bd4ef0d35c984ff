"""Node health probes (raps_slurm.agent.probes) on fake sysfs/procfs trees under tmp_path."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.agent.probes import PcieLink, ProbeSample, UdevWatcher, collect
from raps_slurm.core.health import HealthLevel, HealthPolicy
from raps_slurm.testing.sysfs import make_tree, remove_device


class FakeHost:
    """HostStats with fixed readings."""

    def __init__(self, cpu: float | None = 12.5, mem: float | None = 40.0,
                 disk: tuple[int, int, int] | None = (1000, 900, 100)) -> None:
        self.cpu, self.mem, self.disk = cpu, mem, disk
        self.disk_paths: list[Path] = []

    def cpu_percent(self) -> float | None:
        return self.cpu

    def mem_used_percent(self) -> float | None:
        return self.mem

    def disk_usage(self, path: Path) -> tuple[int, int, int] | None:
        self.disk_paths.append(path)
        return self.disk


def test_hot_nvme_is_read_by_device_name(tmp_path: Path) -> None:
    make_tree(tmp_path, nvme_temp_c=72.0)
    s = collect(tmp_path, now=100.0)
    assert s.nvme_temps_c == {"nvme0": 72.0}
    assert s.temps_c == {}
    assert s.problems == ()
    assert s.at == 100.0


def test_nvme_extra_sensors_and_generic_hwmon_are_labelled(tmp_path: Path) -> None:
    make_tree(tmp_path, nvme_temp_c={"nvme0": 41.5, "nvme1": 39.0},
              hwmon_temps={"coretemp/Package id 0": 55.0, "coretemp/Core 0": 51.0,
                           "k10temp/Tctl": 60.25})
    hw = next(h for h in (tmp_path / "sys/class/hwmon").iterdir()
              if (h / "device").is_symlink() and (h / "device").readlink().name == "nvme1")
    (hw / "temp2_input").write_text("47850\n")
    (hw / "temp2_label").write_text("Sensor 1\n")
    s = collect(tmp_path)
    assert s.nvme_temps_c == {"nvme0": 41.5, "nvme1": 39.0}
    assert s.temps_c == {"nvme1/Sensor 1": 47.85, "coretemp/Package id 0": 55.0,
                         "coretemp/Core 0": 51.0, "k10temp/Tctl": 60.25}


def test_composite_label_wins_over_lower_index(tmp_path: Path) -> None:
    hw = tmp_path / "sys/class/hwmon/hwmon0"
    hw.mkdir(parents=True)
    (hw / "name").write_text("nvme\n")
    (hw / "temp1_input").write_text("80000\n")
    (hw / "temp1_label").write_text("Sensor 1\n")
    (hw / "temp2_input").write_text("65000\n")
    (hw / "temp2_label").write_text("Composite\n")
    s = collect(tmp_path)
    # No device link: the hwmon directory names the drive.
    assert s.nvme_temps_c == {"hwmon0": 65.0}
    assert s.temps_c == {"hwmon0/Sensor 1": 80.0}


def test_same_sensor_name_on_two_chips_is_told_apart(tmp_path: Path) -> None:
    for i in (0, 1):
        hw = tmp_path / f"sys/class/hwmon/hwmon{i}"
        hw.mkdir(parents=True)
        (hw / "name").write_text("coretemp\n")
        (hw / "temp1_input").write_text(f"{50 + i}000\n")
    s = collect(tmp_path)
    assert s.temps_c == {"coretemp/temp1": 50.0, "coretemp@hwmon1/temp1": 51.0}


def test_tcp_retransmits_cumulative_then_delta(tmp_path: Path) -> None:
    make_tree(tmp_path, retrans=(100, 10_000))
    first = collect(tmp_path, now=0.0)
    assert (first.tcp_retrans_segs, first.tcp_out_segs) == (100, 10_000)
    assert first.tcp_retransmit_ratio == 0.01
    assert first.interval_sec is None
    make_tree(tmp_path, retrans=(700, 20_000))
    second = collect(tmp_path, previous=first, now=30.0)
    assert (second.tcp_retrans_segs, second.tcp_out_segs) == (600, 10_000)
    assert second.tcp_retransmit_ratio == 0.06
    assert second.interval_sec == 30.0


def test_tcp_counter_reset_and_idle_interval(tmp_path: Path) -> None:
    make_tree(tmp_path, retrans=(500, 90_000))
    before = collect(tmp_path, now=0.0)
    make_tree(tmp_path, retrans=(5, 1_000))  # rebooted: counts since the reset
    after = collect(tmp_path, previous=before, now=30.0)
    assert (after.tcp_retrans_segs, after.tcp_out_segs) == (5, 1_000)
    idle = collect(tmp_path, previous=after, now=60.0)
    assert (idle.tcp_retrans_segs, idle.tcp_out_segs) == (0, 0)
    assert idle.tcp_retransmit_ratio is None  # no traffic, no ratio


def test_nic_and_edac_deltas(tmp_path: Path) -> None:
    make_tree(tmp_path, nic_errors={"eth0": (5, 1), "ib0": (0, 0)}, edac_ce={"mc0": 3, "mc1": 0})
    lo = tmp_path / "sys/class/net/lo/statistics"
    lo.mkdir(parents=True)
    (lo / "rx_errors").write_text("99\n")
    first = collect(tmp_path, now=0.0)
    assert first.nic_errors == {"eth0": 6, "ib0": 0}
    assert first.edac_ce == {"mc0": 3, "mc1": 0}
    make_tree(tmp_path, nic_errors={"eth0": (9, 3), "eth1": (50, 0)}, edac_ce={"mc0": 10})
    second = collect(tmp_path, previous=first, now=30.0)
    # eth1 is new: its first delta is unknown, not 50 errors in one interval.
    assert second.nic_errors == {"eth0": 6, "ib0": 0}
    assert second.edac_ce == {"mc0": 7, "mc1": 0}
    third = collect(tmp_path, previous=second, now=60.0)
    assert third.nic_errors == {"eth0": 0, "eth1": 0, "ib0": 0}


def test_pcie_links_below_max(tmp_path: Path) -> None:
    make_tree(tmp_path, pcie={
        "0000:3b:00.0": (16.0, 16.0, 8, 16),          # lost lanes
        "0000:5e:00.0": (2.5, 16.0, 16, 16),          # slow (a GPU at idle, say)
        "0000:af:00.0": (16.0, 16.0, 16, 16),         # healthy: not listed
        "0000:d8:00.0": ("Unknown", 8.0, 0, 4),       # link down
    })
    vf = tmp_path / "sys/bus/pci/devices/0000:3b:00.2"
    vf.mkdir()
    (vf / "physfn").mkdir()
    (vf / "max_link_width").write_text("16\n")
    (tmp_path / "sys/bus/pci/devices/0000:00:14.0").mkdir()  # no PCIe link at all
    s = collect(tmp_path)
    assert s.pcie_degraded == (
        PcieLink("0000:3b:00.0", 16.0, 16.0, 8, 16),
        PcieLink("0000:5e:00.0", 2.5, 16.0, 16, 16),
        PcieLink("0000:d8:00.0", None, 8.0, 0, 4),
    )
    assert s.devices == ("pci:0000:3b:00.0", "pci:0000:5e:00.0", "pci:0000:af:00.0",
                         "pci:0000:d8:00.0")
    assert s.problems == ()


def test_missing_everything_is_not_available(tmp_path: Path) -> None:
    s = collect(tmp_path / "nothing", ckpt_dir=tmp_path / "no-such-dir", now=5.0)
    assert s == ProbeSample(at=5.0, devices=())
    assert json.loads(json.dumps(s.to_dict()))["nvme_temps_c"] is None


def test_default_host_skips_cpu_mem_under_a_fake_root(tmp_path: Path) -> None:
    s = collect(tmp_path, ckpt_dir=tmp_path)
    assert s.cpu_percent is None and s.mem_used_percent is None
    assert s.disk_path == str(tmp_path)
    assert s.disk_used_percent is not None and 0.0 <= s.disk_used_percent <= 100.0
    assert s.disk_free_bytes is not None and s.disk_total_bytes is not None


def test_injected_host(tmp_path: Path) -> None:
    host = FakeHost(cpu=float("nan"))
    s = collect(tmp_path, ckpt_dir=tmp_path / "ckpt", host=host)
    assert host.disk_paths == [tmp_path / "ckpt"]
    assert s.cpu_percent is None  # NaN cannot go into JSON
    assert s.mem_used_percent == 40.0
    # used 900 of 1000 by others, none of it RAPS's: 100 left for root, 0 % RAPS's
    assert (s.disk_total_bytes, s.disk_free_bytes, s.disk_raps_bytes) == (1000, 100, 0)
    assert (s.disk_used_percent, s.disk_raps_percent) == (0.0, 0.0)


def test_filling_a_shared_file_system_leaves_the_node_healthy(tmp_path: Path) -> None:
    """The checkpoint dir on a file system a user can write (a /tmp on the same disk):
    the user fills every block users may have. RAPS's data and root's reserved blocks
    are unchanged, so the disk readings stay where they were and the node stays OK; the
    old reading (used / (used + available)) said 100 % and drained it."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "job-5").mkdir(parents=True)
    (ckpt / "job-5" / "pack-1").write_bytes(os.urandom(64 << 10))
    raps = sum(p.stat().st_blocks * 512 for p in ckpt.rglob("*") if p.is_file())
    gib = 1 << 30
    total, reserved = 100 * gib, 5 * gib  # ext4's default: 5 % reserved for root
    before = collect(tmp_path, ckpt_dir=ckpt, host=FakeHost(disk=(total, 40 * gib,
                                                                  55 * gib)), now=1.0)
    full = collect(tmp_path, ckpt_dir=ckpt, host=FakeHost(disk=(total, total - reserved, 0)),
                   now=2.0)
    assert full.disk_raps_bytes == before.disk_raps_bytes == raps
    assert full.disk_free_bytes == reserved
    assert full.disk_used_percent is not None and full.disk_used_percent < 1.0
    policy = HealthPolicy()
    for s in (before, full):
        assert policy.observe("n1", s.to_dict(), now=s.at) is None  # stays OK


def test_raps_data_filling_its_own_file_system_drains(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "pack").write_bytes(os.urandom(1 << 20))
    raps = sum(p.stat().st_blocks * 512 for p in ckpt.rglob("*") if p.is_file())
    s = collect(tmp_path, ckpt_dir=ckpt, host=FakeHost(disk=(raps, raps, 0)), now=1.0)
    assert (s.disk_used_percent, s.disk_raps_percent) == (100.0, 100.0)
    v = HealthPolicy().observe("n1", s.to_dict(), now=1.0)
    assert v is not None and v.level == HealthLevel.DRAIN


def test_malformed_files_give_none_and_one_line_problems(tmp_path: Path) -> None:
    make_tree(tmp_path, nvme_temp_c=50.0, nic_errors={"eth0": (0, 0)}, edac_ce={"mc0": 0},
              pcie={"0000:3b:00.0": (16.0, 16.0, 16, 16)})
    (tmp_path / "sys/class/hwmon/hwmon0/temp1_input").write_text("hot\n")
    (tmp_path / "sys/class/net/eth0/statistics/rx_errors").write_text("\n")
    (tmp_path / "sys/devices/system/edac/mc/mc0/ce_count").write_text("-x-\n")
    (tmp_path / "sys/bus/pci/devices/0000:3b:00.0/current_link_width").write_text("x16\n")
    (tmp_path / "sys/bus/pci/devices/0000:3b:00.0/max_link_speed").write_text("fast\n")
    (tmp_path / "proc/net").mkdir(parents=True)
    (tmp_path / "proc/net/snmp").write_text("Tcp: RetransSegs OutSegs\nTcp: 1\n")
    s = collect(tmp_path)
    assert s.nvme_temps_c == {}
    assert s.tcp_retransmit_ratio is None and s.tcp_out_segs is None
    assert s.nic_errors == {"eth0": 0}  # tx_errors still read
    assert s.edac_ce == {}
    assert s.pcie_degraded == ()
    assert sorted(s.problems) == [
        "/proc/net/snmp: Tcp: 2 names but 1 values",
        "/sys/bus/pci/devices/0000:3b:00.0/current_link_width: not an integer: 'x16'",
        "/sys/bus/pci/devices/0000:3b:00.0/max_link_speed: not a link speed: 'fast'",
        "/sys/class/hwmon/hwmon0/temp1_input: not an integer: 'hot'",
        "/sys/class/net/eth0/statistics/rx_errors: not an integer: ''",
        "/sys/devices/system/edac/mc/mc0/ce_count: not an integer: '-x-'",
    ]
    assert all("\n" not in p for p in s.problems)


@pytest.mark.parametrize("snmp", [
    "Ip: a b\nIp: 1 2\n",                                  # no Tcp rows
    "Tcp: OutSegs\nTcp: 5\n",                              # no RetransSegs
    "Tcp: RetransSegs OutSegs\nTcp: 1 many\n",             # not a number
])
def test_malformed_snmp(tmp_path: Path, snmp: str) -> None:
    (tmp_path / "proc/net").mkdir(parents=True)
    (tmp_path / "proc/net/snmp").write_text(snmp)
    s = collect(tmp_path)
    assert s.tcp_retransmit_ratio is None and len(s.problems) == 1
    assert s.problems[0].startswith("/proc/net/snmp: ")


def test_implausible_and_unreadable_sensors_are_noted(tmp_path: Path) -> None:
    make_tree(tmp_path, nvme_temp_c={"nvme0": 50.0, "nvme1": 40.0})
    (tmp_path / "sys/class/hwmon/hwmon0/temp1_input").write_text("-273150\n")
    bad = tmp_path / "sys/class/hwmon/hwmon1/temp1_input"
    bad.unlink()
    bad.mkdir()  # reading it fails with EISDIR, standing in for EIO from a dying drive
    s = collect(tmp_path)
    assert s.nvme_temps_c == {}
    assert [p.split(": ", 1)[1] for p in s.problems] == ["implausible temperature -273.15C",
                                                         "read error: Is a directory"]


def test_removed_devices_from_inventory_and_events(tmp_path: Path) -> None:
    make_tree(tmp_path, nvme_temp_c=40.0, nic_errors={"eth0": (0, 0)},
              pcie={"0000:3b:00.0": (16.0, 16.0, 16, 16)})
    first = collect(tmp_path, now=0.0)
    assert first.devices == ("block:nvme0n1", "net:eth0", "nvme:nvme0", "pci:0000:3b:00.0")
    remove_device(tmp_path, "nvme:nvme0")
    remove_device(tmp_path, "pci:0000:3b:00.0")
    second = collect(tmp_path, previous=first, now=30.0, removed_events=["net:eth9"])
    assert second.removed == ("block:nvme0n1", "net:eth9", "nvme:nvme0", "pci:0000:3b:00.0")
    assert second.nvme_temps_c is None
    assert collect(tmp_path, previous=second, now=60.0).removed == ()


def test_virtual_devices_are_not_inventory(tmp_path: Path) -> None:
    (tmp_path / "sys/class/net/veth12/statistics").mkdir(parents=True)
    (tmp_path / "sys/devices/virtual/block/loop0").mkdir(parents=True)
    (tmp_path / "sys/block").mkdir(parents=True)
    (tmp_path / "sys/block/loop0").symlink_to("../devices/virtual/block/loop0")
    assert collect(tmp_path).devices == ()


def test_previous_not_older_gives_no_deltas(tmp_path: Path) -> None:
    make_tree(tmp_path, retrans=(10, 100))
    first = collect(tmp_path, now=50.0)
    again = collect(tmp_path, previous=first, now=50.0)
    assert again.interval_sec is None and again.tcp_out_segs == 100
    assert again.problems == ("previous sample is not older (0s): no deltas",)


def test_to_dict_is_json(tmp_path: Path) -> None:
    make_tree(tmp_path, nvme_temp_c=72.0, retrans=(1, 10), nic_errors={"eth0": (1, 2)},
              edac_ce={"mc0": 1}, pcie={"0000:3b:00.0": (8.0, 16.0, 16, 16)})
    s = collect(tmp_path, ckpt_dir=tmp_path, host=FakeHost(), now=1.5)
    data = json.loads(json.dumps(s.to_dict()))
    assert data["pcie_degraded"] == [{"address": "0000:3b:00.0", "speed_gts": 8.0,
                                      "max_speed_gts": 16.0, "width": 16, "max_width": 16}]
    assert data["nvme_temps_c"] == {"nvme0": 72.0}
    assert data["counters"]["nic.eth0.tx_errors"] == 2
    assert data["removed"] == [] and data["at"] == 1.5


# -- udev ----------------------------------------------------------------------------


class FakeDevice:
    def __init__(self, action: str, subsystem: str, name: str, path: str = "/devices/pci0/x",
                 device_type: str | None = None) -> None:
        self.action, self.subsystem, self.sys_name = action, subsystem, name
        self.device_path, self.device_type = path, device_type


def fake_pyudev() -> tuple[types.ModuleType, dict[str, Any]]:
    seen: dict[str, Any] = {"filters": [], "stopped": False}

    class Monitor:
        @staticmethod
        def from_netlink(context: object) -> Monitor:
            return Monitor()

        def filter_by(self, subsystem: str) -> None:
            seen["filters"].append(subsystem)

    class MonitorObserver:
        def __init__(self, monitor: Monitor, callback: Any, name: str) -> None:
            seen["callback"] = callback

        def start(self) -> None:
            seen["started"] = True

        def stop(self) -> None:
            seen["stopped"] = True

    mod = types.ModuleType("pyudev")
    mod.Context = object  # type: ignore[attr-defined]
    mod.Monitor = Monitor  # type: ignore[attr-defined]
    mod.MonitorObserver = MonitorObserver  # type: ignore[attr-defined]
    return mod, seen


def test_udev_unavailable_without_udevd(tmp_path: Path) -> None:
    w = UdevWatcher(tmp_path)
    assert w.start() is False and w.available is False
    assert w.drain() == []
    w.stop()


def test_udev_unavailable_without_pyudev(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_tree(tmp_path, udev=True)
    monkeypatch.setitem(sys.modules, "pyudev", None)  # import raises ImportError
    w = UdevWatcher(tmp_path)
    assert w.start() is False and w.available is False


def test_udev_reports_physical_removals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_tree(tmp_path, udev=True)
    mod, seen = fake_pyudev()
    monkeypatch.setitem(sys.modules, "pyudev", mod)
    w = UdevWatcher(tmp_path)
    assert w.start() is True and w.available is True and seen["started"]
    assert seen["filters"] == ["nvme", "block", "net", "pci"]
    callback = seen["callback"]
    callback(FakeDevice("remove", "nvme", "nvme0"))
    callback(FakeDevice("add", "nvme", "nvme1"))
    callback(FakeDevice("remove", "net", "veth1", "/devices/virtual/net/veth1"))
    callback(FakeDevice("remove", "block", "sdb", "/devices/pci0/usb2/2-1/block/sdb"))
    callback(FakeDevice("remove", "block", "nvme0n1p1", device_type="partition"))
    callback(FakeDevice("remove", "input", "event3"))
    callback(object())  # a broken event is ignored, not raised in the observer thread
    callback(FakeDevice("remove", "pci", "0000:3b:00.0"))
    assert w.drain() == ["nvme:nvme0", "pci:0000:3b:00.0"]
    assert w.drain() == []
    w.stop()
    assert seen["stopped"] and w.available is False


def test_the_agent_warns_when_the_checkpoint_dir_shares_a_user_writable_fs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from raps_slurm.agent.health import warn_if_shared

    public = tmp_path / "tmp"
    public.mkdir()
    with caplog.at_level("WARNING", logger="raps.agent"):
        # not created yet: judged by the parent it will be made in
        assert warn_if_shared(tmp_path / "ckpt" / "n1", [str(public)]) == [str(public)]
    assert "shares a file system with" in caplog.text and "docs/install.md" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="raps.agent"):
        assert warn_if_shared(tmp_path / "ckpt", ["/proc", str(tmp_path / "absent")]) == []
    assert caplog.text == ""
