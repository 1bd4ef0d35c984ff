"""Failure history, domain scores and the weight reconciliation (pure), and the leader's
weights pass on the in-memory store with a recording stand-in for Slurm."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from raps_slurm.config import parse_config
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.weights import Weights, read_weights, record_event
from raps_slurm.core.history import (
    FailureEvent,
    WeightRecord,
    domain_health,
    expired,
    node_scores,
    reconcile,
    score,
    target_weight,
)
from raps_slurm.errors import RecordError
from raps_slurm.model import NodeInfo, NodeState, Switch, Topology
from raps_slurm.store import Keys, MemoryStore
from raps_slurm.testing import FakeClock

RACKS = {"r1": ("n1", "n2"), "r2": ("n3", "n4"), "r3": ("n5", "n6")}
TOPOLOGY = Topology({**{r: Switch(r, 0, frozenset(n)) for r, n in RACKS.items()},
                     "root": Switch("root", 1, frozenset(), tuple(RACKS))})
H = 3600.0


def ev(kind: str, node: str, at: float) -> FailureEvent:
    return FailureEvent(kind, node, at, "test")


def test_score_decays_back() -> None:
    events = [ev("DEAD", "n1", 0.0)]
    fresh = domain_health(events, RACKS, 0.0, 168 * H, 24 * H)["r1"]
    assert fresh.failures == {"DEAD": 1, "HUNG": 0, "DRAIN": 0}
    assert fresh.score == pytest.approx(0.5)
    day = domain_health(events, RACKS, 24 * H, 168 * H, 24 * H)["r1"]
    assert day.score == pytest.approx(score(0.5))
    gone = domain_health(events, RACKS, 200 * H, 168 * H, 24 * H)["r1"]
    assert gone.score == 1.0 and gone.failures["DEAD"] == 0
    assert expired(events, 200 * H, 168 * H) == events
    assert domain_health(events, RACKS, 0.0, 168 * H, 24 * H)["r2"].score == 1.0


def test_node_score_adds_its_own_and_its_racks() -> None:
    events = [ev("DEAD", "n1", 0.0), ev("HUNG", "n5", 0.0)]
    s = node_scores(events, RACKS, 0.0, 168 * H, 24 * H)
    assert s["n1"] == pytest.approx(score(2.0))      # its own failure and its rack's
    assert s["n2"] == pytest.approx(score(1.0))      # its rack's
    assert s["n6"] == pytest.approx(score(0.25))     # a hung rank weighs a quarter
    assert s["n3"] == 1.0


def test_target_weight_moves_in_steps() -> None:
    assert target_weight(1, 1.0, 100, 10) == 1
    assert target_weight(1, 0.95, 100, 10) == 1
    assert target_weight(1, 0.5, 100, 10) == 501
    assert target_weight(7, 0.0, 100, 10) == 1007
    assert target_weight(4_294_967_000, 0.0, 100, 10) == 4_294_967_280


def test_event_record_round_trip_and_bad_values() -> None:
    e = ev("DRAIN", "n2", 12.5)
    assert FailureEvent.from_json("k", e.to_json()) == e
    with pytest.raises(RecordError, match="kind"):
        FailureEvent.from_json("k", b'{"kind": "BORED", "node": "n1", "at": 1, "reason": ""}')
    with pytest.raises(RecordError):
        WeightRecord.from_json("k", b'{"node": "n1", "base": -1, "applied": 3, "at": 0}')


SCORES = {"n1": 0.2, "n2": 0.5, "n3": 1.0}


@pytest.mark.parametrize(("current", "owned", "expect"), [
    # a sick node gets a weight and a record
    ({"n1": 1}, {}, [("n1", 801, (1, 801))]),
    # already ours and right: nothing to do
    ({"n1": 801}, {"n1": WeightRecord("n1", 1, 801, 0)}, []),
    # reset by reconfigure (shows the base again): applied again
    ({"n1": 1}, {"n1": WeightRecord("n1", 1, 801, 0)}, [("n1", 801, (1, 801))]),
    # changed by an admin: left alone, record dropped
    ({"n1": 42}, {"n1": WeightRecord("n1", 1, 801, 0)}, [("n1", None, None)]),
    # healthy node never owned: untouched
    ({"n3": 9}, {}, []),
    # recovered: base back, record dropped
    ({"n3": 501}, {"n3": WeightRecord("n3", 1, 501, 0)}, [("n3", 1, None)]),
    # the score moved within a level set: new weight over the same base
    ({"n2": 801}, {"n2": WeightRecord("n2", 1, 801, 0)}, [("n2", 501, (1, 501))]),
])
def test_reconcile(current: dict[str, int], owned: dict[str, WeightRecord],
                   expect: list[tuple[str, int | None, tuple[int, int] | None]]) -> None:
    got = reconcile(current, owned, SCORES, 100, 10, now=5.0)
    assert [(a.node, a.weight, None if a.record is None else (a.record.base, a.record.applied))
            for a in got] == expect


def test_a_pinned_node_is_never_touched_and_its_record_dropped() -> None:
    # n1 is in the failing rack: unpinned it would get 801, pinned it keeps the admin's 42
    assert reconcile({"n1": 42}, {}, SCORES, 100, 10, now=5.0, pinned={"n1"}) == []
    got = reconcile({"n1": 801}, {"n1": WeightRecord("n1", 1, 801, 0)}, SCORES, 100, 10,
                    now=5.0, pinned={"n1"})
    assert [(a.node, a.weight, a.record) for a in got] == [("n1", None, None)]
    assert "pinned" in got[0].why


@dataclass
class Slurm:
    weights: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        [n for ns in RACKS.values() for n in ns], 1))
    calls: list[tuple[str, int]] = field(default_factory=list)

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo(n, NodeState.IDLE, weight=w) for n, w in sorted(self.weights.items())]

    def set_weight(self, node: str, weight: int) -> None:
        self.calls.append((node, weight))
        self.weights[node] = weight


@dataclass
class World:
    clock: FakeClock
    store: MemoryStore
    keys: Keys
    slurm: Slurm
    lead: Leadership
    weights: Weights


def later(w: World, seconds: float) -> None:
    """Time passes; the leader keeps its lease as the coordinator's cycle does."""
    while seconds > 0:
        w.clock.advance(min(seconds, 2.0))
        seconds -= 2.0
        assert w.lead.step()


