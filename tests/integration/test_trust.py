"""The agent is the only door for users, and it serves a user only their own jobs: two
real uids (created here), one job owned by the first; the second is refused everything
about it (rank registration, rank map, plans, peer addresses, checkpoints), the first is
served."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from raps_slurm.config import load_file, node_dir
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry, RankMap
from raps_slurm.core.planner import Plan
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.etcd import free_port
from raps_slurm.testing.jobs import system_user

ASK = r"""
import json, os, sys
from raps_slurm.runtime.checkpoint import CheckpointClient
from raps_slurm.runtime.agent_client import AgentError
sock, job = sys.argv[1], sys.argv[2]
c = CheckpointClient(sock, job, 0, 1, timeout=30)
out = {}
for name, req in [
    ("register", {"op": "register", "job": job, "rank": 0, "epoch": 1, "pid": os.getpid()}),
    ("job_layout", {"op": "job_layout", "job": job}),
    ("job_plans", {"op": "job_plans", "job": job}),
    ("peer_lookup", {"op": "peer_lookup", "job": job, "rank": 1}),
    ("ckpt_restore", {"op": "ckpt_restore", "job": job, "rank": 1}),
    ("unregister", {"op": "unregister", "job": job, "rank": 0}),
]:
    try:
        reply, fds = c.request(req)
        for fd in fds:
            os.close(fd)
        out[name] = {"ok": True, "reply": reply}
    except AgentError as exc:
        out[name] = {"ok": False, "kind": exc.kind, "error": str(exc)}
