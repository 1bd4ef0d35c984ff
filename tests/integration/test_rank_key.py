"""The job's key for rank-to-rank traffic reaches only the owner's ranks: two real uids
(created here) and a job of the first; through the real agent on n1 (SO_PEERCRED) the
second uid is refused the key, the first gets it once a rank of hers is registered."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.config import load_file, node_dir
from raps_slurm.core.jobs import JobRecord, JobSpec
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster
from raps_slurm.testing.jobs import system_user

ASK = r"""
import json, os, sys
from raps_slurm.runtime.checkpoint import CheckpointClient
from raps_slurm.runtime.agent_client import AgentError
sock, job, register = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
c = CheckpointClient(sock, job, 0, 1, timeout=30)
out = {}
reqs = [("key_unregistered", {"op": "job_key", "job": job, "rank": 0})]
if register:
    reqs.append(("register", {"op": "register", "job": job, "rank": 0, "epoch": 1,
                              "pid": os.getpid()}))
reqs += [("key", {"op": "job_key", "job": job, "rank": 0})]
for name, req in reqs:
    try:
        reply, fds = c.request(req)
        out[name] = {"ok": True, "reply": reply}
    except AgentError as exc:
        out[name] = {"ok": False, "kind": exc.kind, "error": str(exc)}
print(json.dumps(out))
"""


def ask(cluster: LocalCluster, uid: int, job: str, register: bool) -> dict[str, Any]:
    sock = node_dir(load_file(cluster.config_path).agent.socket_path, "n1")
    proc = subprocess.run([sys.executable, "-c", ASK, sock, job, "1" if register else "0"],
                          capture_output=True, text=True, timeout=60, user=uid, cwd="/",
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout))


def test_only_the_owners_registered_rank_gets_the_job_key(
        cluster: LocalCluster, store: tuple[StateStore, Keys]) -> None:
    exe = Path(sys.executable).resolve()
    if not (exe.is_relative_to("/opt") or exe.is_relative_to("/usr")):
        pytest.fail(f"{sys.executable} must be usable by other users for this test")
    alice, bob = system_user("raps-it-alice"), system_user("raps-it-bob")
    s, k = store
    job = str(900000 + uuid.uuid4().int % 90000)
    secret = bytes(range(32))
    s.put(k.job(job), JobRecord(job, 0, alice, ("n1", "n2"), JobSpec(),
                                user="raps-it-alice").to_json())
    s.put(k.job_secret(job), secret.hex().encode())
    try:
        theirs = ask(cluster, bob, job, register=True)
        for op in ("key_unregistered", "register", "key"):
            assert theirs[op]["ok"] is False, (op, theirs[op])
            assert f"belongs to uid {alice}, you are uid {bob}" in theirs[op]["error"], theirs
        mine = ask(cluster, alice, job, register=True)
        assert mine["key_unregistered"]["ok"] is False  # no rank of hers here yet
        assert mine["key_unregistered"]["kind"] == "not_registered"
        assert mine["register"]["ok"], mine
        assert mine["key"]["ok"] and mine["key"]["reply"]["key"] == secret.hex(), mine
    finally:
        s.delete_prefix(k.job(job))
