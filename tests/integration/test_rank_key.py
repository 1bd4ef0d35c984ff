"""Keys for rank-to-rank traffic reach only the owner's ranks, and only for connections
that start or end on the asking node: two real uids (created here) and a job of the
first with rank 0 on n1 and rank 1 on n2. Through the real agents (SO_PEERCRED) the second
uid is refused; the first gets the keys once a rank of hers is registered; root on n3,
outside the job, gets keys from its own agent that no rank of the job accepts."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.config import load_file, node_dir
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster
from raps_slurm.testing.jobs import system_user

ASK = r"""
import json, os, sys
from raps_slurm.runtime.checkpoint import CheckpointClient
from raps_slurm.runtime.agent_client import AgentError
sock, job, rank, peer, register = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5] == "1"
c = CheckpointClient(sock, job, rank, 1, timeout=30)
out = {}
ask = {"op": "rank_keys", "job": job, "rank": rank, "peer": peer}
reqs = [("keys_unregistered", ask)]
if register:
    reqs.append(("register", {"op": "register", "job": job, "rank": rank, "epoch": 1,
                              "pid": os.getpid()}))
reqs += [("keys", ask)]
for name, req in reqs:
    try:
        reply, fds = c.request(req)
        out[name] = {"ok": True, "reply": reply}
    except AgentError as exc:
        out[name] = {"ok": False, "kind": exc.kind, "error": str(exc)}
print(json.dumps(out))
"""


def ask(cluster: LocalCluster, uid: int, job: str, node: str, rank: int, peer: int,
        register: bool) -> dict[str, Any]:
    sock = node_dir(load_file(cluster.config_path).agent.socket_path, node)
    proc = subprocess.run([sys.executable, "-c", ASK, sock, job, str(rank), str(peer),
                           "1" if register else "0"],
                          capture_output=True, text=True, timeout=60, user=uid, cwd="/",
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout))


def test_only_the_owners_ranks_get_keys_and_only_their_nodes_pairs(
        cluster: LocalCluster, store: tuple[StateStore, Keys]) -> None:
    exe = Path(sys.executable).resolve()
    if not (exe.is_relative_to("/opt") or exe.is_relative_to("/usr")):
        pytest.fail(f"{sys.executable} must be usable by other users for this test")
    alice, bob = system_user("raps-it-alice"), system_user("raps-it-bob")
    s, k = store
    job = str(900000 + uuid.uuid4().int % 90000)
    s.put(k.job(job), JobRecord(job, 0, alice, ("n1", "n2"), JobSpec(),
                                user="raps-it-alice").to_json())
    for rank, node in enumerate(("n1", "n2")):
        s.put(k.job_rank(job, rank), RankEntry(rank, node, 1, "running", ()).to_json())
    try:
        theirs = ask(cluster, bob, job, "n1", 0, 1, register=True)
        for op in ("keys_unregistered", "register", "keys"):
            assert theirs[op]["ok"] is False, (op, theirs[op])
            assert f"belongs to uid {alice}, you are uid {bob}" in theirs[op]["error"], theirs
        mine = ask(cluster, alice, job, "n1", 0, 1, register=True)
        assert mine["keys_unregistered"]["ok"] is False  # no rank of hers here yet
        assert mine["keys_unregistered"]["kind"] == "not_registered"
        assert mine["register"]["ok"], mine
        to_n2 = mine["keys"]["reply"]
        assert to_n2["node"] == "n2" and to_n2["epoch"] == 1 and len(to_n2["connect"]) == 64
        # rank 1 on n2 accepts what rank 0 on n1 proves
        at_n2 = ask(cluster, alice, job, "n2", 1, 0, register=True)["keys"]["reply"]
        assert to_n2["connect"] in at_n2["accept"] and at_n2["node"] == "n1"
        # root on n3, outside the job, with n3's real agent: keys of n3's pairs only
        root = ask(cluster, 0, job, "n3", 0, 1, register=False)["keys"]["reply"]
        assert root["connect"] not in at_n2["accept"], root
        assert root["connect"] != to_n2["connect"]
    finally:
        s.delete_prefix(k.job(job))
