"""The leader's pass on the in-memory store, shared by test_recovery_pass.py and
test_node_plans.py: a 6-node, 3-rack world with job 7 registered, a coordinator whose
Slurm actions are recorded instead of run, and ``step`` to run its cycles.

Imported by basename (pytest puts this directory on ``sys.path``); the ``world`` fixture
is in conftest.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from raps_slurm.config import parse_config
from raps_slurm.coordinator.cycle import Coordinator
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.recovery import Recovery, read_plans
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry
from raps_slurm.core.planner import PlanEvent
from raps_slurm.core.requeue import EscalationRecord
from raps_slurm.model import JobInfo, Switch, Topology
from raps_slurm.store import Keys, MemoryStore
from raps_slurm.testing import FakeClock

NODES = ("n1", "n2", "n3", "n4", "n5", "n6")
RACKS = {"r1": ["n1", "n2"], "r2": ["n3", "n4"], "r3": ["n5", "n6"]}
TOPOLOGY = Topology({**{r: Switch(r, 0, frozenset(n)) for r, n in RACKS.items()},
                     "root": Switch("root", 1, frozenset(NODES), tuple(RACKS))})


@dataclass
class World:
    """Job 7 on NODES with 2 spares and ``ranks_per_node`` ranks per working node; what
    the leader asked of Slurm lands in the lists."""

    clock: FakeClock
    store: MemoryStore
    keys: Keys
    ranks_per_node: int = 1
    dead: set[str] = field(default_factory=set)
    requeued: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    updated: list[tuple[str, list[str], int | None]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[frozenset[tuple[str, int]]] = field(default_factory=list)
    placed: list[frozenset[str]] = field(default_factory=list)  # what each cycle placed
    state: str = "RUNNING"
    batch_host: str = "n1"
    steps: dict[int, int] = field(default_factory=dict)  # rank -> its last reported step

    def coordinator(self, name: str = "c1", max_concurrent: int = 4,
                    max_requeues: int = 3,
                    dead_nodes: Callable[[], set[str]] | None = None) -> Coordinator:
        """A coordinator named ``name`` on this world's store and clock; what it holds
        dead is ``self.dead`` unless ``dead_nodes`` (e.g. a DeadNodes on the store)."""
        cfg = parse_config({"coordinator": {"leader_lease_sec": 10, "metrics_address": ""},
                            "recovery": {"max_concurrent_recoveries": max_concurrent,
                                         "recovery_timeout_sec": 60,
                                         "max_requeues": max_requeues,
                                         "requeue_window_sec": 600}})
        lead = Leadership(self.store, self.keys.leader(), 10, {"name": name}, clock=self.clock)
        c = Coordinator(cfg, self.store, self.keys, lead, topology=lambda: TOPOLOGY,
                        job_states=lambda: {"7": self.state}, name=name, clock=self.clock,
                        monotonic=self.clock,
                        dead_nodes=dead_nodes or (lambda: set(self.dead)),
                        finished_ranks=self.finished.append,
                        placed_nodes=self.placed.append)
        c.recovery = Recovery(
            cfg, self.store, self.keys, lead, job_info=self.info,
            requeue=self.requeued.append, start_now=self.released.append,
            update_pending=lambda job, exclude, n: self.updated.append((job, exclude, n)),
            cancel=self.cancelled.append, step_of=lambda job, rank: self.steps.get(rank),
            clock=self.clock)
        return c

    def info(self, job: str) -> JobInfo:
        return JobInfo(int(job), "j", 0, self.state, NODES, batch_host=self.batch_host)

    def register(self, run: int, nodes: tuple[str, ...] = NODES) -> None:
        """Job 7's record for run ``run`` (what the Slurm prolog writes)."""
        self.store.put(self.keys.job("7"), JobRecord(
            "7", run, 1000, nodes, JobSpec(spares=2, ranks_per_node=self.ranks_per_node),
            registered_at=self.clock()).to_json())

    def plans(self) -> dict[str, str]:
        """plan id -> state."""
        return {pid: p.state for pid, (p, _) in read_plans(self.store, self.keys).plans.items()}

    def targets(self) -> dict[str, str]:
        """plan id -> target node."""
        return {pid: p.target for pid, (p, _) in read_plans(self.store, self.keys).plans.items()}

    def entry(self, rank: int) -> RankEntry:
        kv = self.store.get(self.keys.job_rank("7", rank))
        assert kv is not None
        return RankEntry.from_json(kv.key, kv.value)

    def escalation(self) -> EscalationRecord:
        kv = self.store.get(self.keys.job_escalation("7"))
        assert kv is not None
        return EscalationRecord.from_json(kv.key, kv.value)

    def report(self, pid: str, phase: str, node: str) -> None:
        """A launcher's report of ``phase`` for plan ``pid`` from ``node``."""
        self.store.put(self.keys.plan_event(node, pid, phase),
                       PlanEvent(pid, phase, self.clock(), node, {}).to_json())


def new_world(ranks_per_node: int = 1) -> World:
    """A world with job 7's first run registered."""
    clock = FakeClock()
    w = World(clock, MemoryStore(clock=clock), Keys(), ranks_per_node=ranks_per_node)
    w.register(0)
    return w


def step(c: Coordinator, world: World, n: int = 1) -> None:
    """``n`` cycles of ``c``, 0.2 s of the world's clock after each."""
    for _ in range(n):
        c.run_cycle()
        world.clock.advance(0.2)
