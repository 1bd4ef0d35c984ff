"""Node health probes: one :class:`ProbeSample` of this node, read from sysfs and procfs.

Every path is read under an injectable ``root`` (``/`` on a real node, a fixture tree
under ``tmp_path`` in tests, see :mod:`raps_slurm.testing.sysfs`). CPU, memory and disk
usage are not files under ``root``; they come from a :class:`HostStats` (psutil by
default; with another ``root`` CPU and memory are skipped unless one is passed).

A missing file or directory means "not available" (``None``), never an exception: most
nodes lack some of these sources (no EDAC driver, no NVMe, containers without hwmon).
A file that exists but holds something unexpected also gives ``None`` for that value,
plus a one-line note in :attr:`ProbeSample.problems`, so that a broken sensor is seen
rather than silently ignored.

Counters (TCP, NIC errors, EDAC) are reported per interval when a ``previous`` sample is
given, else cumulative since boot; :attr:`ProbeSample.interval_sec` is ``None`` in the
latter case, which tells the health policy not to judge them. The raw cumulative values
travel in :attr:`ProbeSample.counters` for the next delta.

:class:`UdevWatcher` adds device removal events (nvme, block, net, pci) between samples
when pyudev is importable and udevd runs; without them, removals are still found by
comparing the device inventory of two samples.
"""

from __future__ import annotations

import errno
import importlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

log = logging.getLogger(__name__)

# Readings outside this range are a broken sensor, not a temperature (0xFFFF, -273...).
_TEMP_RANGE_C = (-40.0, 200.0)
UDEV_SUBSYSTEMS = ("nvme", "block", "net", "pci")
_MAX_PENDING_EVENTS = 1000  # bound the watcher's list if nobody drains it


