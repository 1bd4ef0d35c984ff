"""The foundation on the real local cluster: nodes, racks, backup groups, drain/resume, jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.config import load_file, parse_config
from raps_slurm.core import placement
from raps_slurm.errors import SlurmCommandError, StoreError
from raps_slurm.model import NodeState
from raps_slurm.slurm import CommandRunner, parsers
from raps_slurm.store import open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until


def test_nodes_racks_groups_drain_resume(cluster: LocalCluster) -> None:
    slurm = cluster.slurm()

    nodes = slurm.nodes()
    assert [n.name for n in nodes] == ["n1", "n2", "n3", "n4", "n5", "n6"]
    assert all(n.state is NodeState.IDLE and not n.drained for n in nodes), nodes

    topo = slurm.topology()
    assert topo.racks() == {"r1": ("n1", "n2"), "r2": ("n3", "n4"), "r3": ("n5", "n6")}

    # 4 ranks on n1..n4 and spares n5, n6: every group spans three racks.
    result = placement.compute_placement(topo, {0: "n1", 1: "n2", 2: "n3", 3: "n4"}, ["n5", "n6"],
                             prefer_original_rack=True)
    assert sorted(result) == [0, 1, 2, 3]
    for rank, p in result.items():
        racks = {topo.rack_of(m) for m in p.group.members}
        assert len(p.group.members) == 3 and len(racks) == 3, (rank, p)
        assert not p.group.degraded
        assert sorted(p.spares) == ["n5", "n6"]

    slurm.drain(["n3"], "raps integration drain")
    n3 = wait_until("n3 drained", lambda: slurm.node("n3"), lambda n: n.drained, timeout=20)
    assert n3.reason == "raps integration drain"
    # And plain sinfo, as an admin would look, agrees.
    line = CommandRunner(env=cluster.env).run(["sinfo", "-h", "-n", "n3", "-o", "%T|%E"]).strip()
    assert line.startswith("drained") and "raps integration drain" in line, line

    slurm.resume(["n3"])
    wait_until("n3 resumed", lambda: slurm.node("n3"), lambda n: not n.drained, timeout=20)


def test_job_nodes_weight_and_cancel(cluster: LocalCluster) -> None:
    slurm = cluster.slurm()
    run = CommandRunner(env=cluster.env).run
    job_id = int(run(["sbatch", "--parsable", "--no-kill", "-N4", "-J", "raps-it",
                      "-o", "/dev/null", "--wrap", "sleep 600"]).strip().split(";")[0])
    try:
        job = wait_until("job running", lambda: slurm.job(job_id),
                         lambda j: j.state == "RUNNING", timeout=30)
        assert len(job.nodes) == 4 and job.batch_host in job.nodes
        assert job.user_id == 0
        listed = {j.job_id: j for j in slurm.jobs([job_id])}
        assert listed[job_id].nodes == job.nodes

        slurm.set_weight(["n6"], 77)
        assert wait_until("weight", lambda: slurm.node("n6").weight, lambda w: w == 77,
                          timeout=10) == 77
        slurm.set_weight(["n6"], 1)

        slurm.requeue(job_id)
        # Slurm holds a requeued job back from its nodes for a while (begin time in the
        # future): back in the queue with one restart is what the adapter must show.
        again = wait_until("job requeued", lambda: slurm.job(job_id),
                           lambda j: j.restart_count == 1 and j.state == "PENDING",
                           timeout=30, interval=0.5)
        assert again.nodes == ()
    finally:
        slurm.cancel(job_id)
    wait_until("job gone", lambda: [j.state for j in slurm.jobs() if j.job_id == job_id],
               lambda s: not s or s[0] in ("CANCELLED", "COMPLETED"), timeout=30)


def test_errors_carry_command_and_stderr(cluster: LocalCluster) -> None:
    slurm = cluster.slurm()
    with pytest.raises(SlurmCommandError) as info:
        slurm.job(999999)
    assert info.value.argv[:3] == ["scontrol", "-o", "show"]
    assert info.value.returncode == 1
    assert "Invalid job id" in info.value.stderr
    with pytest.raises(SlurmCommandError, match=r"non-existent|Invalid node name"):
        slurm.drain(["n99"], "no such node")


def test_crashed_node_goes_down_and_comes_back(cluster: LocalCluster) -> None:
    slurm = cluster.slurm()
    cluster.crash("n6")
    # SlurmdTimeout=10 in the test cluster: Slurm notices within about 10-30 s.
    down = wait_until("n6 DOWN", lambda: slurm.node("n6"),
                      lambda n: n.state is NodeState.DOWN, timeout=60, interval=1)
    assert "NOT_RESPONDING" in down.flags
    cluster.restart("n6")
    wait_until("n6 back", lambda: slurm.node("n6"),
               lambda n: n.state is NodeState.IDLE and "NOT_RESPONDING" not in n.flags,
               timeout=60, interval=1)


def test_frozen_node_and_thaw(cluster: LocalCluster) -> None:
    events = cluster.cgroup("n5") / "cgroup.events"
    assert events.exists(), f"cgroup v2 not usable here: {events} missing"

    def frozen() -> str:
        return next(ln for ln in events.read_text().splitlines() if ln.startswith("frozen "))

    cluster.freeze("n5")
    try:
        wait_until("n5 frozen", frozen, lambda v: v == "frozen 1", timeout=10)
        pid = int((cluster.run_dir / "pids" / "slurmd-n5.pid").read_text())
        assert str(pid) in (cluster.cgroup("n5") / "cgroup.procs").read_text().split()
    finally:
        cluster.thaw("n5")
    wait_until("n5 thawed", frozen, lambda v: v == "frozen 0", timeout=10)
    slurm = cluster.slurm()
    assert not slurm.node("n5").flags & {"NOT_RESPONDING"}


def test_real_outputs_match_the_stored_samples(cluster: LocalCluster) -> None:
    """The parser fixtures under tests/data came from this cluster; check they still agree."""
    run = CommandRunner(env=cluster.env).run
    live = parsers.parse_topology(run(["scontrol", "show", "topology"]))
    with open(Path(__file__).parents[1] / "data" / "slurm" / "topology.txt") as f:
        stored = parsers.parse_topology(f.read())
    assert live == stored


def test_cluster_etcd_through_the_configured_store(cluster: LocalCluster) -> None:
    """The etcd that cluster.sh starts is reachable through open_store(config), with the
    credentials of the cluster's config (its etcd runs with authentication), and refuses
    a client without them."""
    cfg = load_file(cluster.config_path)
    store, keys = open_store(cfg.store)
    name = "it-foundation-probe"  # no such node: nothing of the cluster reads it
    with store:
        assert store.create(keys.node(name), b'{"rack": "r1"}')
        assert not store.create(keys.node(name), b"again")
        kv = store.get(keys.node(name))
        assert kv is not None and kv.value == b'{"rack": "r1"}'
        assert kv.key.startswith(cfg.store.prefix)
        assert store.delete(keys.node(name))
    if cfg.store.user:
        anonymous = parse_config({"store": {"endpoints": [cluster.etcd_url]}})
        bare, bare_keys = open_store(anonymous.store)
        with bare, pytest.raises(StoreError):
            bare.get(bare_keys.node("n1"))


def test_rapsctl_show_commands_on_the_cluster(cluster: LocalCluster) -> None:
    """What an admin types: rapsctl show nodes/topology/groups against the live cluster."""
    env = {**os.environ, **cluster.env}  # RAPS_CONFIG: the cluster's etcd and agents

    def rapsctl(*args: str) -> Any:
        r = subprocess.run([sys.executable, "-m", "raps_slurm.cli", *args], env=env, text=True,
                           capture_output=True, timeout=60, check=False)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    nodes = rapsctl("show", "nodes", "--json")
    assert [(n["node"], n["rack"]) for n in nodes] == [
        ("n1", "r1"), ("n2", "r1"), ("n3", "r2"), ("n4", "r2"), ("n5", "r3"), ("n6", "r3")]
    wait_until("every agent registered", lambda: rapsctl("show", "nodes", "--json"),
               lambda ns: [n["agent"] for n in ns] == ["up"] * 6, timeout=20)
    racks = rapsctl("show", "topology", "--json")
    assert {r["rack"]: r["count"] for r in racks} == {"r1": 2, "r2": 2, "r3": 2}
    groups = rapsctl("show", "groups", "--nodes", "n[1-4]", "--spares", "n[5-6]", "--json")
    assert [g["rank"] for g in groups] == [0, 1, 2, 3]
    for g in groups:
        assert sorted(g["racks"].split(",")) == ["r1", "r2", "r3"] and g["degraded"] == "no"
