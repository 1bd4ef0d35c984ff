"""The agent's recovery ops: only the job's owner (or root) reads its rank map and plans;
a launch is reported by the owner for a plan that exists, a running rank only by itself."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from raps_slurm.agent.local_api import LocalApiServer, Peer, RankInfo, RankTable
from raps_slurm.agent.recovery_api import RecoveryOps
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry, RankMap
from raps_slurm.core.planner import Plan, advance
from raps_slurm.store import Keys, MemoryStore

OWNER, OTHER = 1000, 1001


class Agent:
    def __init__(self, tmp: str) -> None:
        self.store, self.keys = MemoryStore(), Keys()
        k = self.keys
        self.store.put(k.job("5"), JobRecord("5", 0, OWNER, ("n1", "n2", "n3"),
                                             JobSpec(spares=1)).to_json())
        self.store.put(k.job_map("5"), RankMap("5", 0, ("n1", "n2"), ("n3",), 1).to_json())
        for r, n in enumerate(("n1", "n2")):
            self.store.put(k.job_rank("5", r), RankEntry(r, n, 1, "assigned", ("n3",)).to_json())
        self.table = RankTable()
        now = time.monotonic()
        self.table.register(RankInfo("5", 1, 2, 4242, OWNER, now, now))
        owners = {"5": OWNER}
        self.api = LocalApiServer(f"{tmp}/agent.sock", "n2", owner_of=owners.get,
                                  valid_for=lambda: 10.0, table=self.table,
                                  extensions=RecoveryOps(self.store, self.keys, "n2", self.table,
                                                         owners.get).extensions())

    def ask(self, uid: int, **request: object) -> dict[str, object]:
        reply, _ = self.api.handle_request_fds(request, Peer(4242, uid, uid), [])
        return reply


@pytest.fixture
def agent(tmp_path: object) -> Iterator[Agent]:
    a = Agent(str(tmp_path))
    yield a
    a.store.close()


def test_layout_and_plans_only_for_the_owner(agent: Agent) -> None:
    got = agent.ask(OWNER, op="job_layout", job="5")
    assert got["ready"] and got["size"] == 2 and got["spares"] == ["n3"]
    assert got["ranks"] == [[0, "n1", 1], [1, "n2", 1]]
    assert agent.ask(0, op="job_layout", job="5")["ok"]  # root sees every job
    for op in ("job_layout", "job_plans"):
        refused = agent.ask(OTHER, op=op, job="5")
        assert refused["ok"] is False and refused["kind"] == "permission"
        assert "job 5 belongs to uid 1000, you are uid 1001" in str(refused["error"])
    unknown = agent.ask(OWNER, op="job_layout", job="6")  # not registered: nobody owns it
    assert unknown["ok"] is False and unknown["kind"] == "permission"
    assert agent.ask(OWNER, op="job_plans", job="5") == {"ok": True, "plans": [],
                                                         "escalated": None, "gave_up": ""}


def test_a_map_of_an_older_run_is_not_ready(agent: Agent) -> None:
    agent.store.put(agent.keys.job("5"), JobRecord("5", 1, OWNER, ("n1", "n2", "n3"),
                                                   JobSpec(spares=1)).to_json())
    assert agent.ask(OWNER, op="job_layout", job="5") == {"ok": True, "ready": False}


def test_phase_reports(agent: Agent) -> None:
    k = agent.keys
    plan = advance(Plan("5-1-2", "5", 1, "n4", "n2", 2, "node n4 is dead", 0), "running", 1.0)
    event = {"op": "recovery_event", "job": "5", "rank": 1, "epoch": 2, "detail": {}}
    # no plan gives rank 0 epoch 2: nothing recorded
    assert agent.ask(OWNER, **{**event, "rank": 0, "phase": "launched"})["recorded"] is False
    agent.store.put(k.plan("5-1-2"), plan.to_json())
    assert agent.ask(OTHER, **event, phase="launched")["kind"] == "permission"
    assert agent.ask(OWNER, **event, phase="launched")["recorded"] is True
    assert agent.ask(OWNER, **event, phase="launched")["recorded"] is False  # first wins
    # "running" comes from the registered rank itself, with its epoch
    assert agent.ask(OWNER, **{**event, "epoch": 3}, phase="running")["kind"] == "epoch"
    assert agent.ask(OWNER, **event, phase="running")["recorded"] is True
    kv = agent.store.get(k.plan_event("n2", "5-1-2", "running"))
    assert kv is not None and json.loads(kv.value)["node"] == "n2"
    # the agent writes "restored" itself; a client may not
    bad = agent.ask(OWNER, **event, phase="restored")
    assert bad["ok"] is False and \
        "'launched', 'launch_failed', 'running', 'caught_up' or 'checkpointed'" \
        in str(bad["error"])
    assert agent.ask(OWNER, **{**event, "epoch": 3}, phase="caught_up")["kind"] == "epoch"
    assert agent.ask(OWNER, **event, phase="caught_up")["recorded"] is True
    big = agent.ask(OWNER, **{**event, "detail": {"x": "y" * 5000}}, phase="running")
    assert big["ok"] is False and "4 KiB" in str(big["error"])
    # a plan given up takes no more reports
    agent.store.put(k.plan("5-1-2"), advance(plan, "escalated", 2.0).to_json())
    agent.store.delete(k.plan_event("n2", "5-1-2", "running"))
    assert agent.ask(OWNER, **event, phase="running")["recorded"] is False


def test_step_restarts_are_stamped_by_the_agent_for_the_current_run_only(
        agent: Agent) -> None:
    step = {"op": "job_step", "job": "5", "run": 0}
    before = time.time()
    assert agent.ask(OWNER, **step, phase="stopping") == {"ok": True}
    kv = agent.store.get(agent.keys.job_step("n2", "5", 0))
    assert kv is not None
    first = json.loads(kv.value)
    assert first["started_at"] is None and first["stopping_at"] >= before
    assert agent.ask(OWNER, **step, phase="started") == {"ok": True}
    kv = agent.store.get(agent.keys.job_step("n2", "5", 0))
    assert kv is not None
    both = json.loads(kv.value)
    assert both["stopping_at"] == first["stopping_at"] <= both["started_at"]
    assert agent.ask(OTHER, **step, phase="started")["kind"] == "permission"
    assert agent.ask(OWNER, **{**step, "run": 1}, phase="started")["kind"] == "run"
    bad = agent.ask(OWNER, **step, phase="paused")
    assert bad["ok"] is False and "'stopping' or 'started'" in str(bad["error"])
