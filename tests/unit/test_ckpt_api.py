"""Checkpoint ops on the agent's local API: who may save and restore, and what is refused."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from raps_slurm.agent.ckpt_api import CheckpointOps
from raps_slurm.agent.local_api import LocalApiServer, RankInfo, RankTable
from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.pack import PackWriter
from raps_slurm.checkpoint.service import CheckpointService
from raps_slurm.config import Config
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry
from raps_slurm.runtime.agent_client import AgentError
from raps_slurm.runtime.checkpoint import CheckpointClient
from raps_slurm.store import Keys, MemoryStore
from raps_slurm.testing.jobs import damage_chunks

USER = 1000


class Agent:
    def __init__(self, tmp: Path) -> None:
        self.store, self.keys = MemoryStore(), Keys("/raps/v1/")
        self.store.put(self.keys.job("5"), JobRecord("5", 0, USER, ("n1", "n2"), JobSpec(spares=0))
                       .to_json())
        self.store.put(self.keys.job_rank("5", 0), RankEntry(0, "n1", 1, "running", ()).to_json())
        self.service = CheckpointService(Config(), self.store, self.keys, "n1",
                                         secrets.token_bytes(32), ChunkStore(tmp / "store"),
                                         peers=lambda: {})
        self.table = RankTable()
        now = time.monotonic()
        self.table.register(RankInfo("5", 0, 1, os.getpid(), USER, now, now))
        self.sock = tmp / "agent.sock"
        self.api = LocalApiServer(self.sock, "n1", owner_of=lambda job: USER,
                                  valid_for=lambda: 10.0, table=self.table,
                                  extensions=CheckpointOps(self.service, self.table)
                                  .extensions())
        self.api.peer_uid_override = USER
        self.api.start()

    def client(self, epoch: int = 1) -> CheckpointClient:
        return CheckpointClient(self.sock, "5", 0, epoch, timeout=30)

    def close(self) -> None:
        self.api.stop()
        self.store.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(tmp_path)
    yield a
    a.close()


def state(seed: int = 1) -> dict[str, object]:
    return {"x": np.random.default_rng(seed).standard_normal(50_000), "tag": b"v1"}


def test_save_and_restore_as_the_owner(agent: Agent) -> None:
    c = agent.client()
    s1 = c.save(state())
    assert (s1.generation, s1.state, s1.holders) == (1, "under_replicated", ["n1"])
    s2 = c.save(state())  # unchanged: the pre-pass sends nothing new
    assert s2.generation == 2 and s2.stats.new_chunks == 0
    fresh = agent.client()
    loaded = fresh.restore()
    assert loaded is not None and loaded.generation == 2 and loaded.fallbacks == []
    assert isinstance(loaded.state, dict)
    assert np.array_equal(loaded.state["x"], state()["x"]) and loaded.state["tag"] == b"v1"
    loaded.state["x"][0] = 42.0  # copy-on-write mapping: the rank may change its arrays
    c.close()
    fresh.close()


def test_no_checkpoint_yet_restores_none(agent: Agent) -> None:
    c = agent.client()
    assert c.restore() is None
    c.close()


def test_no_generation_whole_is_refused_as_lost_and_the_leader_is_told(agent: Agent) -> None:
    """Every chunk of every generation damaged on its only holder: the restore is refused
    with kind ``lost`` (the runtime exits 74 on it) and the rank's verdict ESCALATE with
    ``lost`` is in etcd first, with the registered epoch, for the leader to give up."""
    c = agent.client()
    c.save(state())
    c.save(state(2))
    assert damage_chunks(agent.service.chunks, "5") > 0
    fresh = agent.client()
    with pytest.raises(AgentError, match="no generation of rank 0 of job 5") as e:
        fresh.restore()
    assert e.value.kind == "lost"
    kv = agent.store.get(agent.keys.rank_escalation("n1", "5", 0))
    assert kv is not None
    verdict = json.loads(kv.value)
    assert (verdict["kind"], verdict["lost"], verdict["requeue"], verdict["epoch"],
            verdict["node"]) == ("ESCALATE", True, True, 1, "n1")
    assert verdict["evidence"]["reason"].startswith("its checkpoint could not be restored")
    # a holder that is down was not checked: the loss may be for now, so not ``lost``
    for kv in agent.store.get_prefix(agent.keys.ckpt_prefix("5", 0)):
        rec = CkptRecord.from_json(kv.key, kv.value)
        agent.store.put(kv.key, rec.with_holders({"n1", "n2"}).to_json())
    with pytest.raises(AgentError, match=r"holders out of reach: n2") as e:
        fresh.restore()
    assert e.value.kind == "lost"
    verdict = json.loads(agent.store.get(agent.keys.rank_escalation("n1", "5", 0)).value)  # type: ignore[union-attr]
    assert (verdict["lost"], verdict["requeue"]) == (False, True)
    c.close()
    fresh.close()


def test_another_uid_is_refused(agent: Agent) -> None:
    agent.api.peer_uid_override = USER + 1
    c = agent.client()
    with pytest.raises(AgentError, match="belongs to uid 1000, you are uid 1001") as e:
        c.save(state())
    assert e.value.kind == "permission"
    with pytest.raises(AgentError, match="permission denied"):
        c.restore()
    c.close()
    assert agent.api.denied == 2


def test_wrong_epoch_and_superseded_epoch(agent: Agent) -> None:
    stale = agent.client(epoch=2)
    with pytest.raises(AgentError, match="not the registered epoch 1") as e:
        stale.save(state())
    assert e.value.kind == "epoch"
    stale.close()
    # The coordinator moved the rank on (epoch 2) after this copy registered with 1.
    agent.store.put(agent.keys.job_rank("5", 0), RankEntry(0, "n4", 2, "running", ()).to_json())
    c = agent.client()
    with pytest.raises(AgentError, match="is at epoch 2; this copy is epoch 1") as e:
        c.save(state())
    assert e.value.kind == "epoch"
    assert agent.store.get_prefix(agent.keys.ckpt_prefix("5", 0)) == []
    c.close()


def raw_call(path: Path, frame: dict, fds: list[int]) -> dict:
    from raps_slurm.runtime.agent_client import encode_frame, read_reply
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        socket.send_fds(s, [encode_frame(frame)], fds)
        return read_reply(s)


def test_unsealed_or_missing_descriptors_are_refused(agent: Agent) -> None:
    c = agent.client()
    begin, _ = c._call({"op": "ckpt_begin", "job": "5", "rank": 0, "epoch": 1, "base": None})
    sid = begin["session"]
    c.close()
    pack = PackWriter()
    pack.add(b"\x01" * 32, 3, b"\x00", b"abc")  # not sealed: could change after the checks
    reply = raw_call(agent.sock, {"op": "ckpt_put", "session": sid}, [pack.fd])
    assert reply["ok"] is False and reply["kind"] == "fds" and "sealed" in reply["error"]
    reply = raw_call(agent.sock, {"op": "ckpt_put", "session": sid}, [])
    assert reply["kind"] == "fds" and "exactly one descriptor" in reply["error"]
    r, w = os.pipe()
    reply = raw_call(agent.sock, {"op": "ckpt_commit", "session": sid}, [r])
    assert reply["kind"] == "fds"
    for fd in (w, pack.fd):
        os.close(fd)
    reply = raw_call(agent.sock, {"op": "ckpt_put", "session": "0" * 32}, [])
    assert reply["kind"] == "session"
    reply = raw_call(agent.sock, {"op": "ckpt_begin", "job": "5", "rank": 0, "epoch": 1,
                                  "base": "latest"}, [])
    assert reply["kind"] == "schema" and "field 'base'" in reply["error"]


def test_malformed_pack_is_refused_with_the_offset(agent: Agent) -> None:
    c = agent.client()
    begin, _ = c._call({"op": "ckpt_begin", "job": "5", "rank": 0, "epoch": 1, "base": None})
    c.close()
    pack = PackWriter()
    pack.add(b"\x01" * 32, 3, b"\x00", b"abc")
    os.pwrite(pack.fd, b"\xff\xff\xff\xff", 8 + 32 + 4)  # stored size far beyond raw size
    pack.seal()
    reply = raw_call(agent.sock, {"op": "ckpt_put", "session": begin["session"]}, [pack.fd])
    assert reply["kind"] == "pack" and "offset 8" in reply["error"]
    pack.close()
