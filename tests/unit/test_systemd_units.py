"""The systemd units (slurm/systemd/) and the agent's sd_notify side of Type=notify."""

from __future__ import annotations

import configparser
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import sdnotify

from raps_slurm.agent.main import Watchdog

REPO = Path(__file__).resolve().parents[2]
UNITS = sorted((REPO / "slurm" / "systemd").glob("*.service"))


def _unit(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read(path)
    return parser


def test_both_daemons_have_a_unit() -> None:
    assert [u.name for u in UNITS] == ["raps-agent.service", "raps-coordinator.service"]


def _need_analyze() -> None:
    # scripts/test.sh installs it (Debian package systemd): missing fails, never skips
    assert shutil.which("systemd-analyze"), "systemd-analyze not installed: run scripts/test.sh"


def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    """`systemd-analyze verify` exits 0 and prints nothing (it only warns, exit 0, about
    a bad Type= or WatchdogSec=, so silence is the check). ExecStart must name an
    executable: the copies point at this interpreter's console scripts."""
    _need_analyze()
    for unit in UNITS:
        text = unit.read_text().replace("/opt/raps/venv/bin/", f"{Path(sys.executable).parent}/")
        (tmp_path / unit.name).write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", "--man=no",
                          *[str(tmp_path / u.name) for u in UNITS]],
                         capture_output=True, text=True, check=False, cwd=tmp_path)
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), out


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: a typo in the agent unit is reported."""
    _need_analyze()
    bad = tmp_path / "raps-agent.service"
    bad.write_text((REPO / "slurm/systemd/raps-agent.service").read_text()
                   .replace("/opt/raps/venv/bin/", f"{Path(sys.executable).parent}/")
                   .replace("WatchdogSec=60", "WatchdogSec=sixty"))
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(bad)],
                         capture_output=True, text=True, check=False, cwd=tmp_path)
    assert "WatchdogSec" in out.stderr or "sec value" in out.stderr, out


def test_agent_unit_is_notify_with_watchdog_hardening_and_before_slurmd() -> None:
    agent = _unit(REPO / "slurm/systemd/raps-agent.service")
    coord = _unit(REPO / "slurm/systemd/raps-coordinator.service")
    svc = agent["Service"]
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    # WATCHDOG=1 comes every WATCHDOG_EVERY_SEC: the unit must allow several misses.
    from raps_slurm.agent.main import WATCHDOG_EVERY_SEC
    assert int(svc["WatchdogSec"]) >= 4 * WATCHDOG_EVERY_SEC
    for hardening in ("ProtectSystem", "ProtectHome", "PrivateTmp", "NoNewPrivileges"):
        assert svc[hardening] == coord["Service"][hardening], hardening
    assert "slurmd.service" in agent["Unit"]["Before"].split()
    # ProtectSystem=strict: the socket and checkpoint dirs must be writable ones.
    assert svc["RuntimeDirectory"] == "raps" and svc["StateDirectory"] == "raps"
    assert "--node ${RAPS_NODE}" in svc["ExecStart"]


def test_agent_runs_above_the_jobs_cpu_priority() -> None:
    """A busy node must not starve the agent's heartbeats (docs/detection.md): a CPU weight
    above the default 100 the jobs' cgroups get, and a negative nice value."""
    svc = _unit(REPO / "slurm/systemd/raps-agent.service")["Service"]
    assert int(svc["CPUWeight"]) > 100 and int(svc["Nice"]) < 0


def _listen(tmp_path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(2)
    return sock


def test_watchdog_sends_ready_then_throttled_pings(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a real $NOTIFY_SOCKET, as systemd gives it: READY=1 first, then WATCHDOG=1 at
    most once per period however often the loop turns."""
    sock = _listen(tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    now = [100.0]
    dog = Watchdog(sdnotify.SystemdNotifier(), every=5.0, monotonic=lambda: now[0])
    dog.ready("agent of n1: socket /run/raps/n1/agent.sock")
    assert sock.recv(512).decode().startswith("READY=1\nSTATUS=agent of n1")
    sock.setblocking(False)
    for _ in range(40):           # 4 s of loop turns: no ping yet
        now[0] += 0.1
        dog.tick()
    with pytest.raises(BlockingIOError):
        sock.recv(512)
    pings = 0
    for _ in range(110):          # 11 s more: two pings (at 5 s and 10 s)
        now[0] += 0.1
        dog.tick()
        try:
            assert sock.recv(512) == b"WATCHDOG=1"
            pings += 1
        except BlockingIOError:
            pass
    assert pings == 2
    sock.close()

