"""The node as the unit of placement and recovery, and requeues that cannot loop: maps
that skip DEAD nodes, per-node backup groups, a dead node's ranks moved together under
the bound, requeued runs that exclude dead nodes or ask for fewer, and giving up after
``recovery.max_requeues`` (pure parts, then the leader's pass on the in-memory store)."""

from __future__ import annotations

import pytest
from leader_world import NODES, TOPOLOGY, World, step

from raps_slurm.coordinator.deadnodes import DeadNodes
from raps_slurm.coordinator.recovery import GIVE_UP_GRACE_SEC
from raps_slurm.core import requeue
from raps_slurm.core.jobs import JobRecord, JobSpec, RankMap, build_map, node_fitness
from raps_slurm.core.planner import PlanEvent
from raps_slurm.core.requeue import EscalationRecord
from raps_slurm.errors import RecordError
from raps_slurm.registry import job_view
from raps_slurm.slurm import commands


def record(nodes: tuple[str, ...] = NODES, spares: int = 2, per_node: int = 3,
           run: int = 0) -> JobRecord:
    return JobRecord("7", run, 1000, nodes, JobSpec(spares=spares, ranks_per_node=per_node))


# -- maps -------------------------------------------------------------------------------

def test_a_nodes_ranks_share_one_backup_group() -> None:
    plan = build_map(record(), TOPOLOGY, default_replicas=2, now=0.0)
    assert not plan.rank_map.error
    assert len(plan.entries) == 12 and len(set(plan.rank_map.nodes)) == 4
    by_node: dict[str, set[tuple[str | None, tuple[str, ...]]]] = {}
    for entry, group in zip(plan.entries, plan.groups, strict=True):
        assert group.rank == entry.rank and group.primary == entry.node
        by_node.setdefault(entry.node, set()).add((group.log_backup, group.ckpt_mirrors))
    assert all(len(shapes) == 1 for shapes in by_node.values()), by_node
    for shapes in by_node.values():
        (log, mirrors), = shapes
        assert log is not None and len(mirrors) == 1


def test_a_dead_node_gets_no_ranks_and_the_run_has_a_spare_fewer() -> None:
    plan = build_map(record(), TOPOLOGY, default_replicas=2, now=0.0, dead={"n3"})
    m = plan.rank_map
    assert not m.error
    assert "n3" not in m.nodes and "n3" not in m.spares
    assert len(m.nodes) == 12 and len(set(m.nodes)) == 4 and len(m.spares) == 1
    for entry in plan.entries:
        assert "n3" not in entry.spares
    # Three dead: four nodes needed for 12 ranks, three left.
    plan = build_map(record(), TOPOLOGY, default_replicas=2, now=0.0, dead={"n3", "n4", "n5"})
    assert plan.rank_map.error == ("12 ranks at 3 per node need 4 nodes, but only 3 of the "
                                   "6 allocated are usable (n3,n4,n5 under a DEAD verdict)")


def test_node_fitness_keeps_ranks_off_nodes_whose_agent_is_gone_or_draining() -> None:
    unfit, doubtful = node_fitness(
        NODES, dead={"n1"}, registered={"n2", "n3", "n4", "n5"}, suspect={"n3"},
        draining={"n5": ("nvme0 temp 72C > 70C", 100.0), "n4": ("fan", 50.0)}, since=100.0)
    # n1 is dead (build_map's own case), n6 has no registration, n5 drains for health
    assert unfit == {"n6": "no live agent", "n5": "draining (nvme0 temp 72C > 70C)"}
    # n4 was drained before the run registered: Slurm allocated it, an admin resumed it
    assert doubtful == {"n3": "SUSPECT"}
    # Registrations not read yet: no node is unfit for lack of one.
    assert node_fitness(NODES, dead=(), registered=None, suspect=(), draining={},
                        since=0.0) == ({}, {})


