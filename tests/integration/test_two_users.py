"""Two real uids on the same nodes: alice runs a job, bob attacks it through every door a
user can reach, while it runs. Each verb of the agent's local API that names alice's ranks
(``register``, ``heartbeat``, ``unregister``, ``peer_publish``, ``log_append``,
``log_read``, ``log_trim``, ``msg_stats``, ``escalate``) is refused to bob, and each of his
connections to her ranks' ports (the old unauthenticated HELLO, a 2 GiB header, a
handshake with a wrong proof) is refused by the rank. Her job finishes with the
failure-free result, her ranks' published addresses are hers, no verdict is written for
them, and the refusals are counted where an admin looks: the agent's log and the ranks'
message-log figures. Meanwhile root on n6, a node outside her job, takes from n6's own
agent the keys it hands out for her job and calls each rank as another node's rank, and
as the rank itself at a far-future epoch: both are refused (``authentication``,
``epoch``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.config import load_file, node_dir
from raps_slurm.runtime.checkpoint import CheckpointClient
from raps_slurm.runtime.frames import DATA, encode
from raps_slurm.runtime.rankauth import PROTOCOL, Auth
from raps_slurm.runtime.transport import _HELLO, HANDSHAKE_MAX
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import HEAT_RING, agent_job, heat_reference, system_user
from raps_slurm.wire import framing

NODES = ("n1", "n2", "n3")
ARGS = ("--steps", "200", "--every", "50", "--step-sec", "0.05")
VERBS = ("register", "heartbeat", "peer_publish", "log_append", "log_read", "log_trim",
         "msg_stats", "escalate", "unregister")

ATTACK = r"""
import json, os, socket, struct, sys
from raps_slurm.checkpoint.pack import sealed_bytes
from raps_slurm.runtime.agent_client import AgentError
from raps_slurm.runtime.checkpoint import CheckpointClient

job, targets = sys.argv[1], json.loads(sys.argv[2])
out = {"api": {}, "ports": {}}
for t in targets:
    rank, sock = t["rank"], t["socket"]
    c = CheckpointClient(sock, job, rank, 1, timeout=30)
    ask = {
        "register": {"op": "register", "job": job, "rank": rank, "epoch": 9, "pid": os.getpid()},
        "heartbeat": {"op": "heartbeat", "job": job, "rank": rank, "step": 10**9, "items": 0,
                      "blocked_on": None},
        "peer_publish": {"op": "peer_publish", "job": job, "rank": rank, "epoch": 1,
                         "host": "127.0.0.1", "port": 9, "done": True},
        "log_append": {"op": "log_append", "job": job, "rank": rank, "epoch": 1},
        "log_read": {"op": "log_read", "job": job, "rank": rank},
        "log_trim": {"op": "log_trim", "job": job, "rank": rank,
                     "floors": {str(p): 2**62 for p in range(3)}},
        "msg_stats": {"op": "msg_stats", "job": job, "rank": rank, "stats": {"x": "y" * 60000}},
        "escalate": {"op": "escalate", "job": job, "rank": rank, "reason": "bob says so",
                     "requeue": True},
        "unregister": {"op": "unregister", "job": job, "rank": rank},
    }
    got = {}
    for verb, req in ask.items():
        fds = [sealed_bytes(b"\0" * 64, "bob")] if verb == "log_append" else []
        try:
            reply, back = c.request(req, fds)
            for fd in back:
                os.close(fd)
            got[verb] = {"ok": True, "reply": reply}
        except AgentError as exc:
            got[verb] = {"ok": False, "kind": exc.kind, "error": str(exc)}
    out["api"][str(rank)] = got

    # the rank's own port: three ways in without its node pair's key
    hello = struct.pack(">BIIQQII", 2, 0, rank, 0, 2**62, 0, 0)  # HELLO, far-future epoch
    attempts = {
        "unauthenticated_hello": struct.pack(">I", len(hello)) + hello,
        "2GiB_header": struct.pack(">I", 2**31),
        "wrong_proof": None,
    }
    ports = {}
    for name, data in attempts.items():
        s = socket.create_connection((t["host"], t["port"]), timeout=20)
        try:
            if data is None:  # a well-formed challenge, then a proof made without the key
                # (rank 0 of epoch 1 calling epoch 1 of this rank, frame_mac control)
                body = b"raps-rank/3" + os.urandom(16) + struct.pack(">IIQQB", 0, rank, 1, 1, 0)
                s.sendall(struct.pack(">I", len(body)) + body)
                s.recv(4096)
                s.sendall(struct.pack(">I", 32) + os.urandom(32))
            else:
                s.sendall(data)
            tail = b""
            while True:  # the rank must close the connection, not wait for more
                got_bytes = s.recv(4096)
                if not got_bytes:
                    break
                tail += got_bytes
            ports[name] = "closed"
        except socket.timeout:
            ports[name] = "left open"
        except ConnectionResetError:
            ports[name] = "closed"
        finally:
            s.close()
    out["ports"][str(rank)] = ports
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def users() -> tuple[int, int]:
    exe = Path(sys.executable).resolve()
    if not (exe.is_relative_to("/opt") or exe.is_relative_to("/usr")):
        pytest.fail(f"{sys.executable} must be usable by other users for this test")
    return system_user("raps-it-alice"), system_user("raps-it-bob")


