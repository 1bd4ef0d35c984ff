"""The leader's recovery pass on the in-memory store: plans for a dead node's ranks,
started within the bound, followed through reported phases, escalations requeued and
released once, hung ranks relaunched in place, a second leader finishing the first's plan."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from leader_world import World, step

from raps_slurm.coordinator.cycle import Coordinator
from raps_slurm.coordinator.recovery import read_plans
from raps_slurm.coordinator.snapshot import read_snapshot
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import JobRecord
from raps_slurm.core.planner import CANCELLED, Plan, PlanEvent, cancelled


def test_dead_node_plan_started_followed_and_done(world: World) -> None:
    c = world.coordinator("c1")
    step(c, world)  # maps the job: ranks on n1 n3 n5 n6, spares n2 n4
    assert world.entry(3).node == "n6"
    world.dead = {"n6"}
    step(c, world)  # queued and started in the same pass
    assert world.plans() == {"7-3-2": "running"}
    moved = world.entry(3)
    assert (moved.node, moved.epoch) == ("n2", 2) or (moved.node, moved.epoch) == ("n4", 2)
    step(c, world, 3)
    assert world.plans() == {"7-3-2": "running"}  # started once, nothing more to do
    world.report("7-3-2", "restored", moved.node)
    step(c, world)
    assert world.plans() == {"7-3-2": "restored"}
    world.report("7-3-2", "running", moved.node)
    step(c, world)
    assert world.plans() == {"7-3-2": "restored"}  # running again, the lost steps to redo
    world.report("7-3-2", "caught_up", moved.node)
    step(c, world)
    assert world.plans() == {"7-3-2": "done"}
    assert world.entry(3).epoch == 2 and world.requeued == []


def test_a_plan_records_the_ranks_pre_fault_progress(world: World) -> None:
    c = world.coordinator("c1", max_concurrent=1)
    step(c, world)
    world.steps = {2: 41, 3: 57}
    world.dead = {"n5", "n6"}
    step(c, world, 3)
    book = read_plans(world.store, world.keys)
    got = {p.rank: p.progress for p, _ in book.plans.values()}
    assert got == {2: 41, 3: 57}
    world.steps = {}  # what a plan recorded stays, whatever the detector says later
    step(c, world)
    assert {p.rank: p.progress for p, _ in read_plans(world.store, world.keys).plans.values()} \
        == {2: 41, 3: 57}


def test_bound_holds_the_second_plan_until_the_first_restored(world: World) -> None:
    c = world.coordinator("c1", max_concurrent=1)
    step(c, world)
    world.dead = {"n5", "n6"}
    step(c, world, 3)
    states = world.plans()
    assert sorted(states.values()) == ["queued", "running"], states
    first = next(p for p, s in states.items() if s == "running")
    world.report(first, "restored", "n2")
    step(c, world, 2)
    assert sorted(world.plans().values()) == ["restored", "running"]


def test_a_second_leader_finishes_the_first_ones_plan(world: World) -> None:
    first = world.coordinator("c1", max_concurrent=1)
    step(first, world)
    world.dead = {"n5", "n6"}
    step(first, world)  # one move started, the other held by the bound; the leader is gone
    states = world.plans()
    assert sorted(states.values()) == ["queued", "running"], states
    held = next(p for p, s in states.items() if s == "queued")
    rank = int(held.split("-")[1])
    world.report(next(p for p, s in states.items() if s == "running"), "restored", "n2")
    second = world.coordinator("c2", max_concurrent=1)
    world.clock.advance(11)  # the first leader's lease runs out
    step(second, world, 3)
    assert world.plans()[held] == "running" and world.entry(rank).epoch == 2


def test_no_spare_escalates_once_and_releases_the_requeued_job(world: World) -> None:
    c = world.coordinator("c1")
    step(c, world)
    world.dead = {"n6", "n2", "n4"}  # the rank's node and both spares
    step(c, world, 4)
    assert world.requeued == ["7"]  # once, not every cycle
    esc = json.loads(world.store.get(world.keys.job_escalation("7")).value)  # type: ignore[union-attr]
    assert esc["run"] == 0 and "no usable spare" in esc["reason"]
    world.state = "PENDING"
    step(c, world, 3)
    assert world.released == ["7"] and world.requeued == ["7"]


def test_dead_batch_host_escalates(world: World) -> None:
    c = world.coordinator("c1")
    step(c, world)
    world.dead = {"n1"}
    step(c, world, 2)
    assert world.requeued == ["7"]


def test_hung_rank_relaunched_in_place_once_per_verdict(world: World) -> None:
    c = world.coordinator("c1")
    step(c, world)
    verdict = {"kind": "HUNG", "node": "n3", "job": "7", "rank": 1, "at": world.clock()}
    world.store.put(world.keys.job_hung_verdict("7", 1), json.dumps(verdict).encode())
    step(c, world, 3)
    assert world.plans() == {"7-1-2": "running"}
    assert (world.entry(1).node, world.entry(1).epoch) == ("n3", 2)
    world.report("7-1-2", "running", "n3")
    world.report("7-1-2", "caught_up", "n3")
    step(c, world, 3)
    assert world.plans() == {"7-1-2": "done"}  # the old verdict makes no second plan


def test_a_rank_that_finished_its_program_is_no_hang(world: World) -> None:
    """A rank whose peer record says ``done`` for its epoch went silent because it ended
    (its peers still finalize, or srun still waits for a dead node): no plan. A ``done``
    left by an older epoch does not cover the current one."""
    c = world.coordinator("c1")
    step(c, world)
    for rank, epoch in ((1, 1), (2, 0)):
        world.store.put(world.keys.job_peer("n3", "7", rank), json.dumps(
            {"host": "10.0.0.1", "port": 4000, "epoch": epoch, "done": True}).encode())
        verdict = {"kind": "HUNG", "node": "n3", "job": "7", "rank": rank,
                   "at": world.clock()}
        world.store.put(world.keys.job_hung_verdict("7", rank), json.dumps(verdict).encode())
    step(c, world, 3)
    assert set(world.plans()) == {"7-2-2"}
    # and the detector is told to stop watching the finished one only
    assert world.finished[-1] == frozenset({("7", 1)})


def test_a_silence_from_before_this_run_is_no_hang(world: World) -> None:
    """The job was requeued: a HUNG verdict whose silence began in the earlier run (the new
    step is slow to start) relaunches nothing; one whose silence began in this run does."""
    c = world.coordinator("c1")
    step(c, world)
    kv = world.store.get(world.keys.job("7"))
    assert kv is not None
    registered = JobRecord.from_json(kv.key, kv.value).registered_at
    for rank, last in ((1, registered - 5.0), (2, registered + 1.0)):
        verdict = {"kind": "HUNG", "node": "n3", "job": "7", "rank": rank,
                   "at": world.clock() + 10, "evidence": {"last_app_heartbeat_at": last}}
        world.store.put(world.keys.job_hung_verdict("7", rank), json.dumps(verdict).encode())
    world.clock.advance(10)
    step(c, world, 3)
    assert set(world.plans()) == {"7-2-2"}


def test_a_silence_during_a_step_restart_is_no_hang(world: World) -> None:
    """raps-run --restart-mode step kills and starts the job's whole MPI step: while the
    batch host's agent says it is stopping, no rank is judged hung; once it started, a
    silence from before the start relaunches nothing, one after it does."""
    c = world.coordinator("c1")
    step(c, world)
    key = world.keys.job_step("n1", "7", 0)

    def hung(rank: int, last: float) -> None:
        verdict = {"kind": "HUNG", "node": "n3", "job": "7", "rank": rank,
                   "at": world.clock(), "evidence": {"last_app_heartbeat_at": last}}
        world.store.put(world.keys.job_hung_verdict("7", rank), json.dumps(verdict).encode())

    world.clock.advance(5)
    stopping = world.clock()
    world.store.put(key, json.dumps({"stopping_at": stopping, "started_at": None}).encode())
    world.clock.advance(4)
    hung(1, stopping + 1.0)  # killed after the stop was recorded: still the restart's
    step(c, world, 3)
    assert world.plans() == {}
    world.clock.advance(2)
    world.store.put(key, json.dumps({"stopping_at": stopping,
                                     "started_at": world.clock()}).encode())
    step(c, world, 3)
    assert world.plans() == {}  # its silence began before the new step
    world.clock.advance(10)
    hung(2, world.clock() - 4.0)  # silent in the new step: a hang
    step(c, world, 3)
    assert set(world.plans()) == {"7-2-2"}


def test_a_restart_that_never_starts_stops_hiding_hangs(world: World) -> None:
    c = world.coordinator("c1")
    step(c, world)
    world.store.put(world.keys.job_step("n1", "7", 0), json.dumps(
        {"stopping_at": world.clock(), "started_at": None}).encode())
    world.clock.advance(61)  # recovery_timeout_sec is 60 in this world
    verdict = {"kind": "HUNG", "node": "n3", "job": "7", "rank": 1, "at": world.clock(),
               "evidence": {"last_app_heartbeat_at": world.clock() - 5}}
    world.store.put(world.keys.job_hung_verdict("7", 1), json.dumps(verdict).encode())
    step(c, world, 3)
    assert set(world.plans()) == {"7-1-2"}


def test_a_target_that_dies_is_replaced(world: World) -> None:
    c = world.coordinator("c1")
    step(c, world)
    world.dead = {"n6"}
    step(c, world)
    [(plan, _)] = read_plans(world.store, world.keys).plans.values()
    first = plan.target
    world.dead = {"n6", first}  # the chosen spare dies while the rank restores there
    step(c, world)
    other = ({"n2", "n4"} - {first}).pop()
    assert world.plans() == {"7-3-2": "failed", "7-3-3": "running"}
    assert (world.entry(3).node, world.entry(3).epoch) == (other, 3)
    # now the second spare dies too: that plan failed, and with no spare left the job is
    # requeued
    world.dead = {"n6", first, other}
    step(c, world, 3)
    assert world.plans() == {"7-3-2": "failed", "7-3-3": "failed"}
    assert world.requeued == ["7"]


def started(world: World, dead: str, plan: str) -> Coordinator:
    """A leader that mapped the job and started the plan for ``dead``'s rank."""
    c = world.coordinator("c1")
    step(c, world)
    world.dead = {dead}
    step(c, world, 3)
    assert world.plans() == {plan: "running"}
    return c


