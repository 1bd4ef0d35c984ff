"""The metrics the alerting rules (slurm/prometheus/raps.rules.yml) watch move with what
the leader sees: dead nodes, under-replicated newest checkpoints, escalations, the etcd
quota. A coordinator cycle on a MemoryStore with a fake clock; the values are read back
from the coordinator's own Prometheus registry."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from raps_slurm.config import parse_config
from raps_slurm.coordinator.cycle import Coordinator
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.hygiene import Hygiene
from raps_slurm.coordinator.metrics import Metrics
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import JobRecord, JobSpec
from raps_slurm.model import Switch, Topology
from raps_slurm.store import Keys, MemoryStore
from raps_slurm.testing import FakeClock

NODES = ("n1", "n2", "n3", "n4")
TOPOLOGY = Topology({"r1": Switch("r1", 0, frozenset(NODES[:2])),
                     "r2": Switch("r2", 0, frozenset(NODES[2:])),
                     "root": Switch("root", 1, frozenset(NODES), ("r1", "r2"))})
CFG = parse_config({"coordinator": {"metrics_address": ""},
                    "store": {"space_quota_bytes": 8 * 2**20, "compaction_interval_sec": 1}})


class Leader:
    """A leading coordinator, the dead nodes it is told of, and its metrics."""

    def __init__(self, store: MemoryStore, clock: FakeClock) -> None:
        self.store, self.clock, self.keys = store, clock, Keys()
        self.dead: set[str] = set()
        self.metrics = Metrics(None)
        self.lead = Leadership(store, self.keys.leader(), 10, {"name": "c1"}, clock=clock)
        self.coordinator = Coordinator(CFG, store, self.keys, self.lead,
                                       topology=lambda: TOPOLOGY,
                                       job_states=lambda: {"7": "RUNNING", "8": "RUNNING"},
                                       metrics=self.metrics, name="c1", clock=clock,
                                       monotonic=clock, dead_nodes=lambda: set(self.dead))

    def cycle(self) -> str:
        status = self.coordinator.run_cycle()
        assert status.startswith("leader:"), status
        return status

    def value(self, name: str) -> float:
        got = self.metrics.registry.get_sample_value(name)
        assert got is not None, name
        return got


@pytest.fixture
def leader() -> Iterator[Leader]:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    yield Leader(store, clock)
    store.close()


def register(leader: Leader, job: str) -> None:
    rec = JobRecord(job, 0, 1000, NODES[:2], JobSpec(spares=1), registered_at=leader.clock())
    leader.store.put(leader.keys.job(job), rec.to_json())


def checkpoint(leader: Leader, job: str, rank: int, gen: int, holders: tuple[str, ...]) -> None:
    rec = CkptRecord(rank, gen, 1, "d" * 64, 100, 50, 1, "w" * 64, "n1", (), 1,
                     "under_replicated", leader.clock()).with_holders(holders)
    leader.store.put(leader.keys.ckpt(job, rank, gen), rec.to_json())


def test_dead_nodes_gauge_follows_the_leaders_view(leader: Leader) -> None:
    leader.cycle()
    assert leader.value("raps_coordinator_nodes_dead") == 0
    leader.dead |= {"n3", "n4"}
    leader.cycle()
    assert leader.value("raps_coordinator_nodes_dead") == 2
    leader.dead.discard("n3")
    leader.cycle()
    assert leader.value("raps_coordinator_nodes_dead") == 1


def test_under_replicated_counts_ranks_by_their_newest_generation(leader: Leader) -> None:
    register(leader, "7")
    checkpoint(leader, "7", 0, 1, ("n1",))            # gen 1 under-replicated...
    checkpoint(leader, "7", 0, 2, ("n1", "n3"))       # ...but gen 2 has its copy
    checkpoint(leader, "7", 1, 1, ("n2",))            # rank 1: only the primary
    leader.cycle()
    assert leader.value("raps_coordinator_ckpt_under_replicated") == 1
    checkpoint(leader, "7", 1, 2, ("n2", "n4"))
    leader.cycle()
    assert leader.value("raps_coordinator_ckpt_under_replicated") == 0
    checkpoint(leader, "7", 0, 3, ("n1",))
    leader.cycle()
    assert leader.value("raps_coordinator_ckpt_under_replicated") == 1
    ended = JobRecord("7", 0, 1000, NODES[:2], JobSpec(spares=1)).ended(leader.clock(), 0)
    leader.store.put(leader.keys.job("7"), ended.to_json())  # not running: not counted
    leader.cycle()
    assert leader.value("raps_coordinator_ckpt_under_replicated") == 0


def escalate(leader: Leader, job: str, run: int, requeued: bool = False) -> None:
    leader.store.put(leader.keys.job_escalation(job), json.dumps(
        {"run": run, "reason": "test", "at": leader.clock(),
         "requeued_at": leader.clock() if requeued else None}).encode())


def test_escalations_count_once_per_job_run_and_not_those_found_at_start(
        leader: Leader) -> None:
    register(leader, "7")
    register(leader, "8")
    escalate(leader, "8", 0)                          # there before this leader's first cycle
    leader.cycle()
    assert leader.value("raps_coordinator_escalations_total") == 0
    escalate(leader, "7", 0)
    leader.cycle()
    assert leader.value("raps_coordinator_escalations_total") == 1
    escalate(leader, "7", 0, requeued=True)           # the same escalation, marked requeued
    leader.cycle()
    assert leader.value("raps_coordinator_escalations_total") == 1
    escalate(leader, "7", 1)                          # the requeued run escalates too
    leader.store.put(leader.keys.job_escalation("9"), b"not json")  # ignored, not fatal
    leader.cycle()
    assert leader.value("raps_coordinator_escalations_total") == 2


def test_quota_gauge_beside_the_database_size(leader: Leader) -> None:
    hygiene = Hygiene(CFG, leader.store, leader.lead, leader.metrics, monotonic=leader.clock)
    leader.cycle()                                    # leads
    hygiene.step()
    assert leader.value("raps_etcd_quota_bytes") == 8 * 2**20
    assert leader.value("raps_etcd_db_bytes") > 0