def test_an_unfit_node_gets_no_ranks_and_is_a_spare_that_holds_no_backup() -> None:
    # The case of issue 44: n5's agent is gone, the job asked 2 spares of 6 nodes.
    plan = build_map(record(), TOPOLOGY, default_replicas=2, now=0.0,
                     unfit={"n5": "no live agent"})
    m = plan.rank_map
    assert not m.error
    assert "n5" not in m.nodes and len(m.nodes) == 12 and len(set(m.nodes)) == 4
    assert "n5" in m.spares and len(m.spares) == 2
    for entry, group in zip(plan.entries, plan.groups, strict=True):
        assert "n5" not in (group.log_backup, *group.ckpt_mirrors)
        assert entry.spares[-1] == "n5"  # last: taken only once its agent is back
    # With n5 and n6 unfit too few good nodes are left: the error says why.
    plan = build_map(record(spares=1), TOPOLOGY, default_replicas=2, now=0.0, dead={"n1"},
                     unfit={"n5": "no live agent", "n6": "draining (fan)"})
    assert plan.rank_map.error == (
        "15 ranks at 3 per node need 5 nodes, but only 3 of the 6 allocated are usable "
        "(n1 under a DEAD verdict; n5: no live agent; n6: draining (fan))")


def test_a_doubtful_node_runs_ranks_only_when_the_good_ones_are_too_few() -> None:
    plan = build_map(record(), TOPOLOGY, default_replicas=2, now=0.0,
                     doubtful={"n3": "SUSPECT"})
    assert "n3" not in plan.rank_map.nodes and "n3" in plan.rank_map.spares
    # No spare asked: every node runs ranks, the doubtful one included, rather than none.
    plan = build_map(record(spares=0), TOPOLOGY, default_replicas=2, now=0.0,
                     doubtful={"n3": "SUSPECT", "n4": "SUSPECT"},
                     unfit={"n6": "no live agent"})
    assert plan.rank_map.error.startswith("18 ranks at 3 per node need 6 nodes, but only 5")
    plan = build_map(record(spares=1), TOPOLOGY, default_replicas=2, now=0.0,
                     doubtful={"n3": "SUSPECT", "n4": "SUSPECT"},
                     unfit={"n6": "no live agent"})
    m = plan.rank_map
    assert not m.error and set(m.nodes) == {"n1", "n2", "n3", "n4", "n5"}
    assert m.spares == ("n6",)
    plan = build_map(record(spares=2), TOPOLOGY, default_replicas=2, now=0.0,
                     doubtful={"n3": "SUSPECT", "n4": "SUSPECT"},
                     unfit={"n6": "no live agent"})
    # one doubtful node needed: the first by name
    assert set(plan.rank_map.nodes) == {"n1", "n2", "n3", "n5"}
    assert plan.rank_map.spares == ("n4", "n6")


def test_a_requeued_run_on_fewer_nodes_keeps_its_ranks() -> None:
    first = build_map(record(), TOPOLOGY, default_replicas=2, now=0.0)
    epochs = {e.rank: e.epoch for e in first.entries}
    again = build_map(record(nodes=NODES[:5], run=1), TOPOLOGY, default_replicas=2, now=1.0,
                      previous_epochs=epochs)
    assert len(again.entries) == 12 and len(again.rank_map.spares) == 1
    assert {e.epoch for e in again.entries} == {2}


# -- requeue rules ------------------------------------------------------------------------

def test_give_up_after_max_requeues_within_the_window() -> None:
    prev = EscalationRecord(2, "x", 100.0, requeues=(10.0, 50.0, 100.0))
    assert requeue.give_up(prev, "dead", 120.0, 3, 3600) .startswith(
        "raps gave up after 3 whole-job requeues within 3600s (recovery.max_requeues=3)")
    assert requeue.give_up(prev, "dead", 120.0, 4, 3600) == ""
    # Old requeues fall out of the window.
    assert requeue.give_up(prev, "dead", 3655.0, 3, 3600) == ""
    assert requeue.give_up(None, "dead", 0.0, 0, 60).startswith("raps gave up after 0")
    rec = requeue.escalate(prev, 3, "node n6 is dead", 3655.0, max_requeues=3, window=3600)
    assert rec.requeues == (100.0,) and rec.gave_up == "" and rec.run == 3
    done = requeue.requeued(rec, 3656.0)
    assert done.requeues == (100.0, 3656.0) and done.requeued_at == 3656.0
    assert requeue.requeued(done, 4000.0) == done


def test_a_checkpoint_damaged_on_every_holder_gives_up_at_once() -> None:
    lost = requeue.escalate(None, 4, "damaged", 10.0, max_requeues=3, window=3600, lost=2)
    assert lost.lost == 2 and lost.gave_up.startswith(
        "rank 2's checkpoint is damaged on every holder: damaged;")
    assert "resubmit the job" in lost.gave_up
    reach = requeue.escalate(None, 4, "out of reach", 10.0, max_requeues=3, window=3600)
    assert reach.lost is None and reach.gave_up == ""