print(json.dumps(out))
"""


def ask(cluster: LocalCluster, uid: int, job: str) -> dict[str, Any]:
    sock = node_dir(load_file(cluster.config_path).agent.socket_path, "n1")
    proc = subprocess.run([sys.executable, "-c", ASK, sock, job], capture_output=True,
                          text=True, timeout=60, user=uid, cwd="/", check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout))


@pytest.fixture(scope="module")
def users() -> tuple[int, int]:
    if not Path(sys.executable).resolve().is_relative_to("/opt") and \
            not Path(sys.executable).resolve().is_relative_to("/usr"):
        pytest.fail(f"{sys.executable} must be usable by other users for this test")
    return system_user("raps-it-alice"), system_user("raps-it-bob")


def test_a_user_is_served_only_their_own_job(cluster: LocalCluster,
                                             store: tuple[StateStore, Keys],
                                             users: tuple[int, int]) -> None:
    alice, bob = users
    s, k = store
    job = str(700000 + uuid.uuid4().int % 100000)
    s.put(k.job(job), JobRecord(job, 0, alice, ("n1", "n2", "n3"), JobSpec(spares=1),
                                user="raps-it-alice").to_json())
    s.put(k.job_map(job), RankMap(job, 0, ("n1", "n2"), ("n3",), 1).to_json())
    for r, n in enumerate(("n1", "n2")):
        s.put(k.job_rank(job, r), RankEntry(r, n, 1, "assigned", ("n3",)).to_json())
    s.put(k.job_peer("n2", job, 1), json.dumps({"host": "127.0.0.1", "port": 9, "epoch": 1,
                                          "done": False, "node": "n2"}).encode())
    s.put(k.plan(f"{job}-1-2"), Plan(f"{job}-1-2", job, 1, "n2", "n3", 2, "node n2 is dead",
                                     0).to_json())

    theirs = ask(cluster, bob, job)
    del theirs["unregister"]  # nothing registered by bob to take back
    for op, got in theirs.items():
        assert got["ok"] is False, (op, got)
        assert got["kind"] in ("permission", "not_registered"), (op, got)
    for op in ("register", "job_layout", "job_plans", "peer_lookup"):
        assert f"belongs to uid {alice}, you are uid {bob}" in theirs[op]["error"], theirs[op]

    mine = ask(cluster, alice, job)
    assert mine["register"]["ok"], mine
    assert mine["job_layout"]["reply"]["ranks"] == [[0, "n1", 1], [1, "n2", 1]]
    assert [p["plan_id"] for p in mine["job_plans"]["reply"]["plans"]] == [f"{job}-1-2"]
    assert mine["peer_lookup"]["reply"]["port"] == 9
    # rank 1 is not registered on n1, and alice is not root: no checkpoint for her here
    assert mine["ckpt_restore"]["ok"] is False
    assert mine["ckpt_restore"]["kind"] == "not_registered"
    assert mine["unregister"]["ok"], mine


def test_a_user_without_an_agent_asks_the_coordinator_with_munge(
        cluster: LocalCluster, store: tuple[StateStore, Keys], users: tuple[int, int]) -> None:
    """A login node: no agent, no etcd credentials; rapsctl reaches a coordinator's user
    door with a MUNGE credential, which says who is asking."""
    alice, bob = users
    s, k = store
    job = str(800000 + uuid.uuid4().int % 100000)
    s.put(k.job(job), JobRecord(job, 0, alice, ("n1", "n2", "n3"), JobSpec(spares=1),
                                user="raps-it-alice").to_json())
    s.put(k.plan(f"{job}-1-2"), Plan(f"{job}-1-2", job, 1, "n2", "n3", 2, "node n2 is dead",
                                     0).to_json())
    port = free_port()
    cfg = yaml.safe_load(cluster.config_path.read_text())
    cfg.setdefault("coordinator", {})["addresses"] = [f"127.0.0.1:{free_port()}",
                                                      f"127.0.0.1:{port}"]  # first: nobody
    login = cluster.run_dir / "etc" / f"login-{job}.yaml"  # pytest's tmp dirs are 0700
    login.write_text(yaml.safe_dump(cfg))
    login.chmod(0o644)
    # The door's coordinator may lead: Slurm does not know this job, and a leader purges
    # an unknown job's keys after purge_grace_sec (5 s in the test profile), which a
    # loaded machine can outlast between two requests.
    door_cfg = yaml.safe_load(cluster.config_path.read_text())
    door_cfg.setdefault("coordinator", {})["purge_grace_sec"] = 3600
    door_path = cluster.run_dir / "etc" / f"door-{job}.yaml"
    door_path.write_text(yaml.safe_dump(door_cfg))
    door = cluster.coordinator("door", config=door_path).start(
        user_address=f"127.0.0.1:{port}")

    def rapsctl(uid: int, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "raps_slurm.cli", "--config", str(login),
                               *args], capture_output=True, text=True, timeout=60, user=uid,
                              cwd="/", check=False, env={"PATH": "/usr/bin:/bin"})

    try:
        wait_until("the user door", lambda: "user door listening" in door.log(), timeout=20)
        mine = rapsctl(alice, "show", "job", job, "--json")
        assert mine.returncode == 0, mine.stderr
        shown = json.loads(mine.stdout)
        assert (shown["job_id"], shown["owner_uid"]) == (job, alice)
        plans = rapsctl(alice, "show", "recoveries", job, "--json")
        assert plans.returncode == 0, plans.stderr
        assert [p["plan_id"] for p in json.loads(plans.stdout)] == [f"{job}-1-2"]
        theirs = rapsctl(bob, "show", "job", job, "--json")
        assert theirs.returncode == 1 and theirs.stdout == ""
        assert theirs.stderr.strip() == (f"rapsctl: permission denied: job {job} belongs to "
                                         f"uid {alice}, you are uid {bob}")
        assert f"uid {bob} asked for job {job} of uid {alice}: refused" in door.log()
        every = rapsctl(bob, "show", "job")
        assert every.returncode == 2 and "name a job" in every.stderr
    finally:
        door.stop()
        login.unlink()
        door_path.unlink()
        s.delete_prefix(k.job(job))
        s.delete(k.plan(f"{job}-1-2"))
