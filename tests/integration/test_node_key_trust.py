"""Per-node heartbeat keys on the real cluster (issue 21, item 3). Every fake node's agent
signs with its own key ($RUN/etc/nodekeys/nI.key, detection.node_key_file); the
coordinator holds the cluster key and derives them.

(a) one datagram for node A with incarnation and counter 2**64-1, correctly signed with node
    B's key or with the cluster key itself, used to make A DEAD within a second and keep it
    so until the coordinator restarted: now it is refused ("signature"), and so is the same
    datagram signed with A's own key ("future"); A is never declared DEAD.
(b) an agent restarted after its clock stepped back (a smaller incarnation) is heard again:
    the node, DEAD while its agent was down, is ALIVE within the lease + a margin.
Fault traffic goes to 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from raps_slurm.config import load_file
from raps_slurm.coordinator.election import read_leader
from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import CoordinatorProcess, LocalCluster, wait_until
from raps_slurm.testing.etcd import free_port
from raps_slurm.wire.heartbeat import Heartbeat, encode, load_key

U64 = (1 << 64) - 1
RECEIVERS = 3  # the forgets must reach the receiver processes too


def heartbeat_counts(port: int) -> Counter[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return Counter({s.labels["result"]: int(s.value)
                    for fam in text_string_to_metric_families(text.decode())
                    for s in fam.samples if s.name == "raps_coordinator_heartbeats_total"})


@pytest.fixture(scope="module")
def leader(cluster: LocalCluster, store: tuple[StateStore, Keys]
           ) -> Iterator[tuple[CoordinatorProcess, int, dict[str, Any]]]:
    """A coordinator with a metrics port and RECEIVERS receivers, leading."""
    s, keys = store
    port = free_port()
    c = cluster.coordinator("nodekeys").start(metrics_address=f"127.0.0.1:{port}",
                                              receivers=RECEIVERS)
    try:
        value = wait_until("nodekeys to lead", lambda: read_leader(s, keys.leader()),
                           lambda v: v is not None and v.get("name") == "nodekeys", 20)
        assert value is not None
        yield c, port, value
    finally:
        assert c.stop() == 0, c.log()[-2000:]


def dead_since(store: tuple[StateStore, Keys], node: str, revision: int) -> dict[str, Any] | None:
    """``node``'s DEAD verdict if one was written after ``revision``."""
    s, keys = store
    kv = s.get(keys.node_verdict(node))
    if kv is None or kv.mod_revision <= revision:
        return None
    v = dict(json.loads(kv.value))
    return v if v["kind"] == "DEAD" else None


def wait_grace(cluster: LocalCluster, c: CoordinatorProcess) -> float:
    """Wait until the leader may give DEAD verdicts; returns miss window + fence margin."""
    d = load_file(cluster.config_path).detection
    grace = d.kernel_heartbeat_interval_sec * d.miss_threshold + d.fence_margin_sec
    wait_until("the leader's grace to pass", lambda: time.monotonic() - c.started,
               lambda age: age > grace + 2, timeout=grace + 20)
    return grace


def test_a_heartbeat_forged_for_another_node_is_refused_and_the_node_stays_alive(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leader: tuple[CoordinatorProcess, int, dict[str, Any]]) -> None:
    c, port, value = leader
    s, _ = store
    grace = wait_grace(cluster, c)
    victim, forger = "n2", "n3"
    etc = cluster.run_dir / "etc"
    forger_key = load_key(str(etc / "nodekeys" / f"{forger}.key"), node=forger)
    victim_key = load_key(str(etc / "nodekeys" / f"{victim}.key"), node=victim)
    cluster_key = load_key(str(etc / "raps.key"))
    _, _, hb_port = str(value["heartbeat"]).rpartition(":")
    target = ("127.0.0.1", int(hb_port))
    start = s.current_revision()
    before = heartbeat_counts(port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for key in (forger_key, cluster_key):  # another node's key, and the root key itself
            sock.sendto(encode(Heartbeat(victim, U64, U64, time.time()), key), target)
        sock.sendto(encode(Heartbeat(victim, U64, U64, time.time()), victim_key), target)
    finally:
        sock.close()
    got = wait_until("the coordinator to count the refusals",
                     lambda: heartbeat_counts(port) - before,
                     lambda d: d["signature"] >= 2 and d["future"] >= 1, timeout=20)
    assert got["signature"] == 2 and got["future"] == 1, got
    # Before the fix the victim was DEAD within a second. Watch two miss windows + margins
    # (and the detection tick) for any verdict: there must be none, and heartbeats go on.
    accepted = heartbeat_counts(port)["accepted"]
    deadline = time.monotonic() + 2 * grace + 2
    while time.monotonic() < deadline:
        assert dead_since(store, victim, start) is None, "the forgery made the victim DEAD"
        time.sleep(0.1)
    assert heartbeat_counts(port)["accepted"] > accepted
    assert "Traceback" not in c.log()


def test_an_agent_restarted_with_its_clock_stepped_back_is_alive_again(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leader: tuple[CoordinatorProcess, int, dict[str, Any]]) -> None:
    c, _, _ = leader
    s, keys = store
    d = load_file(cluster.config_path).detection
    grace = wait_grace(cluster, c)
    node = "n4"
    first = json.loads(s.get(keys.node(node)).value)["incarnation"]  # type: ignore[union-attr]
    start = s.current_revision()
    cluster.agent_stop(node)
    try:
        wait_until(f"{node} DEAD with its agent stopped", lambda: dead_since(store, node, start),
                   lambda v: v is not None, timeout=grace + 15, interval=0.05)
        # An hour back: the new agent's incarnation is far below every one it sent before.
        cluster.agent_start(node, "--incarnation-offset", "3600")
        restarted = time.monotonic()
        reg = wait_until(f"{node} registered again",
                         lambda: s.get(keys.node(node)),
                         lambda kv: kv is not None
                         and json.loads(kv.value)["incarnation"] != first, timeout=30)
        assert reg is not None
        assert json.loads(reg.value)["incarnation"] < first - 3000 * 10**9
        bound = d.lease_duration_sec + grace + 5  # lease expiry + a margin (tick, loaded host)
        back = wait_until(f"{node} ALIVE again", lambda: s.get(keys.node_verdict(node)),
                          lambda kv: kv is not None and json.loads(kv.value)["kind"] == "ALIVE",
                          timeout=bound + 30, interval=0.05)
        assert back is not None
        took = time.monotonic() - restarted
        print(f"{node}: ALIVE {took:.2f}s after the restart with a smaller incarnation "
              f"(bound {bound:.1f}s)")
        assert took <= bound, took
    finally:
        if not agent_runs(cluster, node):  # the test failed before the restart
            cluster.agent_start(node)
        with contextlib.suppress(SlurmCommandError):  # not drained (yet): nothing to resume
            CommandRunner(timeout=30, env=cluster.env).run(
                ["scontrol", "update", f"NodeName={node}", "State=RESUME"])


def agent_runs(cluster: LocalCluster, node: str) -> bool:
    pidfile = cluster.run_dir / "pids" / f"agent-{node}.pid"
    try:
        os.kill(int(pidfile.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True