def test_requeue_shape_excludes_dead_nodes_and_lowers_the_count_only_when_needed() -> None:
    assert requeue.requeue_shape(NODES, 4, {"n6", "n9"}, available=8) == (("n6",), None)
    assert requeue.requeue_shape(NODES, 4, {"n6"}, available=5) == (("n6",), 5)
    assert requeue.requeue_shape(NODES, 4, {"n5", "n6"}, available=4) == (("n5", "n6"), 4)
    # Never fewer than the nodes that run ranks (the job then waits for one to return).
    assert requeue.requeue_shape(NODES, 4, {"n4", "n5", "n6"}, available=3) == (
        ("n4", "n5", "n6"), 4)
    assert requeue.requeue_shape(NODES, 6, set(), available=2) == ((), None)


def test_escalation_records_round_trip_and_bad_ones_are_named() -> None:
    rec = EscalationRecord(1, "why", 5.0, 6.0, None, (6.0,), "", ("n6",), 5)
    assert EscalationRecord.from_json("k", rec.to_json()) == rec
    lost = EscalationRecord(1, "why", 5.0, lost=3)
    assert EscalationRecord.from_json("k", lost.to_json()).lost == 3
    old = b'{"run": 0, "reason": "r", "at": 1.0, "requeued_at": null}'  # before this version
    assert EscalationRecord.from_json("k", old).requeues == ()
    for raw, field_ in [(b'{"run": -1, "at": 1}', "'run'"), (b'{"run": 0}', "'at'"),
                        (b'{"run": 0, "at": 1, "requeues": ["x"]}', "'requeues'"),
                        (b'{"run": 0, "at": 1, "num_nodes": 0}', "'num_nodes'"),
                        (b'{"run": 0, "at": 1, "exclude": [1]}', "'exclude'"),
                        (b'{"run": 0, "at": 1, "lost": true}', "'lost'"),
                        (b'{"run": 0, "at": 1, "lost": -1}', "'lost'")]:
        with pytest.raises(RecordError, match=field_):
            EscalationRecord.from_json("k", raw)
    with pytest.raises(RecordError, match="not JSON"):
        EscalationRecord.from_json("k", b"{")


def test_update_pending_argv() -> None:
    assert commands.update_pending(7, ["n6", "n5"], 4) == [
        "scontrol", "update", "JobId=7", "ExcNodeList=n[5-6]", "NumNodes=4"]
    assert commands.update_pending(7, None, 4) == ["scontrol", "update", "JobId=7", "NumNodes=4"]
    assert commands.update_pending(7, [], None) == [
        "scontrol", "update", "JobId=7", "ExcNodeList="]  # no node excluded any more
    with pytest.raises(ValueError, match="nothing to change"):
        commands.update_pending(7, None, None)
    with pytest.raises(ValueError, match="num_nodes"):
        commands.update_pending(7, ["n1"], 0)


# -- the leader's pass ----------------------------------------------------------------------

@pytest.fixture
def world_ranks_per_node() -> int:
    """Three ranks on each working node: a dead node's ranks move together."""
    return 3


def test_a_dead_nodes_three_ranks_move_together_to_one_spare(world: World) -> None:
    c = world.coordinator()
    step(c, world)  # 12 ranks on n1 n3 n5 n6 (3 each), spares n2 n4
    victims = [r for r in range(12) if world.entry(r).node == "n6"]
    assert len(victims) == 3
    world.dead = {"n6"}
    step(c, world, 2)
    plans = world.plans()
    assert sorted(plans) == sorted(f"7-{r}-2" for r in victims)
    assert set(plans.values()) == {"running"}
    targets = set(world.targets().values())
    assert len(targets) == 1 and targets <= {"n2", "n4"}
    assert {world.entry(r).node for r in victims} == targets
    # the entry keeps where each rank ran before: a restore checks its commits against it
    assert {world.entry(r).placed for r in victims} == {((1, "n6"),)}
    assert world.requeued == []


