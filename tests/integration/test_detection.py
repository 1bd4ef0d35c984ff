"""Failure detection on the real cluster: every fake node runs its raps-agent in its
cgroup; a coordinator leads; a node crash must give a DEAD verdict and a Slurm drain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from raps_slurm.config import load_file
from raps_slurm.core.planner import Plan, PlanEvent
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import CoordinatorProcess, LocalCluster, wait_until
from raps_slurm.testing.sysfs import make_tree

if TYPE_CHECKING:  # the fixture's type; conftest is not importable at run time
    from conftest import Rapsctl


RECEIVERS = 3


@pytest.fixture(scope="module")
def leader(leading: Callable[..., Any]) -> Iterator[CoordinatorProcess]:
    """One coordinator, leading before the first test of the module, with RECEIVERS
    heartbeat receiver processes (coordinator.heartbeat_receivers): the kernel spreads
    the agents over them, so these tests also hold when acks come from a receiver."""
    with leading("detect", receivers=RECEIVERS) as c:
        yield c


def verdict(store: tuple[StateStore, Keys], node: str) -> dict[str, Any] | None:
    s, keys = store
    kv = s.get(keys.node_verdict(node))
    return None if kv is None else dict(json.loads(kv.value))


def test_agents_register_every_node(cluster: LocalCluster,
                                    store: tuple[StateStore, Keys]) -> None:
    s, keys = store
    names = wait_until("all agents registered",
                       lambda: {keys.split(kv.key)[1] for kv in s.get_prefix(keys.nodes_prefix())
                                if len(keys.split(kv.key)) == 2},
                       lambda got: got == set(cluster.node_names), timeout=20)
    assert names == set(cluster.node_names)


def test_crashed_node_is_dead_within_the_bound_and_drained(
        cluster: LocalCluster, leader: CoordinatorProcess,
        store: tuple[StateStore, Keys]) -> None:
    d = load_file(cluster.config_path).detection
    bound = d.kernel_heartbeat_interval_sec * (d.miss_threshold + 1) + d.fence_margin_sec
    node = "n6"
    before = verdict(store, node)
    # A new leader gives no DEAD verdict within its first miss window + fence margin.
    grace = d.kernel_heartbeat_interval_sec * d.miss_threshold + d.fence_margin_sec
    wait_until("the leader's grace to pass", lambda: time.monotonic() - leader.started,
               lambda age: age > grace + 2, timeout=grace + 10)
    crashed = time.time()
    cluster.crash(node)
    try:
        got = wait_until(f"DEAD verdict for {node}", lambda: verdict(store, node),
                         lambda v: v is not None and v != before and v["kind"] == "DEAD",
                         timeout=bound + 10, interval=0.05)
        assert got is not None
        latency = got["at"] - crashed
        print(f"{node}: DEAD {latency:.2f}s after the crash (bound {bound:.2f}s); "
              f"evidence {got['evidence']}")
        assert latency <= bound + 0.25, got  # + one detection tick and the poll
        info = wait_until(f"{node} drained by raps", lambda: cluster.slurm().node(node),
                          lambda n: n.reason.startswith("raps: dead"), timeout=15)
        assert "DRAIN" in info.state_text.upper()
    finally:
        cluster.restart(node)
        CommandRunner(timeout=30, env=cluster.env).run(
            ["scontrol", "update", f"NodeName={node}", "State=RESUME"])
    back = wait_until(f"{node} ALIVE again", lambda: verdict(store, node),
                      lambda v: v is not None and v["kind"] == "ALIVE", timeout=30)
    assert back is not None


def dead_verdicts_since(store: tuple[StateStore, Keys], revision: int) -> list[dict[str, Any]]:
    """DEAD verdicts written after ``revision``."""
    s, keys = store
    out = []
    for kv in s.get_prefix(keys.nodes_prefix()):
        if kv.key.endswith("/verdict") and kv.mod_revision > revision:
            v = json.loads(kv.value)
            if v["kind"] == "DEAD":
                out.append(v)
    return out


def settle(cluster: LocalCluster) -> None:
    """Wait two miss windows + fence margin: long enough for any verdict to be reached."""
    d = load_file(cluster.config_path).detection
    wait_seconds(2 * (d.kernel_heartbeat_interval_sec * d.miss_threshold + d.fence_margin_sec))


def test_etcd_restart_gives_no_false_verdict(cluster: LocalCluster, leader: CoordinatorProcess,
                                             store: tuple[StateStore, Keys],
                                             rapsctl: Rapsctl) -> None:
    s, _ = store
    start = s.current_revision()
    cluster.etcd_stop()
    cluster.etcd_start()
    wait_until("the coordinator to lead again", lambda: rapsctl("ping", check=False).stdout,
               lambda out: "leader detect " in out, timeout=20)
    settle(cluster)
    assert dead_verdicts_since(store, start) == []


def test_leader_paused_twice_its_lease_gives_no_false_verdict(
        cluster: LocalCluster, leader: CoordinatorProcess, store: tuple[StateStore, Keys],
        rapsctl: Rapsctl) -> None:
    import signal
    s, _ = store
    lease = load_file(cluster.config_path).coordinator.leader_lease_sec
    standby = cluster.coordinator("detect-b").start(receivers=RECEIVERS)
    try:
        wait_until("the standby up", standby.log, lambda t: "standby: leader is detect" in t,
                   timeout=15)
        start = s.current_revision()
        leader.signal(signal.SIGSTOP)
        paused = time.monotonic()
        wait_until("the standby to lead", lambda: rapsctl("ping", check=False).stdout,
                   lambda out: "leader detect-b " in out, timeout=lease + 5)
        wait_until("two leases of pause", time.monotonic,
                   lambda t: t - paused >= 2 * lease, timeout=2 * lease + 5)
        leader.signal(signal.SIGCONT)
        wait_until("the old leader to step down", leader.log,
                   lambda t: "lost leadership" in t, timeout=10)
        settle(cluster)
        assert dead_verdicts_since(store, start) == []
        assert "leader detect-b " in rapsctl("ping").stdout
    finally:
        standby.stop()
    wait_until("the module's coordinator to lead again",
               lambda: rapsctl("ping", check=False).stdout,
               lambda out: "leader detect " in out, timeout=20)


def wait_seconds(seconds: float) -> None:
    """Let time pass (samples must be taken), polling the clock with a deadline."""
    end = time.monotonic() + seconds
    wait_until(f"{seconds}s to pass", time.monotonic, lambda t: t >= end, timeout=seconds + 5)


def health_tree(cluster: LocalCluster, node: str, temp: float) -> Path:
    root = cluster.run_dir / f"sysfs-{node}"
    make_tree(root, nvme_temp_c=temp)
    return root


def test_hot_nvme_drains_the_node_once_with_its_reason(
        cluster: LocalCluster, leader: CoordinatorProcess) -> None:
    d = load_file(cluster.config_path).detection
    node = "n5"
    root = health_tree(cluster, node, 72.0)
    cluster.agent_stop(node)
    cluster.agent_start(node, "--probe-root", str(root))
    run = CommandRunner(timeout=30, env=cluster.env)
    try:
        info = wait_until(f"{node} drained for its NVMe", lambda: cluster.slurm().node(node),
                          lambda n: n.reason.startswith("raps: nvme0 temp 72C > 70C"),
                          timeout=20 * d.telemetry_interval_sec + 10)
        assert "DRAIN" in info.state_text.upper()
        # Oscillating around the threshold after that: no second drain.
        run.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        for temp in (69.0, 71.0, 69.5, 70.5, 69.0, 71.0):
            make_tree(root, nvme_temp_c=temp)
            wait_seconds(d.telemetry_interval_sec)
        # (restarting the agent took longer than the test profile's 0.8 s window, so the
        # node may also have been drained as dead before: only NVMe drains count here)
        assert leader.log().count(f"drained {node} in Slurm: raps: nvme0") == 1, \
            leader.log()[-3000:]
        assert "DRAIN" not in cluster.slurm().node(node).state_text.upper()
    finally:
        cluster.agent_stop(node)
        cluster.agent_start(node)
        if "DRAIN" in cluster.slurm().node(node).state_text.upper():
            run.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])


def rapsctl_as(cluster: LocalCluster, user: str | None, *args: str
               ) -> subprocess.CompletedProcess[str]:
    """``rapsctl`` with the cluster's config, as ``user`` (runuser) or root (None)."""
    prefix = ["runuser", "-u", user, "--"] if user else []
    return subprocess.run([*prefix, sys.executable, "-m", "raps_slurm.cli", "--config",
                           str(cluster.config_path), *args], env={**os.environ, **cluster.env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_admin_drain_and_resume_need_root_or_slurmuser(cluster: LocalCluster) -> None:
    node = "n2"

    denied = rapsctl_as(cluster, "nobody", "drain", node, "--reason", "not mine")
    assert denied.returncode == 1
    assert denied.stderr.strip() == ("rapsctl: permission denied: 'drain' needs root or "
                                     "SlurmUser (slurm)")
    assert "DRAIN" not in cluster.slurm().node(node).state_text.upper()
    done = rapsctl_as(cluster, None, "drain", node, "--reason", "admin: swap fan")
    assert done.returncode == 0, done.stderr
    info = cluster.slurm().node(node)
    assert "DRAIN" in info.state_text.upper() and info.reason == "admin: swap fan"
    assert rapsctl_as(cluster, "slurm", "resume", node).returncode == 0  # SlurmUser may too
    assert "DRAIN" not in cluster.slurm().node(node).state_text.upper()
    audit = json.loads(rapsctl_as(cluster, None, "show", "audit", "--last", "2", "--json").stdout)
    assert [(a["who"], a["verb"], a["nodes"], a["reason"]) for a in audit] == \
        [("root", "drain", node, "admin: swap fan"), ("slurm", "resume", node, "")]


def test_cancel_plan_needs_root_or_slurmuser_and_is_audited(
        cluster: LocalCluster, store: tuple[StateStore, Keys]) -> None:
    s, keys = store
    plan = Plan("990001-2-2", "990001", 2, "n5", "n6", 2, "dead", 0, created_at=time.time())
    s.put(keys.plan(plan.plan_id), plan.to_json())

    try:
        denied = rapsctl_as(cluster, "nobody", "cancel-plan", plan.plan_id, "--reason", "mine now")
        assert (denied.returncode, denied.stderr.strip()) == (
            1, "rapsctl: permission denied: 'cancel-plan' needs root or SlurmUser (slurm)")
        assert s.get(keys.plan_cancel(plan.plan_id)) is None
        missing = rapsctl_as(cluster, None, "cancel-plan", "990001-9-9", "--reason", "x")
        assert missing.returncode == 1 and "no plan '990001-9-9'" in missing.stderr
        done = rapsctl_as(cluster, None, "cancel-plan", plan.plan_id, "--reason", "spare is flaky")
        assert done.returncode == 0, done.stderr
        kv = s.get(keys.plan_cancel(plan.plan_id))
        assert kv is not None
        event = PlanEvent.from_json(kv.key, kv.value)
        assert (event.detail["who"], event.detail["reason"]) == ("root", "spare is flaky")
        again = rapsctl_as(cluster, None, "cancel-plan", plan.plan_id, "--reason", "twice")
        assert again.returncode == 1 and "already cancelled" in again.stderr
        audit = json.loads(rapsctl_as(cluster, None, "show", "audit", "--last", "1", "--json").stdout)
        assert [(a["who"], a["verb"], a["plan"], a["reason"]) for a in audit] == [
            ("root", "cancel-plan", plan.plan_id, "spare is flaky")]
    finally:
        s.delete_prefix(keys.plan(plan.plan_id))


def test_update_node_weight_pins_it_for_root_only(
        cluster: LocalCluster, store: tuple[StateStore, Keys]) -> None:
    s, keys = store
    node = "n4"
    before = cluster.slurm().node(node).weight

    try:
        denied = rapsctl_as(cluster, "nobody", "update", "node", node, "weight=50")
        assert (denied.returncode, denied.stderr.strip()) == (
            1, "rapsctl: permission denied: 'update' needs root or SlurmUser (slurm)")
        bad = rapsctl_as(cluster, None, "update", "node", node, "weight=lots")
        assert bad.returncode == 2 and "expected weight=N (1-65533) or weight=auto" in bad.stderr
        done = rapsctl_as(cluster, None, "update", "node", node, "weight=50")
        assert done.returncode == 0, done.stderr
        assert cluster.slurm().node(node).weight == 50
        pin = s.get(keys.weight_pin(node))
        assert pin is not None and json.loads(pin.value)["who"] == "root"
        back = rapsctl_as(cluster, None, "update", "node", node, "weight=auto")
        assert back.returncode == 0 and s.get(keys.weight_pin(node)) is None
        audit = json.loads(rapsctl_as(cluster, None, "show", "audit", "--last", "2", "--json").stdout)
        assert [(a["verb"], a["nodes"], a["reason"]) for a in audit] == [
            ("update", node, "weight=50"), ("update", node, "weight=auto")]
    finally:
        s.delete(keys.weight_pin(node))
        CommandRunner(timeout=30, env=cluster.env).run(
            ["scontrol", "update", f"NodeName={node}", f"Weight={before}"])