def test_a_started_plan_whose_target_died_gets_a_successor(world: World) -> None:
    c = started(world, "n5", "7-2-2")
    target = world.entry(2).node
    world.dead = {"n5", target}
    step(c, world, 4)
    assert world.plans() == {"7-2-2": "failed", "7-2-3": "running"}
    assert world.entry(2).epoch == 3 and world.entry(2).node not in world.dead


def test_a_launch_that_fails_moves_on_to_another_spare_then_escalates(world: World) -> None:
    c = started(world, "n6", "7-3-2")
    first = world.entry(3).node
    world.store.put(world.keys.plan_event("n1", "7-3-2", "launch_failed"), PlanEvent(
        "7-3-2", "launch_failed", world.clock(), "n1", {"exit_code": 1}).to_json())
    step(c, world, 4)
    assert world.plans() == {"7-3-2": "failed", "7-3-3": "running"}
    second = world.entry(3)
    assert second.epoch == 3 and second.node not in (first, "n6")
    world.store.put(world.keys.plan_event("n1", "7-3-3", "launch_failed"), PlanEvent(
        "7-3-3", "launch_failed", world.clock(), "n1", {"exit_code": 1}).to_json())
    step(c, world, 4)
    assert world.plans() == {"7-3-2": "failed", "7-3-3": "failed"}
    assert world.requeued == ["7"]