@dataclass(frozen=True)
class PcieLink:
    """A PCIe link trained below its maximum (width 0 / speed ``None`` = link down)."""

    address: str
    speed_gts: float | None
    max_speed_gts: float | None
    width: int
    max_width: int

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly data."""
        return {"address": self.address, "speed_gts": self.speed_gts,
                "max_speed_gts": self.max_speed_gts, "width": self.width,
                "max_width": self.max_width}


@dataclass(frozen=True)
class ProbeSample:
    """One sample of node health; ``None`` means "not available on this node".

    Mappings are keyed by device (``nvme0``, ``eth0``, ``mc0``). Counts (NIC errors,
    EDAC CE, TCP segments) cover ``interval_sec`` when it is set, else since boot.
    ``devices`` is the inventory (``pci:0000:3b:00.0``, ``nvme:nvme0``, ``net:eth0``,
    ``block:nvme0n1``) and ``removed`` the inventory entries gone since ``previous``
    plus udev removal events.
    """

    at: float
    interval_sec: float | None = None
    cpu_percent: float | None = None
    mem_used_percent: float | None = None
    disk_path: str | None = None
    disk_total_bytes: int | None = None
    disk_free_bytes: int | None = None  # for root: the reserved blocks count as free
    disk_raps_bytes: int | None = None  # what the checkpoint dir itself holds
    disk_used_percent: float | None = None  # that, of that plus the free bytes
    disk_raps_percent: float | None = None  # that, of the file system's total
    nvme_temps_c: Mapping[str, float] | None = None
    temps_c: Mapping[str, float] | None = None
    tcp_retrans_segs: int | None = None
    tcp_out_segs: int | None = None
    tcp_retransmit_ratio: float | None = None
    nic_errors: Mapping[str, int] | None = None
    edac_ce: Mapping[str, int] | None = None
    pcie_degraded: tuple[PcieLink, ...] | None = None
    devices: tuple[str, ...] | None = None
    removed: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    counters: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly data (tuples become lists, links become dicts)."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, Mapping):
                value = dict(value)
            elif name == "pcie_degraded" and value is not None:
                value = [link.to_dict() for link in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[name] = value
        return out


class HostStats(Protocol):
    """Readings that are not files under ``root``: injectable for tests and fake nodes."""

    def cpu_percent(self) -> float | None:
        """CPU busy % since the previous call (None = unknown)."""

    def mem_used_percent(self) -> float | None:
        """Memory in use, % of total."""

    def disk_usage(self, path: Path) -> tuple[int, int, int] | None:
        """(total, used, free) bytes of the filesystem holding ``path``; None if missing."""


class PsutilHost:
    """:class:`HostStats` from psutil; ``cpu_mem=False`` skips CPU and memory."""

    def __init__(self, cpu_mem: bool = True) -> None:
        self.cpu_mem = cpu_mem

    def cpu_percent(self) -> float | None:
        """CPU busy % since the previous call (the first call says 0.0)."""
        if not self.cpu_mem:
            return None
        import psutil
        return float(psutil.cpu_percent(interval=None))

    def mem_used_percent(self) -> float | None:
        """Memory in use, % of total."""
        if not self.cpu_mem:
            return None
        import psutil
        return float(psutil.virtual_memory().percent)

    def disk_usage(self, path: Path) -> tuple[int, int, int] | None:
        """(total, used, free) bytes, None when ``path`` does not exist."""
        import psutil
        try:
            u = psutil.disk_usage(str(path))
        except OSError:  # missing, not a directory, no permission: not available
            return None
        return int(u.total), int(u.used), int(u.free)


class _Reader:
    """Reads small files under ``root``; records problems instead of raising."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.problems: list[str] = []

    def rel(self, path: Path) -> str:
        """``path`` as the node sees it (``/sys/...``), for problem notes."""
        try:
            return "/" + str(path.relative_to(self.root))
        except ValueError:
            return str(path)

    def note(self, path: Path, what: str) -> None:
        """Record one problem line."""
        self.problems.append(f"{self.rel(path)}: {what}")

    def text(self, path: Path) -> str | None:
        """Stripped file contents; None when missing (or unreadable, with a note)."""
        try:
            return path.read_text(errors="replace").strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            # EIO/ENODATA from a sensor or a device falling off the bus is worth seeing.
            if exc.errno in (errno.ENOENT, errno.ENODEV, errno.ENXIO):
                return None
            self.note(path, f"read error: {exc.strerror or exc}")
            return None

    def integer(self, path: Path) -> int | None:
        """File contents as an integer; malformed = None plus a note."""
        raw = self.text(path)
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            self.note(path, f"not an integer: {raw[:40]!r}")
            return None

    def glob(self, rel: str, pattern: str) -> list[Path]:
        """Sorted entries of ``root/rel`` matching ``pattern``; [] when missing."""
        base = self.root / rel
        try:
            return sorted(base.glob(pattern))
        except OSError:
            return []


def _link_name(path: Path) -> str | None:
    """Last component of a symlink's target (``device -> ../../nvme0`` gives nvme0)."""
    try:
        return PurePosixPath(os.readlink(path)).name or None
    except OSError:
        return None


def _link_target(path: Path) -> str:
    """A symlink's target text, '' when ``path`` is not a symlink."""
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _read_hwmon(r: _Reader) -> tuple[dict[str, float] | None, dict[str, float] | None]:
    """(NVMe composite temperature by device, every other temperature by 'name/label')."""
    dirs = r.glob("sys/class/hwmon", "hwmon*")
    if not dirs:
        return None, None
    nvme: dict[str, float] = {}
    temps: dict[str, float] = {}
    for hw in dirs:
        name = r.text(hw / "name")
        if name is None:
            continue
        device = _link_name(hw / "device") or hw.name
        readings: list[tuple[int, str, float]] = []
        for inp in sorted(hw.glob("temp*_input")):
            idx = inp.name[len("temp"):-len("_input")]
            milli = r.integer(inp)
            if milli is None or not idx.isdigit():
                continue
            celsius = milli / 1000.0
            if not _TEMP_RANGE_C[0] <= celsius <= _TEMP_RANGE_C[1]:
                r.note(inp, f"implausible temperature {celsius:g}C")
                continue
            label = r.text(hw / f"temp{idx}_label") or f"temp{idx}"
            readings.append((int(idx), label, celsius))
        readings.sort()
        composite = None
        if name == "nvme" and readings:
            # The Composite sensor is what SMART reports and what the drive's own
            # warning threshold applies to; the others are extra detail.
            labelled = [x for x in readings if x[1] == "Composite"]
            composite = (labelled or readings)[0]
            nvme[device] = composite[2]
        for reading in readings:
            if reading is composite:
                continue
            prefix = device if name == "nvme" else name
            key = f"{prefix}/{reading[1]}"
            if key in temps:  # two coretemp chips, say: tell them apart
                key = f"{prefix}@{hw.name}/{reading[1]}"
            temps[key] = reading[2]
    return nvme, temps


