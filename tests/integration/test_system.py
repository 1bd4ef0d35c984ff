"""System level on the real cluster: failures in one rack raise its nodes' Slurm weights,
new jobs go to other racks, `scontrol reconfigure` does not lose the weights for longer
than a reconcile pass, and an admin's weight is left alone."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from raps_slurm.core.history import FailureEvent
from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import CoordinatorProcess, LocalCluster, wait_until

if TYPE_CHECKING:  # the fixture's type; conftest is not importable at run time
    from conftest import Rapsctl

RECONCILE_SEC = 1.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def weighing(cluster: LocalCluster, rapsctl: Rapsctl, store: tuple[StateStore, Keys],
             tmp_path: Path) -> Iterator[CoordinatorProcess]:
    """A leader with node weights on (the test profile leaves them off so that other tests'
    crashes do not steer their jobs), from a clean history; everything undone after."""
    s, keys = store
    s.delete_prefix(keys.history_prefix())
    s.delete_prefix(keys.weights_prefix())
    cfg = yaml.safe_load(cluster.config_path.read_text())
    cfg["system"] = {"weight_step": 100, "weight_levels": 10, "history_window_h": 1.0,
                     "score_half_life_h": 1.0, "weight_reconcile_sec": RECONCILE_SEC,
                     "boost_extra_replicas": 1}
    path = tmp_path / "raps-weights.yaml"
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o644)
    c = cluster.coordinator("weights", config=path).start()
    try:
        wait_until("the weights coordinator to lead", lambda: rapsctl("ping", check=False).stdout,
                   lambda out: "leader weights " in out, timeout=20)
        yield c
    finally:
        c.stop()
        s.delete_prefix(keys.history_prefix())
        s.delete_prefix(keys.weights_prefix())
        runner = CommandRunner(timeout=30, env=cluster.env)
        runner.run(["scontrol", "update", f"NodeName={','.join(cluster.node_names)}", "Weight=1"])


def weights(cluster: LocalCluster) -> dict[str, int]:
    return {n.name: n.weight for n in cluster.slurm().nodes()}


def history_count(store: tuple[StateStore, Keys], node: str) -> int:
    s, keys = store
    return sum(1 for kv in s.get_prefix(keys.history_prefix())
               if keys.split(kv.key)[1] == node and json.loads(kv.value)["kind"] == "DEAD")


def crash_and_return(cluster: LocalCluster, store: tuple[StateStore, Keys], node: str) -> None:
    before = history_count(store, node)
    cluster.crash(node)
    try:
        wait_until(f"a DEAD verdict for {node} in the history",
                   lambda: history_count(store, node), lambda n: n > before, timeout=20)
    finally:
        cluster.restart(node)
        wait_until(f"{node} drained by raps", lambda: cluster.slurm().node(node),
                   lambda n: n.reason.startswith("raps: dead"), timeout=20)
        CommandRunner(timeout=30, env=cluster.env).run(
            ["scontrol", "update", f"NodeName={node}", "State=RESUME"])


def test_failures_in_one_rack_raise_its_weights(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Rapsctl,
        weighing: CoordinatorProcess) -> None:
    racks = cluster.slurm().topology().racks()
    flaky = next(r for r, nodes in racks.items() if "n1" in nodes)
    flaky_nodes = set(racks[flaky])
    runner = CommandRunner(timeout=30, env=cluster.env)
    admin_node = "n5" if "n5" not in flaky_nodes else "n3"
    runner.run(["scontrol", "update", f"NodeName={admin_node}", "Weight=5"])  # an admin's

    victims = sorted(flaky_nodes)
    for node in (victims[0], victims[-1], victims[0]):
        crash_and_return(cluster, store, node)

    got = wait_until(f"higher weights on rack {flaky}", lambda: weights(cluster),
                     lambda w: all(w[n] > 1 for n in flaky_nodes), timeout=15)
    assert all(got[n] == 1 for n in got if n not in flaky_nodes and n != admin_node), got
    assert got[admin_node] == 5
    rows = {r["domain"]: r for r in json.loads(rapsctl("show", "racks", "--json").stdout)}
    assert rows[flaky]["dead"] == 3 and rows[flaky]["score"] < 0.5, rows[flaky]
    assert all(f"{n}=" in rows[flaky]["weights"] for n in flaky_nodes), rows[flaky]
    assert all(rows[r]["score"] == 1.0 for r in rows if r != flaky and rows[r]["kind"] == "rack")

    # A new job goes where the weights are lowest: not the flaky rack.
    out = subprocess.run(["srun", "-N1", "-n1", "--time=1", "printenv", "SLURMD_NODENAME"],
                         env={**os.environ, **cluster.env}, capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    assert out and out not in flaky_nodes, out

    # scontrol reconfigure puts slurm.conf's weights back; the leader re-applies its own
    # within a pass, and only its own.
    runner.run(["scontrol", "reconfigure"])
    wait_until("the leader to see the reset", weighing.log,
               lambda t: "reset (reconfigure or restart)" in t, timeout=RECONCILE_SEC + 10)
    after = wait_until("the flaky rack's weights back, as the leader recorded them",
                       lambda: (weights(cluster), applied(store)),
                       lambda wa: all(wa[0][n] == wa[1].get(n) and wa[0][n] > 1
                                      for n in flaky_nodes), timeout=RECONCILE_SEC + 10)[0]
    # Slurm's own reset reached the admin's weight too; the leader never set it.
    assert after[admin_node] in (1, 5)
    assert f"weights: {admin_node}" not in weighing.log()
    assert admin_node not in applied(store)


def applied(store: tuple[StateStore, Keys]) -> dict[str, int]:
    s, keys = store
    return {keys.split(kv.key)[1]: json.loads(kv.value)["applied"]
            for kv in s.get_prefix(keys.weights_prefix())}


def test_show_status_reports_etcd_size_and_records(
        cluster: LocalCluster, rapsctl: Rapsctl, weighing: CoordinatorProcess) -> None:
    out = wait_until("every agent registered in show status",
                     lambda: json.loads(rapsctl("show", "status", "--json").stdout),
                     lambda o: o["nodes_registered"] == len(cluster.node_names), timeout=20)
    assert out["leader"] == "weights" and out["alarms"] == []
    assert out["db_size_bytes"] >= out["db_in_use_bytes"] > 0
    assert 0 < out["quota_used"] < 0.8 and out["etcd_version"].startswith("3.")
    text = rapsctl("show", "status").stdout
    assert "MiB quota" in text and "coordinator leader: weights" in text


HEAT = ["--steps", "2400", "--every", "20", "--step-sec", "0.05"]  # two minutes at most


def test_a_failing_racks_ranks_get_a_third_copy_until_it_heals(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Rapsctl,
        weighing: CoordinatorProcess) -> None:
    s, keys = store
    run = CommandRunner(timeout=60, env=cluster.env)
    job, _ = cluster.submit_raps_run(
        [sys.executable, str(REPO / "examples" / "heat_ring.py"), *HEAT],
        ["-N6", "--raps-spares=2"], "boost")
    injected: list[str] = []
    try:
        data = wait_until(f"job {job} mapped", lambda: rapsctl.job(int(job)),
                          lambda d: d is not None and d["state"] == "mapped", 60)
        rank = data["ranks"][0]
        racks = cluster.slurm().topology().racks()
        rack_of = {n: r for r, nodes in racks.items() for n in nodes}
        flaky = rack_of[rank["node"]]
        wait_until(f"a committed checkpoint of rank {rank['rank']}",
                   lambda: newest(store, job, rank["rank"]),
                   lambda rec: rec is not None and rec["state"] == "committed", 60)
        # Two failures injected into the rack's history: score 1/3, below 0.5.
        for i, node in enumerate(sorted(racks[flaky])):
            e = FailureEvent("DEAD", node, time.time() - i, "injected by the test")
            key = keys.history_event(node, e.event_id())
            s.put(key, e.to_json())
            injected.append(key)
        rows = wait_until("an extra mirror for the flaky rack's ranks",
                          lambda: groups(rapsctl, job),
                          lambda g: len(g[rank["rank"]]["ckpt_mirrors"]) == 2, 20)
        g = rows[rank["rank"]]
        extra = g["ckpt_mirrors"][-1]
        assert rack_of[extra] != flaky and extra not in (g["primary"], g["log_backup"],
                                                         g["ckpt_mirrors"][0]), g
        for row in rows.values():  # ranks of healthy racks keep two copies
            if rack_of[row["primary"]] != flaky:
                assert len(row["ckpt_mirrors"]) == 1, rows
        # The agents copy the newest generation to it.
        wait_until(f"a generation held on {extra}", lambda: newest(store, job, rank["rank"]),
                   lambda rec: rec is not None and extra in rec["holders"], 30)
        # The rack heals (its failures leave the window): the copy goes.
        for key in injected:
            s.delete(key)
        wait_until("the extra mirror dropped", lambda: groups(rapsctl, job),
                   lambda g: len(g[rank["rank"]]["ckpt_mirrors"]) == 1, 20)
        # the leader logs a change after committing it: the groups can show it first
        wait_until("the leader to log the dropped mirror", weighing.log,
                   lambda t: "extra mirror dropped" in t, 10)
    finally:
        for key in injected:
            s.delete(key)
        with contextlib.suppress(SlurmCommandError):
            run.run(["scancel", job])


def groups(rapsctl: Rapsctl, job: str) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r for r in json.loads(rapsctl("show", "groups", job, "--json").stdout)}


def newest(store: tuple[StateStore, Keys], job: str, rank: int) -> dict[str, Any] | None:
    s, keys = store
    recs = [json.loads(kv.value) for kv in s.get_prefix(keys.ckpt_prefix(job, rank))]
    return max(recs, key=lambda r: r["generation"]) if recs else None