def test_reports_from_a_node_not_of_the_job_are_ignored(world: World) -> None:
    """What root on another user's node can write under its own node's name (the only
    name its etcd user may write): an ESCALATE with the rank's epoch, a plan phase that
    fails the launch, a cancel where only admins write. None moves the leader."""
    c = started(world, "n6", "7-3-2")
    entry = world.entry(3)
    _escalate_verdict(world, 3, "n9", entry.epoch)
    world.store.put(world.keys.plan_event("n9", "7-3-2", "launch_failed"), PlanEvent(
        "7-3-2", "launch_failed", world.clock(), "n9", {"exit_code": 1}).to_json())
    world.store.put(world.keys.plan_event("n9", "7-3-2", CANCELLED), PlanEvent(
        "7-3-2", CANCELLED, world.clock(), "n9", {"who": "root", "uid": 0,
                                                  "reason": "x"}).to_json())
    step(c, world, 4)
    assert world.plans() == {"7-3-2": "running"} and world.requeued == []
    book = read_plans(world.store, world.keys)
    assert book.refused == [f"{world.keys.plan_event('n9', '7-3-2', 'launch_failed')}: "
                            "from n9, not a node of job 7"]
    assert c.metrics.reports_refused._value.get() == 1  # the ESCALATE, counted once
    # a checkpoint record whose primary is n9: not in the leader's view of the job
    forged = CkptRecord(3, 9, entry.epoch, "b3:" + "ab" * 32, 1, 1, 1, "b3:" + "cd" * 32,
                        "n9", ("n9",), 0, "committed", world.clock())
    world.store.put(world.keys.ckpt("7", 3, 9), forged.to_json())
    snap = read_snapshot(world.store, world.keys)
    assert 9 not in [r.generation for r in snap.jobs["7"].ckpts.get(3, [])]
    assert f"{world.keys.ckpt('7', 3, 9)}: its primary n9 is not a node of job 7" \
        in snap.refused
    # the same from a node of the job is taken
    world.store.put(world.keys.plan_event("n1", "7-3-2", "launch_failed"), PlanEvent(
        "7-3-2", "launch_failed", world.clock(), "n1", {"exit_code": 1}).to_json())
    step(c, world, 4)
    assert world.plans()["7-3-2"] == "failed"