def _read_snmp_tcp(r: _Reader) -> dict[str, int] | None:
    """RetransSegs and OutSegs from ``/proc/net/snmp`` (cumulative)."""
    path = r.root / "proc/net/snmp"
    raw = r.text(path)
    if raw is None:
        return None
    rows = [line.split() for line in raw.splitlines() if line.startswith("Tcp:")]
    if len(rows) < 2:
        r.note(path, "no Tcp: header and value lines")
        return None
    header, values = rows[0][1:], rows[1][1:]
    if len(header) != len(values):
        r.note(path, f"Tcp: {len(header)} names but {len(values)} values")
        return None
    table = dict(zip(header, values, strict=True))
    out: dict[str, int] = {}
    for key in ("RetransSegs", "OutSegs"):
        try:
            out[key] = int(table[key])
        except (KeyError, ValueError):
            r.note(path, f"Tcp: {key} missing or not an integer")
            return None
    return out


def _read_nics(r: _Reader) -> dict[str, int] | None:
    """Cumulative ``nic.<iface>.rx_errors`` / ``tx_errors`` counters (lo excluded)."""
    ifaces = r.glob("sys/class/net", "*")
    if not ifaces:
        return None
    out: dict[str, int] = {}
    for iface in ifaces:
        if iface.name == "lo":
            continue
        for stat in ("rx_errors", "tx_errors"):
            value = r.integer(iface / "statistics" / stat)
            if value is not None:
                out[f"nic.{iface.name}.{stat}"] = value
    return out


def _read_edac(r: _Reader) -> dict[str, int] | None:
    """Cumulative ``edac.<mc>.ce_count`` counters."""
    mcs = r.glob("sys/devices/system/edac/mc", "mc*")
    if not mcs:
        return None
    out: dict[str, int] = {}
    for mc in mcs:
        value = r.integer(mc / "ce_count")
        if value is not None:
            out[f"edac.{mc.name}.ce_count"] = value
    return out


def _speed(r: _Reader, path: Path) -> tuple[bool, float | None]:
    """(present, GT/s) from '8.0 GT/s PCIe'; 'Unknown' (link down) is (True, None)."""
    raw = r.text(path)
    if raw is None:
        return False, None
    if raw.lower().startswith("unknown"):
        return True, None
    try:
        return True, float(raw.split()[0])
    except (ValueError, IndexError):
        r.note(path, f"not a link speed: {raw[:40]!r}")
        return True, None


def _read_pcie(r: _Reader) -> tuple[list[PcieLink], list[str]] | None:
    """(links below their maximum, addresses of every PCIe device with a link)."""
    devs = r.glob("sys/bus/pci/devices", "*")
    if not devs:
        return None
    degraded: list[PcieLink] = []
    present: list[str] = []
    for dev in devs:
        # SR-IOV virtual functions come and go with reconfiguration and carry no link.
        if (dev / "physfn").exists() or not (dev / "max_link_width").exists():
            continue
        max_width = r.integer(dev / "max_link_width")
        width = r.integer(dev / "current_link_width")
        _, max_speed = _speed(r, dev / "max_link_speed")
        has_speed, speed = _speed(r, dev / "current_link_speed")
        if max_width is None or width is None:
            continue
        present.append(dev.name)
        slow = (max_speed is not None and has_speed
                and (speed is None or speed < max_speed))
        if width < max_width or slow:
            degraded.append(PcieLink(dev.name, speed, max_speed, width, max_width))
    return degraded, present


