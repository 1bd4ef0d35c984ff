"""Fake sysfs/procfs trees for :func:`raps_slurm.agent.probes.collect` (tests only).

``make_tree(root, nvme_temp_c=72)`` gives a fake node a hot NVMe; call it again on the
same root to change values (a later sample then sees the new ones), and
:func:`remove_device` to pull a device. Only what is asked for is written: everything
else stays "not available", as on a node without that hardware.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

# (current speed, max speed, current width, max width); speeds in GT/s or raw sysfs text
PcieSpec = tuple[float | str, float | str, int, int]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _speed(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:.1f} GT/s PCIe"


def _hwmon_dirs(root: Path) -> list[Path]:
    return sorted((root / "sys/class/hwmon").glob("hwmon*"), key=lambda p: int(p.name[5:]))


def _new_hwmon(root: Path, name: str) -> Path:
    used = [int(p.name[5:]) for p in _hwmon_dirs(root)]
    hw = root / "sys/class/hwmon" / f"hwmon{max(used, default=-1) + 1}"
    _write(hw / "name", name)
    return hw


def _nvme_hwmon(root: Path, dev: str) -> Path:
    """The hwmon of NVMe controller ``dev`` (created with its class and block entries)."""
    for hw in _hwmon_dirs(root):
        link = hw / "device"
        if link.is_symlink() and Path(link.readlink()).name == dev:
            return hw
    (root / "sys/class/nvme" / dev).mkdir(parents=True, exist_ok=True)
    (root / "sys/block" / f"{dev}n1").mkdir(parents=True, exist_ok=True)
    hw = _new_hwmon(root, "nvme")
    # As in real sysfs: hwmonN/device -> the nvme controller.
    (hw / "device").symlink_to(Path("../../nvme") / dev)
    _write(hw / "temp1_label", "Composite")
    return hw


def _generic_temp(root: Path, key: str, celsius: float) -> None:
    """Set ``name/label`` (e.g. ``coretemp/Package id 0``) on a hwmon called ``name``."""
    name, _, label = key.partition("/")
    hw = next((h for h in _hwmon_dirs(root)
               if (h / "name").read_text().strip() == name), None) or _new_hwmon(root, name)
    labels = {p.read_text().strip(): p.name.split("_")[0] for p in hw.glob("temp*_label")}
    sensor = labels.get(label)
    if sensor is None:
        sensor = f"temp{len(list(hw.glob('temp*_input'))) + 1}"
        _write(hw / f"{sensor}_label", label or sensor)
    _write(hw / f"{sensor}_input", str(round(celsius * 1000)))


def _snmp(retrans: int, out_segs: int) -> str:
    """/proc/net/snmp with the given Tcp counters (other rows as on an idle host)."""
    return "\n".join([
        "Ip: Forwarding DefaultTTL InReceives InHdrErrors InAddrErrors ForwDatagrams",
        "Ip: 2 64 392663 0 0 0",
        "Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails "
        "EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors",
        f"Tcp: 1 200 120000 -1 12021 10080 1866 564 6 382879 {out_segs} {retrans} 0 2400 0",
        "Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors",
        "Udp: 5773 2003 0 7781 0 0",
    ])


def make_tree(root: Path, *, nvme_temp_c: float | Mapping[str, float] | None = None,
              hwmon_temps: Mapping[str, float] | None = None,
              retrans: tuple[int, int] | None = None,
              nic_errors: Mapping[str, tuple[int, int]] | None = None,
              edac_ce: Mapping[str, int] | None = None,
              pcie: Mapping[str, PcieSpec] | None = None,
              udev: bool = False) -> Path:
    """Write (or update) a fake node under ``root``; returns ``root``.

    ``nvme_temp_c``: composite temperature of nvme0, or per controller ``{"nvme1": 45}``.
    ``hwmon_temps``: other sensors as ``{"coretemp/Package id 0": 55.0}``.
    ``retrans``: cumulative TCP ``(RetransSegs, OutSegs)`` in ``/proc/net/snmp``.
    ``nic_errors``: cumulative ``{iface: (rx_errors, tx_errors)}`` of physical NICs.
    ``edac_ce``: cumulative corrected errors ``{"mc0": 3}``.
    ``pcie``: ``{address: (speed, max_speed, width, max_width)}``.
    ``udev``: create ``/run/udev/control`` (udevd "running").
    """
    root.mkdir(parents=True, exist_ok=True)
    if nvme_temp_c is not None:
        temps = {"nvme0": nvme_temp_c} if isinstance(nvme_temp_c, (int, float)) else nvme_temp_c
        for dev, celsius in temps.items():
            _write(_nvme_hwmon(root, dev) / "temp1_input", str(round(celsius * 1000)))
    for key, celsius in (hwmon_temps or {}).items():
        _generic_temp(root, key, celsius)
    if retrans is not None:
        _write(root / "proc/net/snmp", _snmp(*retrans))
    for iface, (rx, tx) in (nic_errors or {}).items():
        base = root / "sys/class/net" / iface
        (base / "device").mkdir(parents=True, exist_ok=True)
        _write(base / "statistics/rx_errors", str(rx))
        _write(base / "statistics/tx_errors", str(tx))
    for mc, count in (edac_ce or {}).items():
        _write(root / "sys/devices/system/edac/mc" / mc / "ce_count", str(count))
    for addr, (speed, max_speed, width, max_width) in (pcie or {}).items():
        base = root / "sys/bus/pci/devices" / addr
        _write(base / "current_link_speed", _speed(speed))
        _write(base / "max_link_speed", _speed(max_speed))
        _write(base / "current_link_width", str(width))
        _write(base / "max_link_width", str(max_width))
    if udev:
        _write(root / "run/udev/control", "")
    return root


def remove_device(root: Path, device: str) -> None:
    """Pull a device named as in the probe inventory: ``nvme:nvme0``, ``pci:<addr>``,
    ``net:eth0`` or ``block:nvme0n1`` (an NVMe goes with its hwmon and namespaces)."""
    kind, _, name = device.partition(":")
    paths = {"pci": root / "sys/bus/pci/devices" / name, "net": root / "sys/class/net" / name,
             "block": root / "sys/block" / name, "nvme": root / "sys/class/nvme" / name}
    if kind not in paths:
        raise ValueError(f"unknown device kind in {device!r}")
    if kind == "nvme":
        for hw in _hwmon_dirs(root):
            link = hw / "device"
            if link.is_symlink() and Path(link.readlink()).name == name:
                shutil.rmtree(hw)
        for ns in (root / "sys/block").glob(f"{name}n*"):
            shutil.rmtree(ns)
    shutil.rmtree(paths[kind], ignore_errors=True)