def test_a_cancelled_plan_escalates_its_job_once(world: World) -> None:
    c = world.coordinator("c1")
    step(c, world)
    world.dead = {"n6"}
    step(c, world, 2)
    assert world.plans() == {"7-3-2": "running"}
    world.store.put(world.keys.plan_cancel("7-3-2"), PlanEvent(
        "7-3-2", CANCELLED, world.clock(), "login1",
        {"who": "root", "uid": 0, "reason": "spare n2 is flaky"}).to_json())
    step(c, world, 3)
    assert world.plans() == {"7-3-2": "escalated"} and world.requeued == ["7"]
    esc = json.loads(world.store.get(world.keys.job_escalation("7")).value)  # type: ignore[union-attr]
    assert esc["reason"] == "plan 7-3-2 cancelled by root: spare n2 is flaky"


def test_cancelled_lists_only_active_plans_with_a_request() -> None:
    queued = Plan("7-3-2", "7", 3, "n6", "n2", 2, "dead", 0, created_at=1.0)
    done = dataclasses.replace(Plan("7-1-2", "7", 1, "n3", "n4", 2, "dead", 0), state="done")
    request = PlanEvent("7-3-2", CANCELLED, 2.0, "login1", {"who": "root"})
    events = {"7-3-2": {CANCELLED: request},
              "7-1-2": {CANCELLED: PlanEvent("7-1-2", CANCELLED, 2.0, "l", {})}}
    assert cancelled([queued, done], events) == [(queued, request)]
    assert cancelled([queued], {}) == []


_ABSENT = object()


def _escalate_verdict(world: World, rank: int, node: str, epoch: int | None,
                      at: float | None = None,
                      reason: str = "rank 3 waited 60s for seq 4 from rank 2",
                      requeue: object = True, lost: object = _ABSENT) -> None:
    """What the agent's ``escalate`` op writes for a rank's runtime (``requeue`` as the
    runtime asked; ``_ABSENT``: as an agent before the field wrote it), or what its
    ``ckpt_restore`` writes when no generation is whole (``lost`` true)."""
    value = {"kind": "ESCALATE", "node": node, "job": "7", "rank": rank, "epoch": epoch,
             "at": world.clock() if at is None else at, "evidence": {"reason": reason}}
    if requeue is not _ABSENT:
        value["requeue"] = requeue
    if lost is not _ABSENT:
        value["lost"] = lost
    world.store.put(world.keys.rank_escalation(node, "7", rank), json.dumps(value).encode())


