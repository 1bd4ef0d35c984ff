"""Recovery planning: targets, escalation, the bounded queue, timeouts, plan records."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from raps_slurm.core.planner import (
    Escalation,
    Plan,
    PlanEvent,
    RankSite,
    advance,
    choose_target,
    move_of,
    overdue,
    plan_dead_node,
    plan_hung_rank,
    to_start,
)
from raps_slurm.errors import RecordError

RACKS = {"r1": {"n1", "n2"}, "r2": {"n3", "n4"}, "r3": {"n5", "n6"}}
SITES = [RankSite(0, "n1", 1, ("n2", "n4", "n6")), RankSite(1, "n1", 1, ("n2", "n4", "n6")),
         RankSite(2, "n3", 1, ("n4", "n2", "n6"))]


def target(site: RankSite, **kw: object) -> str | None:
    args: dict[str, object] = {"dead": {site.node}, "unhealthy": set(), "taken": set(),
                               "racks": RACKS, "prefer_original_rack": False,
                               "holders": set()}
    args.update(kw)
    return choose_target(site, **args)  # type: ignore[arg-type]


def test_target_leaves_the_dead_rack_unless_preferred_and_healthy() -> None:
    assert target(SITES[0]) == "n4"
    assert target(SITES[0], prefer_original_rack=True) == "n2"
    # the home rack has another sick node: not healthy, so leave it
    assert target(SITES[0], prefer_original_rack=True, unhealthy={"n2"}) == "n4"


def test_target_prefers_a_spare_holding_the_checkpoint() -> None:
    assert target(SITES[0], holders={"n6"}) == "n6"
    assert target(SITES[0], holders={"n6"}, unhealthy={"n6"}) == "n4"


def test_no_usable_spare() -> None:
    assert target(SITES[0], dead={"n1", "n4", "n6"}) is None
    assert target(SITES[0], taken={"n4", "n6"}) is None  # n2 shares the dead rack


def test_a_dead_nodes_ranks_move_together_to_one_spare() -> None:
    got = plan_dead_node("7", "n1", SITES, batch_host="n3", dead={"n1"}, unhealthy=set(),
                         taken=set(), racks=RACKS, prefer_original_rack=False,
                         holders={}, sizes={0: 10, 1: 20}, now=5.0)
    assert isinstance(got, list)
    assert [(p.rank, p.target, p.epoch, p.restore_bytes) for p in got] == \
        [(0, "n4", 2, 10), (1, "n4", 2, 20)]
    assert {p.state for p in got} == {"queued"}
    assert len({move_of(p) for p in got}) == 1  # one move
    # The spare holding the checkpoints of most of the node's ranks is preferred.
    got = plan_dead_node("7", "n1", SITES, batch_host="n3", dead={"n1"}, unhealthy=set(),
                         taken=set(), racks=RACKS, prefer_original_rack=False,
                         holders={0: ("n6",), 1: ("n6", "n4")}, sizes={}, now=5.0)
    assert isinstance(got, list) and {p.target for p in got} == {"n6"}
    # One spare left is enough for a node's two ranks (per rank, this escalated).
    got = plan_dead_node("7", "n1", SITES, batch_host="n3", dead={"n1"}, unhealthy=set(),
                         taken={"n4"}, racks=RACKS, prefer_original_rack=False,
                         holders={}, sizes={}, now=5.0)
    assert isinstance(got, list) and {p.target for p in got} == {"n6"}


def test_escalations() -> None:
    kw = {"dead": {"n1"}, "unhealthy": set(), "taken": {"n6", "n4"}, "racks": RACKS,
          "prefer_original_rack": False, "holders": {}, "sizes": {}, "now": 0.0}
    got = plan_dead_node("7", "n1", SITES, batch_host="n3", **kw)  # type: ignore[arg-type]
    assert got == Escalation("7", "no usable spare node for the ranks of n1 (ranks 0,1) of job 7")
    got = plan_dead_node("7", "n3", SITES, batch_host="n3", **kw)  # type: ignore[arg-type]
    assert got == Escalation("7", "the batch script's node n3 is dead")


def test_the_bound_counts_node_moves_and_a_move_starts_whole() -> None:
    # Two dead nodes, 3 ranks each; a hung rank restarted in place on n5.
    a = [Plan(f"a{i}", "7", i, "n1", "n4", 2, "dead", 10, created_at=1.0) for i in range(3)]
    b = [Plan(f"b{i}", "7", 3 + i, "n3", "n6", 2, "dead", 30, created_at=1.0)
         for i in range(3)]
    h = [Plan("h", "7", 9, "n5", "n5", 2, "hung", 1, created_at=1.0)]
    every = a + b + h
    assert [p.plan_id for p in to_start(every, 1)] == ["b0", "b1", "b2"]
    assert [p.plan_id for p in to_start(every, 2)] == ["b0", "b1", "b2", "a0", "a1", "a2"]
    assert len(to_start(every, 3)) == 7
    started = [advance(p, "running", 2.0) if p in b else p for p in every]
    assert to_start(started, 1) == []              # one node recovering: the bound is full
    assert [p.plan_id for p in to_start(started, 2)] == ["a0", "a1", "a2"]
    # A move whose start was cut short (one plan started, two still queued) is finished
    # even with the bound full.
    part = [advance(b[0], "running", 2.0), b[1], b[2], *a]
    assert [p.plan_id for p in to_start(part, 1)] == ["b1", "b2"]


def test_queue_is_bounded_largest_first_and_restored_plans_free_their_slot() -> None:
    plans = [Plan(f"p{i}", "7", i, "n1", "n4", 2, "dead", size, created_at=float(i))
             for i, size in enumerate([5, 50, 20, 50])]
    first = to_start(plans, 2)
    assert [p.plan_id for p in first] == ["p1", "p3"]
    plans = [advance(p, "running", 1.0) if p in first else p for p in plans]
    assert to_start(plans, 2) == []
    # p1 is restored (it may now wait in replay for a neighbour): its slot is free
    plans = [advance(p, "restored", 2.0) if p.plan_id == "p1" else p for p in plans]
    assert [p.plan_id for p in to_start(plans, 2)] == ["p2"]


def test_overdue_and_hung() -> None:
    site = RankSite(3, "n5", 4, ())
    p = plan_hung_rank("9", site, 100, now=10.0)
    assert (p.source, p.target, p.epoch) == ("n5", "n5", 5)
    assert overdue([p], now=200.0, timeout=300) == []
    assert overdue([p], now=311.0, timeout=300) == [p]
    assert overdue([advance(p, "done", 20.0)], now=1e6, timeout=300) == []


def test_advance_is_idempotent_and_stamps_times() -> None:
    p = Plan("a", "7", 0, "n1", "n4", 2, "dead", 1, created_at=1.0)
    r = advance(p, "running", 2.0)
    assert r.started_at == 2.0 and advance(r, "running", 9.0) == r
    d = advance(advance(r, "restored", 3.0), "done", 4.0)
    assert (d.restored_at, d.finished_at, d.state) == (3.0, 4.0, "done")
    assert advance(d, "running", 5.0) == d  # never backwards


def test_plan_record_round_trip_and_strictness() -> None:
    p = advance(Plan("7-0-2", "7", 0, "n1", "n4", 2, "node n1 is dead", 123, created_at=1.5),
                "running", 2.5)
    assert Plan.from_json("k", p.to_json()) == p
    with pytest.raises(RecordError, match="field 'state'"):
        Plan.from_json("k", p.to_json().replace(b'"running"', b'"sleeping"'))
    with pytest.raises(RecordError, match="field 'job'"):
        Plan.from_json("k", p.to_json().replace(b'"job":"7"', b'"job":"../x"'))


def test_plan_follows_reported_phases_and_keeps_its_fields() -> None:
    from raps_slurm.core.planner import (
        PlanEvent,
        follow_events,
        plan_dict,
        taken_spares,
        timeline,
    )

    p = advance(Plan("7-2-2", "7", 2, "n3", "n4", 2, "node n3 is dead", 10, created_at=1.0,
                     run=1, detected_at=0.5), "running", 2.0)
    assert Plan.from_json("k", p.to_json()) == p
    restored = PlanEvent("7-2-2", "restored", 3.0, "n4",
                         {"generation": 4, "bytes_pulled": 99, "sources": ["n5"]})
    running = PlanEvent("7-2-2", "running", 4.0, "n4", {"step": 41})
    caught = PlanEvent("7-2-2", "caught_up", 6.0, "n4",
                       {"replayed": 6, "received": 8, "step": 44})
    assert PlanEvent.from_json("k", caught.to_json()) == caught
    half = follow_events(p, {"restored": restored})
    assert (half.state, half.restored_at) == ("restored", 3.0)
    # running again is not the end: the lost steps are still to be redone
    assert follow_events(half, {"restored": restored, "running": running}).state == "restored"
    every = {"restored": restored, "running": running, "caught_up": caught}
    done = follow_events(half, every)
    assert (done.state, done.finished_at) == ("done", 6.0)
    # a rank with nothing to restore reports only that it runs and caught up
    assert follow_events(p, {"running": running}).state == "restored"
    assert follow_events(p, {"running": running, "caught_up": caught}).state == "done"
    assert follow_events(Plan("q", "7", 0, "n1", "n2", 2, "x", 0), every).state == "queued"
    rows = timeline(done, every)
    assert [r[0] for r in rows] == ["fault verdict", "plan", "start", "restored", "running",
                                    "caught_up", "done"]
    assert "99 bytes pulled from n5" in rows[3][2] and "step 41" in rows[4][2]
    assert "step 44, 6 messages re-sent, 8 received" in rows[5][2]
    d = plan_dict(done, every)
    assert (d["running_s"], d["caught_up_s"], d["total_s"], d["replayed"], d["received"]) \
        == (3.5, 5.5, 5.5, 6, 8)
    assert taken_spares([done, Plan("h", "7", 1, "n1", "n1", 2, "hung", 0, run=1)], "7", 1) \
        == {"n4"}
    assert taken_spares([done], "7", 2) == set()
    with pytest.raises(RecordError, match="phase"):
        PlanEvent.from_json("k", running.to_json().replace(b'"running"', b'"flying"'))


def test_a_failed_launch_fails_the_plan_only_before_the_restore() -> None:
    from raps_slurm.core.planner import PlanEvent, follow_events

    p = advance(Plan("7-2-2", "7", 2, "n3", "n4", 2, "node n3 is dead", 10, created_at=1.0),
                "running", 2.0)
    failed = PlanEvent("7-2-2", "launch_failed", 3.0, "n1", {"exit_code": 1})
    got = follow_events(p, {"launch_failed": failed})
    assert got.state == "failed" and "ended with 1 before it restored" in got.note
    restored = PlanEvent("7-2-2", "restored", 2.5, "n4", {})
    assert follow_events(p, {"launch_failed": failed, "restored": restored}).state == "restored"


def test_a_drained_nodes_ranks_get_planned_moves_and_no_escalation() -> None:
    from raps_slurm.core.planner import migration_ready, plan_migration

    sites = [RankSite(0, "n1", 1, ("n5", "n6")), RankSite(1, "n1", 1, ("n6", "n5")),
             RankSite(2, "n3", 1, ("n5", "n6"))]
    racks = {"r1": {"n1", "n2"}, "r2": {"n3", "n4"}, "r3": {"n5", "n6"}}
    plans = plan_migration("7", "n1", "nvme0 temp 72C > 70C", sites, dead=(), unhealthy=(),
                           taken=(), racks=racks, prefer_original_rack=False, holders={},
                           sizes={}, now=10.0)
    assert [(p.rank, p.target, p.epoch, p.planned) for p in plans] == [
        (0, "n5", 2, True), (1, "n5", 2, True)]  # together, to one spare
    assert plans[0].reason == "planned: n1 drained: nvme0 temp 72C > 70C"
    assert Plan.from_json("k", plans[0].to_json()) == plans[0]
    # no usable spare: nothing planned, and no escalation either (the node still works)
    assert plan_migration("7", "n1", "hot", sites, dead={"n5", "n6"}, unhealthy=(), taken=(),
                          racks=racks, prefer_original_rack=False, holders={}, sizes={},
                          now=10.0) == []
    ready = PlanEvent(plans[0].plan_id, "checkpointed", 11.0, "n2", {})
    assert not migration_ready(plans[0], {}, 12.0, 5.0)
    assert migration_ready(plans[0], {"checkpointed": ready}, 12.0, 5.0)
    assert migration_ready(plans[0], {}, 15.0, 5.0)          # waited long enough
    assert migration_ready(replace(plans[0], planned=False), {}, 10.0, 5.0)


def test_planned_field_is_checked() -> None:
    raw = json.loads(Plan("7-0-2", "7", 0, "n1", "n5", 2, "x", 0).to_json())
    raw["planned"] = "yes"
    with pytest.raises(RecordError, match="planned"):
        Plan.from_json("k", json.dumps(raw).encode())
    del raw["planned"]  # written before the field existed
    assert Plan.from_json("k", json.dumps(raw).encode()).planned is False
