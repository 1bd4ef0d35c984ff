"""Ranks under detection on the real cluster: a fake rank (the minimal rank-side client)
registers with its node's agent and heartbeats through it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.config import load_file, node_dir
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import CoordinatorProcess, LocalCluster, wait_until


@pytest.fixture(scope="module")
def leader(leading: Callable[[str], Any]) -> Iterator[CoordinatorProcess]:
    with leading("ranks") as c:
        yield c


class FakeRank:
    """``python -m raps_slurm.runtime.agent_client`` on one node's agent socket."""

    def __init__(self, cluster: LocalCluster, node: str, rank: int, *,
                 blocked_on: int | None = None, in_node_cgroup: bool = False) -> None:
        cfg = load_file(cluster.config_path)
        self.job = str(800000 + uuid.uuid4().int % 100000)
        self.rank = rank
        args = [sys.executable, "-m", "raps_slurm.runtime.agent_client",
                "--socket", node_dir(cfg.agent.socket_path, node), "--job", self.job,
                "--rank", str(rank), "--interval",
                str(cfg.detection.app_heartbeat_interval_sec / 2)]
        if blocked_on is not None:
            args += ["--blocked-on", str(blocked_on)]
        self.log = cluster.run_dir / "log" / f"rank-{self.job}-{rank}.log"
        preexec = None
        if in_node_cgroup:
            procs = cluster.cgroup(node) / "cgroup.procs"

            def preexec() -> None:  # join the fake node before exec: freeze/crash take it too
                procs.write_text(str(os.getpid()))
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=preexec)

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.running():
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def ranks() -> Iterator[list[FakeRank]]:
    started: list[FakeRank] = []
    try:
        yield started
    finally:
        for r in started:
            r.stop()


def rank_verdict(store: tuple[StateStore, Keys], job: str, rank: int) -> dict[str, Any] | None:
    s, keys = store
    kv = s.get(keys.job_hung_verdict(job, rank))
    return None if kv is None else dict(json.loads(kv.value))


def node_verdict(store: tuple[StateStore, Keys], node: str) -> tuple[int, str]:
    s, keys = store
    kv = s.get(keys.node_verdict(node))
    return (0, "") if kv is None else (kv.mod_revision, json.loads(kv.value)["kind"])


def registered(cluster: LocalCluster, node: str, rank: FakeRank) -> None:
    wait_until(f"rank {rank.rank} of job {rank.job} registered with {node}'s agent",
               lambda: rank.log.read_text(errors="replace"),
               lambda t: "registered" in t, timeout=15)


def test_stopped_rank_is_hung_and_its_node_stays_alive(
        cluster: LocalCluster, leader: CoordinatorProcess, store: tuple[StateStore, Keys],
        ranks: list[FakeRank]) -> None:
    d = load_file(cluster.config_path).detection
    node = "n3"
    before = node_verdict(store, node)
    hung = FakeRank(cluster, node, 0)
    blocked = FakeRank(cluster, node, 1, blocked_on=0)
    ranks += [hung, blocked]
    registered(cluster, node, hung)
    registered(cluster, node, blocked)
    os.kill(hung.proc.pid, signal.SIGSTOP)
    window = d.app_heartbeat_interval_sec * d.app_miss_threshold
    v = wait_until("a HUNG verdict", lambda: rank_verdict(store, hung.job, 0),
                   lambda v: v is not None and v["kind"] == "HUNG", timeout=window + 10)
    assert v is not None and v["node"] == node
    assert node_verdict(store, node) == before  # the node itself: no verdict
    # The rank blocked on a peer heartbeats on (from its client thread): never HUNG.
    assert rank_verdict(store, blocked.job, 1) is None
    os.kill(hung.proc.pid, signal.SIGCONT)