def test_an_escalate_verdict_of_the_current_rank_requeues_the_run_once(world: World) -> None:
    c = world.coordinator("c1")
    step(c, world)
    entry = world.entry(3)
    _escalate_verdict(world, 3, entry.node, entry.epoch)
    step(c, world, 4)
    assert world.requeued == ["7"]  # once, not every cycle
    esc = world.escalation()
    assert esc.run == 0 and f"rank 3 on {entry.node} escalated" in esc.reason
    assert "waited 60s for seq 4 from rank 2" in esc.reason
    world.state = "PENDING"
    step(c, world, 3)
    assert world.released == ["7"] and world.requeued == ["7"]
    # the next run registers: the old verdict speaks for the old run only
    world.clock.advance(5)
    world.register(1)
    world.state = "RUNNING"
    step(c, world, 4)
    assert world.requeued == ["7"]


def test_escalate_verdicts_of_another_epoch_node_or_run_are_not_acted_on(
        world: World) -> None:
    c = world.coordinator("c1")
    step(c, world)
    entry = world.entry(3)
    other = next(n for n in ("n1", "n2", "n3", "n4", "n5", "n6") if n != entry.node)
    kv = world.store.get(world.keys.job("7"))
    assert kv is not None
    registered = JobRecord.from_json(kv.key, kv.value).registered_at
    for rank, node, epoch, at in ((3, entry.node, entry.epoch + 1, None),  # not its epoch
                                  (3, other, entry.epoch, None),           # not its node
                                  (3, entry.node, None, None),             # no registration
                                  (3, entry.node, entry.epoch, registered - 1.0)):  # older run
        _escalate_verdict(world, rank, node, epoch, at)
        step(c, world, 3)
        assert world.requeued == [] and world.plans() == {}, (node, epoch, at)
    # one the runtime wrote without asking for a requeue (a sender that could not serve
    # one replay request is not stuck: its receiver's plan times out if the hole is real)
    _escalate_verdict(world, 3, entry.node, entry.epoch,
                      reason="rank 3 cannot replay to rank 2: seq 1..20 were collected",
                      requeue=False)
    step(c, world, 3)
    assert world.requeued == []


@pytest.mark.parametrize("requeue", [True, _ABSENT])
def test_the_leader_decides_on_the_requeue_field_not_on_the_reason(
        world: World, requeue: object) -> None:
    """(Absent: written by an agent from before the field, when every escalation asked
    for a requeue.)"""
    c = world.coordinator("c1")
    step(c, world)
    entry = world.entry(3)
    _escalate_verdict(world, 3, entry.node, entry.epoch, requeue=False)
    step(c, world, 3)
    assert world.requeued == []
    _escalate_verdict(world, 3, entry.node, entry.epoch, requeue=requeue,
                      reason="rank 3 cannot replay to rank 2: seq 1..20 were collected")
    step(c, world, 3)
    assert world.requeued == ["7"]
    assert "cannot replay to rank 2" in world.escalation().reason


@pytest.mark.parametrize("bad", ["yes", 1, None, {"x": 1}])
def test_a_malformed_requeue_field_is_one_error_ignored_and_counted(
        world: World, bad: object, caplog: pytest.LogCaptureFixture) -> None:
    c = world.coordinator("c1")
    step(c, world)
    entry = world.entry(3)
    before = c.metrics.malformed._value.get()
    _escalate_verdict(world, 3, entry.node, entry.epoch, requeue=bad)
    with caplog.at_level(logging.ERROR, logger="raps.coordinator"):
        step(c, world, 4)
    assert world.requeued == []
    lines = [r.getMessage() for r in caplog.records if "field 'requeue'" in r.getMessage()]
    assert len(lines) == 1 and "expected true or false" in lines[0], lines
    assert "\n" not in lines[0]
    assert c.metrics.malformed._value.get() == before + 1