def _rank(cluster: LocalCluster, job: str, rank: int, uid: int) -> subprocess.Popen[str]:
    cfg = load_file(cluster.config_path)
    env = {**os.environ, "RAPS_AGENT_SOCKET": node_dir(cfg.agent.socket_path, NODES[rank]),
           "RAPS_JOB": job, "RAPS_RANK": str(rank), "RAPS_SIZE": str(len(NODES)),
           "RAPS_EPOCH": "1", "RAPS_CONFIG": str(cluster.config_path),
           "RAPS_APP_HEARTBEAT_SEC": "1"}
    return subprocess.Popen([sys.executable, str(HEAT_RING), *ARGS], env=env, user=uid,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")


def _root_elsewhere(socket_path: str, job: str, targets: list[dict[str, Any]]
                    ) -> dict[str, bool]:
    """Root on a node outside the job, with that node's agent: for each target rank, a
    handshake as another node's rank (with the key this agent gives for that pair) and
    one as the target itself at a far-future epoch, each then sending a message; whether
    each connection was closed on it."""
    agent = CheckpointClient(socket_path, job, 0, 1, timeout=30)
    out = {}
    for t in targets:
        q = t["rank"]
        src = (q + 1) % len(NODES)
        reply, _ = agent.request({"op": "rank_keys", "job": job, "rank": src, "peer": q})
        key = bytes.fromhex(reply["connect"])
        for name, (rank, epoch) in {"forged_rank": (src, 1), "future_epoch": (q, 2**62)
                                    }.items():
            out[f"{q}/{name}"] = _call(t["host"], t["port"], key, rank, epoch, q)
    agent.close()
    return out


def _call(host: str, port: int, key: bytes, src: int, epoch: int, dst: int) -> bool:
    """A handshake proving ``key`` whatever the listener proved, then one message;
    whether the listener closed the connection."""
    auth = Auth(key, src, epoch=epoch)
    bound = (src, dst, epoch, 1)
    with socket.create_connection((host, port), timeout=20) as s:
        try:
            nc = os.urandom(16)
            framing.send_parts(s, [_HELLO.pack(PROTOCOL, nc, *bound, auth.mode)])
            ns = bytes(framing.FrameReader(s, max_size=HANDSHAKE_MAX).read(
                idle_timeout=20))[:16]
            framing.send_parts(s, [auth.proof(key, b"c", nc, ns, *bound)])
            framing.send_parts(s, encode(DATA, src, dst, 1, epoch, b"forged"))
            return s.recv(1) == b""
        except TimeoutError:
            return False  # left open: the listener took it
        except (OSError, framing.FrameError):
            return True


def _peer(store: tuple[StateStore, Keys], job: str, rank: int) -> dict[str, Any] | None:
    s, k = store
    kv = s.get(k.job_peer(NODES[rank], job, rank))
    return None if kv is None else dict(json.loads(kv.value))


def test_another_user_is_refused_every_door_and_the_job_is_untouched(
        cluster: LocalCluster, store: tuple[StateStore, Keys], users: tuple[int, int],
        tmp_path: Path) -> None:
    alice, bob = users
    s, k = store
    clean = heat_reference(tmp_path, len(NODES), ARGS)
    job = agent_job(s, k, NODES, owner=alice, user="raps-it-alice")
    cfg = load_file(cluster.config_path)
    procs = [_rank(cluster, job, r, alice) for r in range(len(NODES))]
    try:
        peers = [wait_until(f"rank {r} published its address", lambda r=r: _peer(store, job, r),
                            lambda p: p is not None, 60) for r in range(len(NODES))]
        targets = [{"rank": r, "socket": node_dir(cfg.agent.socket_path, NODES[r]),
                    "host": p["host"], "port": p["port"]} for r, p in enumerate(peers)]
        attack = subprocess.run([sys.executable, "-c", ATTACK, job, json.dumps(targets)],
                                capture_output=True, text=True, timeout=180, user=bob,
                                cwd="/", check=False)
        assert attack.returncode == 0, attack.stderr[-3000:]
        seen = json.loads(attack.stdout)
        rooted = _root_elsewhere(node_dir(cfg.agent.socket_path, "n6"), job, targets)
        assert all(p.poll() is None for p in procs), "the job ended before the attack did: " \
            "it proves nothing (make ARGS longer)"
        finals = []
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-3000:]
            finals += [x for x in out.splitlines() if x.startswith("final ")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    for rank, got in seen["api"].items():
        assert set(got) == set(VERBS), got
        for verb, answer in got.items():
            assert answer["ok"] is False, (rank, verb, answer)
            assert answer["kind"] == "permission", (rank, verb, answer)
            assert f"you are uid {bob}" in answer["error"], (rank, verb, answer)
    for rank, ports in seen["ports"].items():
        assert ports == {"unauthenticated_hello": "closed", "2GiB_header": "closed",
                         "wrong_proof": "closed"}, (rank, ports)

    assert finals[:1] == [clean]  # rank 0 prints the result
    for r in range(len(NODES)):
        p = _peer(store, job, r)
        assert p is not None and p["port"] != 9 and p["node"] == NODES[r], p
        for key in (k.job_hung_verdict(job, r), *(k.rank_escalation(n, job, r) for n in NODES)):
            verdict = s.get(key)
            assert verdict is None, verdict.value
        stats = json.loads(s.get(k.job_msgstats(NODES[r], job, r)).value)["stats"]
        assert "y" * 100 not in json.dumps(stats)
        refused = stats["refused_connections"]
        assert sum(refused.values()) >= 3, (r, refused)
        # bob's wrong proof, root's key of another pair of nodes; root's future epoch
        assert refused.get("authentication", 0) >= 2, (r, refused)
        assert refused.get("epoch", 0) >= 1, (r, refused)
    assert rooted == {f"{r}/{n}": True for r in range(len(NODES))
                      for n in ("forged_rank", "future_epoch")}, rooted
    for node in NODES:
        text = (cluster.run_dir / "log" / f"agent-{node}.log").read_text()
        assert f"you are uid {bob}" in text, f"{node}'s agent did not log bob's refusals"
    s.delete_prefix(k.job(job))
