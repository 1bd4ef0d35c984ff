"""An agent restarted within a second, as systemd would, gives no verdict (detection at the
production defaults: 1 s heartbeats, 3 strikes, 0.5 s fence margin)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import CoordinatorProcess, LocalCluster, wait_until


@pytest.fixture(scope="module")
def default_detection(cluster: LocalCluster) -> Path:
    """The cluster's config with detection at the production defaults."""
    data = yaml.safe_load(cluster.config_path.read_text())
    data["detection"].update({"kernel_heartbeat_interval_sec": 1.0, "miss_threshold": 3,
                              "fence_margin_sec": 0.5, "lease_duration_sec": 15.0})
    path = cluster.run_dir / "etc" / "raps-default-detection.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def leader(cluster: LocalCluster, default_detection: Path,
           store: tuple[StateStore, Keys]) -> Iterator[CoordinatorProcess]:
    s, keys = store
    c = cluster.coordinator("restart", default_detection).start()
    try:
        wait_until("coordinator 'restart' to lead", lambda: s.get(keys.leader()),
                   lambda kv: kv is not None and b'"restart"' in kv.value, timeout=20)
        yield c
    finally:
        c.stop()


def test_agent_restarted_within_a_second_gives_no_verdict(
        cluster: LocalCluster, leader: CoordinatorProcess, store: tuple[StateStore, Keys]) -> None:
    s, keys = store
    node = "n1"
    grace = 1.0 * 3 + 0.5
    wait_until("the leader's grace", time.monotonic,
               lambda t: t - leader.started > grace + 1, timeout=grace + 10)
    start = s.current_revision()
    pid = int((cluster.run_dir / "pids" / f"agent-{node}.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(f"agent pid {pid} gone", lambda: Path(f"/proc/{pid}").exists(),
               lambda alive: not alive, timeout=5, interval=0.01)
    cluster.agent_start(node)
    wait_until(f"{node}'s new agent registered", lambda: s.get(keys.node(node)),
               lambda kv: kv is not None and kv.mod_revision > start, timeout=10)
    print(f"agent back in {time.monotonic() - killed:.2f}s")
    end = time.monotonic() + 2 * (grace + 1.0)  # long enough for any verdict
    wait_until("the detection window to pass", time.monotonic, lambda t: t >= end,
               timeout=2 * grace + 10)
    kv = s.get(keys.node_verdict(node))
    assert kv is None or kv.mod_revision <= start, json.loads(kv.value)