@pytest.fixture
def world() -> Iterator[World]:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    keys = Keys()
    cfg = parse_config({"system": {"weight_reconcile_sec": 5, "history_window_h": 1,
                                   "score_half_life_h": 1}})
    lead = Leadership(store, keys.leader(), 10, {"name": "a"}, clock=clock)
    assert lead.step()
    slurm = Slurm()
    w = Weights(cfg, store, keys, lead, nodes=slurm.nodes, topology=lambda: TOPOLOGY,
                set_weight=slurm.set_weight, clock=clock, monotonic=clock)
    yield World(clock, store, keys, slurm, lead, w)
    store.close()


def test_three_failures_in_a_rack_raise_its_weights(world: World) -> None:
    for node in ("n1", "n2", "n1"):
        record_event(world.lead, world.keys, ev("DEAD", node, world.clock()))
        later(world, 1)
    world.weights.step()
    w = world.slurm.weights
    assert w["n1"] > w["n2"] > 1 and w["n3"] == w["n5"] == 1
    owned, _ = read_weights(world.store, world.keys)
    assert set(owned) == {"n1", "n2"}
    # scontrol reconfigure: Slurm shows the configured weights again
    world.slurm.weights.update(n1=1, n2=1)
    later(world, 2)
    assert world.weights.step() == []          # not due yet
    later(world, 3)
    world.weights.step()
    assert w["n1"] > w["n2"] > 1
    # an admin's weight is left alone
    world.slurm.weights["n2"] = 7
    later(world, 5)
    world.weights.step()
    assert w["n2"] == 7 and "n2" not in read_weights(world.store, world.keys)[0]
    # the history window passes: events deleted, n1 back to its base
    later(world, 2 * H)
    lines = world.weights.step()
    assert any("deleted" in line for line in lines)
    assert w["n1"] == 1 and w["n2"] == 7
    assert read_weights(world.store, world.keys)[0] == {}
    assert world.store.get_prefix(world.keys.history_prefix()) == []


def test_standby_touches_nothing(world: World) -> None:
    record_event(world.lead, world.keys, ev("DEAD", "n1", world.clock()))
    world.lead.resign()
    assert world.weights.step() == []
    assert world.slurm.calls == []


def test_malformed_history_is_skipped_not_deleted(world: World) -> None:
    bad_key = world.keys.history_event("n3", "garbage")
    world.store.put(bad_key, b"{not json")
    record_event(world.lead, world.keys, ev("DEAD", "n1", world.clock()))
    world.weights.step()
    assert world.slurm.weights["n1"] > 1
    assert world.store.get(bad_key) is not None


def test_boost_pass_adds_and_drops_a_mirror(world: World) -> None:
    from raps_slurm.core.jobs import JobRecord, JobSpec, RankMap, group_from_json, group_to_json
    from raps_slurm.model import BackupGroup

    nodes = ("n1", "n3", "n5")
    world.store.put(world.keys.job("7"), JobRecord("7", 0, 0, (*nodes, "n2", "n4"),
                                                   JobSpec(spares=2)).to_json())
    world.store.put(world.keys.job_map("7"),
                    RankMap("7", 0, nodes, ("n2", "n4"), 2).to_json())
    # rank 0's group uses racks r1 and r2 only: r3 (n5), a rack it does not use, is preferred
    groups = {0: BackupGroup(0, "n1", "n3", ("n4",)), 1: BackupGroup(1, "n3", "n5", ("n1",)),
              2: BackupGroup(2, "n5", "n1", ("n3",))}
    for r, g in groups.items():
        world.store.put(world.keys.job_group("7", r), group_to_json(g))

    def read(rank: int) -> BackupGroup:
        kv = world.store.get(world.keys.job_group("7", rank))
        assert kv is not None
        return group_from_json(kv.key, kv.value, rank)

    for node in ("n1", "n2"):  # two failures in rack r1: score 1/3
        record_event(world.lead, world.keys, ev("DEAD", node, world.clock()))
    lines = world.weights.step()
    assert "job 7 rank 0: extra mirror n5 (rack r1 score 0.33)" in lines, lines
    assert read(0).ckpt_mirrors == ("n4", "n5")
    assert read(1) == groups[1] and read(2) == groups[2]
    world.store.delete_prefix(world.keys.history_prefix())  # the failures leave the window
    later(world, 6)
    lines = world.weights.step()
    assert any("job 7 rank 0: extra mirror dropped" in line for line in lines), lines
    assert read(0) == groups[0]