def _inventory(r: _Reader, pcie: list[str] | None) -> list[str]:
    """Physical devices whose disappearance means hardware trouble."""
    out = [f"pci:{a}" for a in pcie or ()]
    out += [f"nvme:{p.name}" for p in r.glob("sys/class/nvme", "nvme*")]
    for p in r.glob("sys/class/net", "*"):
        # Virtual interfaces (veth, bridges, VF netdevs) appear and vanish by design.
        if (p / "device").exists() and not (p / "device" / "physfn").exists():
            out.append(f"net:{p.name}")
    for p in r.glob("sys/block", "*"):
        target = _link_target(p)
        if "/virtual/" in target or "/usb" in target:
            continue
        out.append(f"block:{p.name}")
    return sorted(out)


def _deltas(counters: Mapping[str, int], previous: ProbeSample | None) -> dict[str, int]:
    """Per-interval counts; a counter that went backwards was reset (reboot, driver
    reload) and counts from zero; a counter the previous sample lacked is left out."""
    if previous is None:
        return dict(counters)
    out: dict[str, int] = {}
    for key, value in counters.items():
        before = previous.counters.get(key)
        if before is None:
            continue
        out[key] = value - before if value >= before else value
    return out


def _group(deltas: Mapping[str, int], prefix: str) -> dict[str, int]:
    """Sum ``prefix.<name>.<stat>`` counters per name."""
    out: dict[str, int] = {}
    for key, value in deltas.items():
        if key.startswith(prefix):
            name = key[len(prefix):].rsplit(".", 1)[0]
            out[name] = out.get(name, 0) + value
    return out