def test_two_dead_nodes_are_two_moves_under_the_bound(world: World) -> None:
    c = world.coordinator(max_concurrent=1)
    step(c, world)
    world.dead = {"n5", "n6"}  # one rack: 6 ranks, both spares needed
    step(c, world, 3)
    plans, targets = world.plans(), world.targets()
    assert len(plans) == 6
    running = {pid for pid, s in plans.items() if s == "running"}
    queued = {pid for pid, s in plans.items() if s == "queued"}
    assert len(running) == 3 and len(queued) == 3  # one node at a time
    assert len({targets[p] for p in running}) == 1
    for pid in running:
        world.store.put(world.keys.plan_event("n2", pid, "restored"),
                        PlanEvent(pid, "restored", world.clock(), "n2", {}).to_json())
    step(c, world, 3)
    assert set(world.plans().values()) == {"restored", "running"}
    assert len(set(world.targets().values())) == 2 and world.requeued == []


def test_a_dead_node_in_the_allocation_is_never_mapped_and_the_requeue_excludes_it(
        world: World) -> None:
    c = world.coordinator()
    world.dead = {"n3"}  # resumed in Slurm by an admin, its agent silent
    step(c, world)
    nodes = {world.entry(r).node for r in range(12)}
    assert "n3" not in nodes and len(nodes) == 4
    # The batch host dies: the job escalates; the requeue excludes both dead nodes, and
    # with 4 nodes left in the cluster it asks for 4 (one spare fewer is none left).
    world.dead = {"n3", "n1"}
    step(c, world, 2)
    assert world.requeued == ["7"]
    rec = world.escalation()
    assert rec.exclude == ("n1", "n3") and rec.num_nodes == 4
    world.state = "PENDING"
    step(c, world, 2)
    assert world.updated == [("7", ["n1", "n3"], 4)] and world.released == ["7"]
    # Slurm holds the run (too few nodes once both are excluded). n3's agent comes back:
    # the exclusion shrinks to n1, then to nothing once n1 is back too; started once.
    world.dead = {"n1"}
    step(c, world, 3)
    assert world.updated[1:] == [("7", ["n1"], None)] and world.released == ["7", "7"]
    assert world.escalation().exclude == ("n1",)
    world.dead = set()
    step(c, world, 3)
    assert world.updated[2:] == [("7", [], None)] and world.escalation().exclude == ()
    # once the requeued run is mapped, nothing more is asked of Slurm
    world.register(1)
    world.state = "RUNNING"
    step(c, world, 3)
    assert len(world.updated) == 3 and len(world.released) == 3


def test_the_leader_maps_no_rank_on_a_node_whose_agent_is_not_registered(
        world: World) -> None:
    """The case of issue 44 as the leader sees it in etcd: n5's agent stopped (its
    registration gone with its lease), no verdict needed. n5 becomes a spare that holds
    no backup; the job's 12 ranks run on 4 of the 5 others."""
    for n in NODES:
        if n != "n5":
            world.store.put(world.keys.node(n), b"{}")
    dead = DeadNodes(world.store, world.keys, every=0.0)
    c = world.coordinator(dead_nodes=dead)
    try:
        step(c, world)
        nodes = {world.entry(r).node for r in range(12)}
        assert "n5" not in nodes and len(nodes) == 4
        kv = world.store.get(world.keys.job_map("7"))
        assert kv is not None and "n5" in RankMap.from_json(kv.key, kv.value).spares
        groups = [world.store.get(world.keys.job_group("7", r)) for r in range(12)]
        assert all(g is not None and b"n5" not in g.value for g in groups)
    finally:
        dead.close()


def test_raps_gives_up_after_max_requeues_and_the_job_fails(world: World) -> None:
    c = world.coordinator(max_requeues=2)
    step(c, world)
    for run in range(3):
        world.dead = {"n1"}  # the batch host dies in every run
        step(c, world, 2)
        if run < 2:
            assert world.requeued == ["7"] * (run + 1)
            world.dead = set()
            world.register(run + 1)
            world.state = "PENDING"
            step(c, world, 2)
            world.state = "RUNNING"
            step(c, world, 2)
    assert world.requeued == ["7", "7"]  # no third requeue
    rec = world.escalation()
    assert rec.run == 2 and rec.gave_up.startswith("raps gave up after 2 whole-job requeues")
    assert world.cancelled == []  # raps-run ends the job first
    shown = job_view(world.store, world.keys, "7")["escalation"]
    assert shown["gave_up"] == rec.gave_up and shown["requeues"] == 2
    world.clock.advance(GIVE_UP_GRACE_SEC)
    step(c, world, 3)
    assert world.cancelled == ["7"]  # still running: cancelled, once
