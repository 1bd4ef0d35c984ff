"""Per-job quotas at the agent's door: one user's flood changes nothing for another
user's job. Driven through the real agent API objects with an in-memory store and two
uids, each owning one job with a rank registered on the same agent."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.agent.ckpt_api import CheckpointOps
from raps_slurm.agent.local_api import LocalApiServer, Peer, RankInfo, RankTable
from raps_slurm.agent.msg_api import MessagingOps
from raps_slurm.agent.quota import JobQuotas, dir_bytes, job_size
from raps_slurm.agent.recovery_api import RecoveryOps
from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.pack import sealed_bytes
from raps_slurm.checkpoint.service import CheckpointService
from raps_slurm.config import AgentConfig, Config
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry, RankMap
from raps_slurm.store import Keys, MemoryStore

ALICE, BOB = 1000, 1001
PID = {ALICE: 4242, BOB: 4343}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Agent:
    """Job 5 (alice, ranks 0-1 on n1, n2) and job 6 (bob, ranks 0-1), one agent."""

    def __init__(self, tmp: Path) -> None:
        self.store, self.keys = MemoryStore(), Keys()
        k = self.keys
        for job, owner in (("5", ALICE), ("6", BOB)):
            self.store.put(k.job(job), JobRecord(job, 0, owner, ("n1", "n2"),
                                                 JobSpec()).to_json())
            self.store.put(k.job_map(job), RankMap(job, 0, ("n1", "n2")).to_json())
            for r in (0, 1):
                self.store.put(k.job_rank(job, r),
                               RankEntry(r, "n1", 1, "running", ()).to_json())
        self.root = tmp / "store"
        self.clock = Clock()
        self.quotas = JobQuotas(writes_per_sec=1.0, burst=5, max_value_bytes=4096,
                                disk_quota_bytes=10_000, disk_root=self.root,
                                rescan_sec=0.0, clock=self.clock)
        self.service = CheckpointService(Config(), self.store, self.keys, "n1",
                                         secrets.token_bytes(32), ChunkStore(self.root),
                                         peers=lambda: {})
        self.table = RankTable()
        now = time.monotonic()
        self.table.register(RankInfo("5", 0, 1, PID[ALICE], ALICE, now, now))
        self.table.register(RankInfo("6", 0, 1, PID[BOB], BOB, now, now))
        owners = {"5": ALICE, "6": BOB}
        proc = tmp / "proc"
        for uid, pid in PID.items():
            (proc / str(pid)).mkdir(parents=True)
            (proc / str(pid) / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\n")
        ops = {**MessagingOps(self.service, self.table, owners.get, self.quotas).extensions(),
               **CheckpointOps(self.service, self.table, self.quotas).extensions(),
               **RecoveryOps(self.store, self.keys, "n1", self.table, owners.get,
                             self.quotas).extensions()}
        self.api = LocalApiServer(tmp / "agent.sock", "n1", owner_of=owners.get,
                                  valid_for=lambda: 10.0, table=self.table, proc_root=proc,
                                  extensions=ops, quotas=self.quotas,
                                  size_of=lambda job: job_size(self.store, self.keys, job))

    def ask(self, uid: int, fds: list[int] | None = None, **request: object
            ) -> dict[str, object]:
        reply, out = self.api.handle_request_fds(request, Peer(PID[uid], uid, uid), fds or [])
        assert not out
        return reply

    def stats(self, uid: int, job: str, stats: object = None) -> dict[str, object]:
        return self.ask(uid, op="msg_stats", job=job, rank=0,
                        stats=stats if stats is not None else {"sent": 1})


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(tmp_path)
    yield a
    a.store.close()


def test_a_flood_is_throttled_for_its_own_job_only(agent: Agent) -> None:
    replies = [agent.stats(ALICE, "5") for _ in range(50)]
    assert [r["ok"] for r in replies[:5]] == [True] * 5  # the burst
    refused = replies[5:]
    assert all(r["ok"] is False and r["kind"] == "quota" for r in refused)
    assert "job 5 is over its etcd write rate (agent.job_etcd_writes_per_sec=1, burst 5)" \
        in str(refused[0]["error"])
    assert agent.api.error_counts()["quota"] == 45  # counted like every refusal
    # bob's job on the same agent, meanwhile: its own burst goes through whole
    for _ in range(4):
        assert agent.stats(BOB, "6") == {"ok": True}
    assert agent.ask(BOB, op="peer_publish", job="6", rank=0, epoch=1, host="n1", port=9000,
                     done=False) == {"ok": True}
    assert agent.store.get(agent.keys.job_peer("n1", "6", 0)) is not None
    # and alice's bucket refills at the configured rate
    agent.clock.now += 2.0
    assert [agent.stats(ALICE, "5")["ok"] for _ in range(3)] == [True, True, False]


def test_every_etcd_writing_op_takes_from_the_bucket(agent: Agent) -> None:
    asks = [dict(op="peer_publish", job="5", rank=0, epoch=1, host="n1", port=9000,
                 done=False),
            dict(op="msg_stats", job="5", rank=0, stats={}),
            dict(op="escalate", job="5", rank=0, reason="hole in replay", requeue=True),
            dict(op="recovery_event", job="5", rank=0, epoch=1, phase="running", detail={}),
            dict(op="register", job="5", rank=1, epoch=1, pid=PID[ALICE])]
    assert all(agent.ask(ALICE, **a)["ok"] for a in asks)
    for a in asks:  # the burst of 5 is spent: each is refused now
        got = agent.ask(ALICE, **a)
        assert got["kind"] == "quota" and str(got["error"]).startswith(f"{a['op']}: "), got


def test_another_users_refused_requests_drain_nothing(agent: Agent) -> None:
    for _ in range(50):
        assert agent.stats(BOB, "5")["kind"] in ("permission", "not_registered")
    assert all(agent.stats(ALICE, "5")["ok"] for _ in range(5))


def test_an_oversize_value_is_refused_and_nothing_written(agent: Agent) -> None:
    got = agent.stats(ALICE, "5", {"x": "a" * 5000})
    assert got["ok"] is False and got["kind"] == "quota"
    assert "more than agent.max_value_kb=4 (4096 bytes); nothing written" in str(got["error"])
    assert agent.store.get(agent.keys.job_msgstats("n1", "5", 0)) is None
    assert agent.stats(ALICE, "5", {"x": "a" * 100})["ok"]


def test_a_rank_outside_the_job_is_refused(agent: Agent) -> None:
    ok = agent.ask(ALICE, op="register", job="5", rank=1, epoch=1, pid=PID[ALICE])
    assert ok["ok"], ok
    for rank in (2, 2**31 - 1):
        got = agent.ask(ALICE, op="register", job="5", rank=rank, epoch=1, pid=PID[ALICE])
        assert got == {"ok": False, "kind": "rank",
                       "error": f"rank {rank} is outside job 5: its ranks are 0..1"}
        assert agent.table.get("5", rank) is None
    assert agent.api.error_counts()["rank"] == 2


def test_job_size_from_the_map_else_from_the_record(agent: Agent) -> None:
    k = agent.keys
    assert job_size(agent.store, k, "5") == 2
    assert job_size(agent.store, k, "7") is None
    agent.store.put(k.job("7"), JobRecord("7", 1, ALICE, ("n1", "n2", "n3"),
                                          JobSpec(ranks_per_node=4)).to_json())
    assert job_size(agent.store, k, "7") == 12  # no map yet: what its nodes can hold
    agent.store.put(k.job_map("7"), RankMap("7", 0, ("n1",) * 5).to_json())
    assert job_size(agent.store, k, "7") == 12  # a map of the run before
    agent.store.put(k.job_map("7"), RankMap("7", 1, ("n1",) * 5).to_json())
    assert job_size(agent.store, k, "7") == 5


def test_the_disk_quota_refuses_a_segment_and_a_pack_before_writing(agent: Agent) -> None:
    packs = agent.root / "job-5" / "packs"
    packs.mkdir(parents=True)
    (packs / "old.pack").write_bytes(b"x" * 9_000)
    before = dir_bytes(agent.root / "job-5")
    fd = sealed_bytes(b"\0" * 2_000, "raps-log")
    got = agent.ask(ALICE, [fd], op="log_append", job="5", rank=0, epoch=1)
    assert got["ok"] is False and got["kind"] == "quota"
    assert got["error"] == ("log_append: job 5 keeps 9000 bytes of checkpoints and logs on "
                            "this node; 2000 more would pass its quota "
                            "agent.job_disk_quota_mb=0.00953674 (10000 bytes); nothing written")
    begin = agent.ask(ALICE, op="ckpt_begin", job="5", rank=0, epoch=1, base=None)
    assert begin["ok"], begin
    fd = sealed_bytes(b"\0" * 2_000, "raps-pack")
    got = agent.ask(ALICE, [fd], op="ckpt_put", session=begin["session"])
    assert got["kind"] == "quota" and str(got["error"]).startswith("ckpt_put: job 5 keeps")
    assert dir_bytes(agent.root / "job-5") == before
    assert agent.service.logs.segments("5", 0) == []
    # within the quota the request goes on to the store (which refuses this pack for
    # what it is), and the reservation is given back
    fd = sealed_bytes(b"\0" * 500, "raps-pack")
    got = agent.ask(ALICE, [fd], op="ckpt_put", session=begin["session"])
    assert got["kind"] == "pack", got
    fd = sealed_bytes(b"\0" * 900, "raps-pack")
    assert agent.ask(ALICE, [fd], op="ckpt_put", session=begin["session"])["kind"] == "pack"
    # bob's job on this node is not touched by alice's full quota
    fd = sealed_bytes(b"\0" * 2_000, "raps-log")
    assert agent.ask(BOB, [fd], op="log_append", job="6", rank=0, epoch=1)["kind"] == "log"


def test_quotas_from_the_config() -> None:
    q = JobQuotas.from_config(AgentConfig(), "/nonexistent")
    assert (q.rate, q.burst, q.max_value_bytes, q.disk_quota_bytes) == \
        (50.0, 1000, 64 << 10, 100 << 30)
    assert q.write("msg_stats", "5", 0, json.dumps({}).encode()) == b"{}"


def test_escalate_records_whether_the_runtime_asks_for_a_requeue(agent: Agent) -> None:
    """(Driven through the same agent: the ESCALATE verdict carries ``requeue`` as the
    runtime set it; anything but true or false is refused, nothing written.)"""
    key = agent.keys.rank_escalation("n1", "5", 0)
    for bad in ("no", 0, None):
        got = agent.ask(ALICE, op="escalate", job="5", rank=0, reason="r", requeue=bad)
        assert got["kind"] == "schema" and "'requeue'" in str(got["error"]), got
    got = agent.ask(ALICE, op="escalate", job="5", rank=0, reason="r")
    assert got["kind"] == "schema" and "missing field 'requeue'" in str(got["error"]), got
    assert agent.store.get(key) is None
    for requeue in (False, True):
        assert agent.ask(ALICE, op="escalate", job="5", rank=0, reason="rank 0 cannot replay",
                         requeue=requeue) == {"ok": True}
        kv = agent.store.get(key)
        assert kv is not None
        value = json.loads(kv.value)
        assert value["kind"] == "ESCALATE" and value["requeue"] is requeue
        assert value["evidence"] == {"reason": "rank 0 cannot replay"}