def tree_bytes(path: Path) -> int:
    """Bytes the files under ``path`` take on disk (allocated blocks; links not
    followed; entries gone meanwhile skipped)."""
    total, stack = 0, [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def collect(root: Path = Path("/"), ckpt_dir: Path | None = None,
            previous: ProbeSample | None = None, *, now: float | None = None,
            host: HostStats | None = None, removed_events: Iterable[str] = ()) -> ProbeSample:
    """One sample of this node's health; never raises for missing or odd files.

    ``now`` defaults to ``time.time()`` (wall clock: samples are compared across nodes).
    ``host`` defaults to psutil, with CPU and memory only when ``root`` is ``/``.
    ``removed_events`` are device removals seen since ``previous`` (from
    :meth:`UdevWatcher.drain`), added to those the inventory comparison finds.
    """
    at = time.time() if now is None else now
    r = _Reader(root)
    host = host if host is not None else PsutilHost(cpu_mem=root == Path("/"))
    interval = None
    if previous is not None:
        interval = at - previous.at
        if interval <= 0:
            r.problems.append(f"previous sample is not older ({interval:g}s): no deltas")
            interval, previous = None, None

    disk = host.disk_usage(ckpt_dir) if ckpt_dir is not None else None
    disk_pct = raps_pct = root_free = raps = None
    if disk is not None and ckpt_dir is not None:
        # What RAPS needs, which no user can steer: its own data against the room left
        # for root (the agent; reserved blocks are not the users'). Another user filling
        # a file system the checkpoint dir shares takes only the room users may have.
        # A project quota on the checkpoint dir is what statfs reports for it.
        root_free, raps = max(0, disk[0] - disk[1]), tree_bytes(ckpt_dir)
        if raps + root_free > 0:
            disk_pct = round(100.0 * raps / (raps + root_free), 2)
        if disk[0] > 0:
            raps_pct = round(100.0 * min(raps, disk[0]) / disk[0], 2)

    nvme, temps = _read_hwmon(r)
    tcp, nics, edac = _read_snmp_tcp(r), _read_nics(r), _read_edac(r)
    counters = {f"tcp.{k}": v for k, v in (tcp or {}).items()}
    counters.update(nics or {})
    counters.update(edac or {})
    deltas = _deltas(counters, previous)

    retrans, out_segs, ratio = deltas.get("tcp.RetransSegs"), deltas.get("tcp.OutSegs"), None
    if retrans is not None and out_segs is not None and out_segs > 0:
        ratio = round(retrans / out_segs, 6)

    pcie = _read_pcie(r)
    devices = _inventory(r, pcie[1] if pcie else None)
    gone = set(removed_events)
    if previous is not None and previous.devices is not None:
        gone |= set(previous.devices) - set(devices)

    return ProbeSample(
        at=at, interval_sec=interval,
        cpu_percent=_finite(host.cpu_percent()), mem_used_percent=_finite(host.mem_used_percent()),
        disk_path=str(ckpt_dir) if disk is not None else None,
        disk_total_bytes=disk[0] if disk else None, disk_free_bytes=root_free,
        disk_raps_bytes=raps, disk_used_percent=disk_pct, disk_raps_percent=raps_pct,
        nvme_temps_c=nvme, temps_c=temps,
        tcp_retrans_segs=retrans, tcp_out_segs=out_segs, tcp_retransmit_ratio=ratio,
        nic_errors=_group(deltas, "nic.") if nics is not None else None,
        edac_ce=_group(deltas, "edac.") if edac is not None else None,
        pcie_degraded=tuple(pcie[0]) if pcie else None,
        devices=tuple(devices), removed=tuple(sorted(gone)),
        problems=tuple(r.problems), counters=counters)


def _finite(value: float | None) -> float | None:
    """``value`` unless it is NaN or infinite (JSON cannot carry those)."""
    return value if value is not None and math.isfinite(value) else None


class UdevWatcher:
    """Device removal events (nvme, block, net, pci) from udev, kept until drained.

    Works when pyudev imports and udevd runs (``<root>/run/udev/control`` exists);
    otherwise :attr:`available` is False and :meth:`drain` always returns []. Events are
    ``"<subsystem>:<sys_name>"`` strings, the names :attr:`ProbeSample.devices` uses.
    Virtual and USB devices are ignored: they come and go by design.
    """

    def __init__(self, root: Path = Path("/"),
                 subsystems: Iterable[str] = UDEV_SUBSYSTEMS) -> None:
        self.root = root
        self.subsystems = tuple(subsystems)
        self.available = False
        self._events: list[str] = []
        self._lock = threading.Lock()
        self._observer: Any = None

    def start(self) -> bool:
        """Start watching in a daemon thread; returns :attr:`available`."""
        if self._observer is not None:
            return True
        if not (self.root / "run/udev/control").exists():
            return False
        try:
            # Imported by name: pyudev is optional and ships no type information.
            pyudev: Any = importlib.import_module("pyudev")
        except ImportError:
            return False
        try:
            monitor = pyudev.Monitor.from_netlink(pyudev.Context())
            for subsystem in self.subsystems:
                monitor.filter_by(subsystem=subsystem)
            observer = pyudev.MonitorObserver(monitor, callback=self.on_event,
                                              name="raps-udev")
            observer.start()
        except (OSError, ValueError) as exc:
            log.warning("udev watcher not started: %s", exc)
            return False
        self._observer = observer
        self.available = True
        return True

    def on_event(self, device: Any) -> None:
        """pyudev callback (observer thread): keep removals of physical devices."""
        try:
            if getattr(device, "action", None) != "remove":
                return
            subsystem = str(getattr(device, "subsystem", "") or "")
            name = str(getattr(device, "sys_name", "") or "")
            path = str(getattr(device, "device_path", "") or "")
            if (subsystem not in self.subsystems or not name or "/virtual/" in path
                    or "/usb" in path or getattr(device, "device_type", None) == "partition"):
                return
        except Exception:  # a bad event must never kill the observer thread
            log.exception("udev event ignored")
            return
        with self._lock:
            if len(self._events) < _MAX_PENDING_EVENTS:
                self._events.append(f"{subsystem}:{name}")

    def drain(self) -> list[str]:
        """Removal events since the previous drain (thread-safe)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def stop(self) -> None:
        """Stop the observer thread (idempotent)."""
        observer, self._observer = self._observer, None
        self.available = False
        if observer is not None:
            observer.stop()