def test_rank_exits_when_its_agent_is_killed(
        cluster: LocalCluster, leader: CoordinatorProcess, store: tuple[StateStore, Keys],
        ranks: list[FakeRank]) -> None:
    d = load_file(cluster.config_path).detection
    node = "n4"
    rank = FakeRank(cluster, node, 0)
    ranks.append(rank)
    registered(cluster, node, rank)
    before = node_verdict(store, node)[0]
    pid = int((cluster.run_dir / "pids" / f"agent-{node}.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    try:
        window = d.kernel_heartbeat_interval_sec * d.miss_threshold + d.fence_margin_sec
        wait_until("the rank to stop by itself", rank.running, lambda r: not r,
                   timeout=window + d.app_heartbeat_interval_sec + 5)
        assert rank.proc.returncode == 75, rank.log.read_text()
        assert "stops" in rank.log.read_text()
        wait_until(f"DEAD verdict for {node}", lambda: node_verdict(store, node),
                   lambda v: v[0] > before and v[1] == "DEAD", timeout=window + 10)
    finally:
        cluster.agent_stop(node)  # clears the stale pid file
        cluster.agent_start(node)
        wait_until(f"{node} ALIVE", lambda: node_verdict(store, node),
                   lambda v: v[1] == "ALIVE", timeout=20)
        CommandRunner(timeout=30, env=cluster.env).run(
            ["scontrol", "update", f"NodeName={node}", "State=RESUME"])


def test_frozen_node_is_dead_and_its_ranks_are_fenced_at_thaw(
        cluster: LocalCluster, leader: CoordinatorProcess, store: tuple[StateStore, Keys],
        ranks: list[FakeRank]) -> None:
    d = load_file(cluster.config_path).detection
    node = "n2"
    rank = FakeRank(cluster, node, 0, in_node_cgroup=True)
    ranks.append(rank)
    registered(cluster, node, rank)
    before = node_verdict(store, node)[0]
    cluster.freeze(node)
    try:
        window = d.kernel_heartbeat_interval_sec * d.miss_threshold + d.fence_margin_sec
        wait_until(f"DEAD verdict for {node}", lambda: node_verdict(store, node),
                   lambda v: v[0] > before and v[1] == "DEAD", timeout=window + 10)
        assert rank.running()  # frozen, not gone
    finally:
        cluster.thaw(node)
    thawed = time.monotonic()
    wait_until("the rank fenced after the thaw", rank.running, lambda r: not r, timeout=5,
               interval=0.05)
    print(f"rank gone {time.monotonic() - thawed:.2f}s after the thaw "
          f"(exit {rank.proc.returncode})")
    wait_until(f"{node} ALIVE", lambda: node_verdict(store, node), lambda v: v[1] == "ALIVE",
               timeout=20)
    CommandRunner(timeout=30, env=cluster.env).run(
        ["scontrol", "update", f"NodeName={node}", "State=RESUME"])
    assert Path(rank.log).exists()


def test_leader_paused_twice_its_lease_kills_no_rank(
        cluster: LocalCluster, leader: CoordinatorProcess, store: tuple[StateStore, Keys],
        ranks: list[FakeRank]) -> None:
    lease = load_file(cluster.config_path).coordinator.leader_lease_sec
    live = [FakeRank(cluster, node, 0) for node in ("n1", "n5", "n6")]
    ranks += live
    for r, node in zip(live, ("n1", "n5", "n6"), strict=True):
        registered(cluster, node, r)
    standby = cluster.coordinator("ranks-b").start()
    try:
        wait_until("the standby up", standby.log, lambda t: "standby: leader is ranks" in t,
                   timeout=15)
        leader.signal(signal.SIGSTOP)
        paused = time.monotonic()
        wait_until("two leases of pause", time.monotonic,
                   lambda t: t - paused >= 2 * lease, timeout=2 * lease + 5)
        leader.signal(signal.SIGCONT)
        wait_until("the old leader to step down", leader.log,
                   lambda t: "lost leadership" in t, timeout=10)
        assert [r.running() for r in live] == [True, True, True], [
            r.log.read_text() for r in live]
    finally:
        standby.stop()