def test_a_rank_re_executing_longer_than_the_recovery_timeout_is_not_escalated(
        world: World) -> None:
    """Running again, a rank redoes up to a checkpoint interval of lost work (minutes in
    production): that is no stall. A HUNG verdict after its restore is one."""
    c = world.coordinator("c1")  # recovery_timeout_sec: 60
    step(c, world)
    world.dead = {"n6"}
    step(c, world, 2)
    [pid] = world.plans()
    assert world.plans()[pid] == "running"
    world.report(pid, "restored", world.entry(3).node)
    step(c, world)
    assert world.plans() == {pid: "restored"}
    world.clock.advance(600)  # re-executing ten minutes of lost work
    step(c, world, 3)
    assert world.requeued == [] and world.plans() == {pid: "restored"}
    # A verdict from before the restore (the fault's own) is not a stall of the replay.
    entry = world.entry(3)
    old = {"kind": "HUNG", "node": entry.node, "job": "7", "rank": 3, "at": 1.0}
    world.store.put(world.keys.job_hung_verdict("7", 3), json.dumps(old).encode())
    step(c, world, 3)
    assert world.requeued == [] and world.plans() == {pid: "restored"}
    verdict = {**old, "at": world.clock()}
    world.store.put(world.keys.job_hung_verdict("7", 3), json.dumps(verdict).encode())
    step(c, world, 3)
    assert world.requeued == ["7"] and world.plans() == {pid: "escalated"}
    assert "rank 3 judged HUNG while re-executing" in world.escalation().reason


def test_a_plan_not_running_again_within_the_recovery_timeout_escalates_its_job(
        world: World) -> None:
    c = world.coordinator("c1")  # recovery_timeout_sec: 60
    step(c, world)
    world.dead = {"n6"}
    step(c, world, 2)
    [pid] = world.plans()
    assert world.plans()[pid] == "running"  # launched, never restored
    world.clock.advance(58)
    step(c, world, 3)
    assert world.requeued == [] and world.plans() == {pid: "running"}
    world.clock.advance(3)
    step(c, world, 3)
    assert world.requeued == ["7"] and world.plans() == {pid: "escalated"}
    assert "rank 3 not running again within 60s" in world.escalation().reason


LOST = "its checkpoint could not be restored: no generation of rank 3 of job 7 could be restored"


def test_a_checkpoint_damaged_on_every_holder_gives_up_without_a_requeue(
        world: World) -> None:
    """The spare's agent checked every holder and found no generation whole: no
    successor plan on another spare (it would find the same), no requeue (the next run
    would find the same): RAPS gives up, and cancels the job if raps-run does not end it."""
    c = started(world, "n6", "7-3-2")
    spare = world.entry(3)
    _escalate_verdict(world, 3, spare.node, spare.epoch, reason=LOST, lost=True)
    step(c, world, 4)
    assert world.plans() == {"7-3-2": "escalated"} and world.requeued == []
    esc = world.escalation()
    assert esc.lost == 3 and esc.gave_up.startswith("rank 3's checkpoint is damaged on every "
                                                    "holder")
    assert LOST in esc.gave_up and "resubmit the job" in esc.gave_up
    world.clock.advance(31)  # raps-run did not end the job within the grace
    step(c, world, 2)
    assert world.cancelled == ["7"] and world.requeued == []


def test_a_checkpoint_whose_holders_were_out_of_reach_requeues_the_run(
        world: World) -> None:
    """Some holder did not answer: no other spare is tried, the run is requeued (which may
    find the holders back), and the requeue budget applies as to any escalation."""
    c = started(world, "n6", "7-3-2")
    spare = world.entry(3)
    _escalate_verdict(world, 3, spare.node, spare.epoch, lost=False,
                      reason=LOST + " (holders out of reach: n5)")
    step(c, world, 4)
    assert world.plans() == {"7-3-2": "escalated"} and world.requeued == ["7"]
    esc = world.escalation()
    assert esc.lost is None and esc.gave_up == "" and "out of reach: n5" in esc.reason


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_malformed_lost_field_is_one_error_ignored(
        world: World, bad: object, caplog: pytest.LogCaptureFixture) -> None:
    c = world.coordinator("c1")
    step(c, world)
    entry = world.entry(3)
    _escalate_verdict(world, 3, entry.node, entry.epoch, reason=LOST, lost=bad)
    with caplog.at_level(logging.ERROR, logger="raps.coordinator"):
        step(c, world, 4)
    assert world.requeued == []
    lines = [r.getMessage() for r in caplog.records if "field 'lost'" in r.getMessage()]
    assert len(lines) == 1 and "expected true or false" in lines[0], lines
