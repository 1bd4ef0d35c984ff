"""``register`` on the real agents: a user's process registering a rank of their own job
with the agent of a node outside the job is refused (kind ``node``) and counted where an
admin looks (the node's health sample); with a node of the job it is served."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raps_slurm.config import load_file, node_dir
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import agent_job, system_user

REGISTER = r"""
import json, os, sys
from raps_slurm.runtime.agent_client import AgentError
from raps_slurm.runtime.checkpoint import CheckpointClient

job, sockets = sys.argv[1], json.loads(sys.argv[2])
out = {}
for node, sock in sockets.items():
    c = CheckpointClient(sock, job, 0, 1, timeout=30)
    ask = {"op": "register", "job": job, "rank": 0, "epoch": 1, "pid": os.getpid()}
    try:
        c.request(ask, [])
        out[node] = {"ok": True}
    except AgentError as exc:
        out[node] = {"ok": False, "kind": exc.kind, "error": str(exc)}
print(json.dumps(out))
"""


def _refused(store: tuple[StateStore, Keys], node: str) -> int:
    s, k = store
    kv = s.get(k.node_health(node))
    if kv is None:
        return 0
    rejected = json.loads(kv.value).get("rejected", {})
    return int(rejected.get("local_api", {}).get("node", 0))


def test_register_refuses_a_node_outside_the_job(cluster: LocalCluster,
                                                 store: tuple[StateStore, Keys]) -> None:
    exe = Path(sys.executable).resolve()
    if not (exe.is_relative_to("/opt") or exe.is_relative_to("/usr")):
        pytest.fail(f"{sys.executable} must be usable by other users for this test")
    alice = system_user("raps-it-alice")
    s, k = store
    job = agent_job(s, k, ("n1", "n2"), owner=alice, user="raps-it-alice")  # spare n5, n4
    cfg = load_file(cluster.config_path)
    before = _refused(store, "n6")
    try:
        sockets = {n: node_dir(cfg.agent.socket_path, n) for n in ("n6", "n1")}
        r = subprocess.run([sys.executable, "-c", REGISTER, job, json.dumps(sockets)],
                           capture_output=True, text=True, timeout=120, user=alice, cwd="/",
                           check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout)
        assert got["n6"]["ok"] is False and got["n6"]["kind"] == "node", got
        assert f"node n6 is not a node of job {job}" in got["n6"]["error"], got
        assert got["n1"] == {"ok": True}, got
        wait_until("n6's health sample counts the refusal", lambda: _refused(store, "n6"),
                   lambda n: n > before, 30)
    finally:
        s.delete_prefix(k.job(job))
