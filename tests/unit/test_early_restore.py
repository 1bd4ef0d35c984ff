"""Restores started when a plan moves a rank here, before the rank asks
(raps_slurm/checkpoint/early.py), and the agent's watch on plans that starts them
(raps_slurm/agent/plan_watch.py, against the in-memory store)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from raps_slurm.agent.plan_watch import PlanWatcher
from raps_slurm.agent.uid_limits import UidLimits, early_charges
from raps_slurm.checkpoint.early import EarlyRestores
from raps_slurm.checkpoint.restore_parts import RestoreError, RestoreResult
from raps_slurm.core.planner import Plan, restore_early
from raps_slurm.store import Keys
from raps_slurm.store.memory import MemoryStore


class _State:
    """Stands in for a restored memory file: counts closes."""

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class _Restores:
    """The restore the early ones run: one result per call, optionally held back."""

    def __init__(self, gate: threading.Event | None = None, fail: bool = False,
                 holds: int = 0) -> None:
        self.calls: list[tuple[str, int]] = []
        self.gate, self.fail, self.holds = gate, fail, holds
        self.states: list[_State] = []

    def __call__(self, job: str, rank: int, charge: Callable[[int], None]) -> RestoreResult:
        self.calls.append((job, rank))
        if self.gate is not None:
            assert self.gate.wait(10)
        charge(self.holds)  # what the restore allocates, charged first
        if self.fail:
            raise RestoreError("no generation whole")
        state = _State()
        self.states.append(state)
        return RestoreResult(state, 7, [], 3)  # type: ignore[arg-type]


def _early(restores: _Restores, newest: dict[tuple[str, int], Any], **kw: Any
           ) -> EarlyRestores:
    return EarlyRestores(restores, lambda job, rank: newest.get((job, rank)), **kw)


def test_the_rank_takes_its_early_restore_once() -> None:
    restores = _Restores()
    early = _early(restores, {("5", 2): 7})
    assert early.start("5", 2)
    assert not early.start("5", 2)  # one per rank
    got = early.take("5", 2)
    assert got is not None and got.early and got.generation == 7
    assert early.take("5", 2) is None  # handed over once
    assert restores.calls == [("5", 2)] and restores.states[0].closed == 0


def test_the_rank_waits_for_an_early_restore_still_running() -> None:
    gate = threading.Event()
    restores = _Restores(gate)
    early = _early(restores, {("5", 2): 7})
    assert early.start("5", 2)
    got: list[RestoreResult | None] = []
    taker = threading.Thread(target=lambda: got.append(early.take("5", 2)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not got  # waits, does not restore a second time
    gate.set()
    taker.join(10)
    assert got and got[0] is not None and len(restores.calls) == 1


def test_a_newer_generation_drops_the_early_restore() -> None:
    restores = _Restores()
    newest = {("5", 2): 7}
    early = _early(restores, newest)
    assert early.start("5", 2)
    deadline = time.monotonic() + 10
    while not restores.states and time.monotonic() < deadline:
        time.sleep(0.01)
    newest[("5", 2)] = 8  # the rank saved once more (a planned move)
    assert early.take("5", 2) is None
    assert restores.states[0].closed == 1 and early.dropped == 1


def test_a_failed_early_restore_leaves_the_rank_to_restore_itself() -> None:
    early = _early(_Restores(fail=True), {("5", 2): 7})
    assert early.start("5", 2)
    assert early.take("5", 2) is None


def test_a_plan_seen_after_its_rank_asked_starts_no_second_restore() -> None:
    clock = [100.0]
    restores = _Restores()
    early = _early(restores, {("5", 2): 7}, hold_s=30.0, monotonic=lambda: clock[0])
    assert early.take("5", 2) is None  # the rank asked first (and restores itself)
    assert not early.start("5", 2)
    clock[0] += 31.0  # a later move of the same rank, after the hold
    early.expire()
    assert early.start("5", 2)
    assert early.take("5", 2) is not None


def test_nothing_committed_nothing_started() -> None:
    restores = _Restores()
    early = _early(restores, {})
    assert not early.start("5", 2)
    assert restores.calls == []


def test_an_unclaimed_early_restore_is_closed_after_its_hold() -> None:
    clock = [100.0]
    restores = _Restores()
    early = _early(restores, {("5", 2): 7}, hold_s=30.0, monotonic=lambda: clock[0])
    assert early.start("5", 2)
    # Made (its made_at read from the clock at 100) once the thread set the slot done:
    # a fixed sleep after the restore returned raced that on a loaded machine.
    assert early._slots[("5", 2)].done.wait(10), "the early restore never finished"
    assert restores.states
    clock[0] += 29.0
    assert early.expire() == 0
    clock[0] += 2.0
    assert early.expire() == 1
    assert restores.states[0].closed == 1
    assert early.take("5", 2) is None


def test_an_early_restore_is_charged_to_the_job_owner_until_taken_or_dropped() -> None:
    """The agent (root) starts it, the job's owner pays for it: what it holds counts
    against the owner's memory share from the restore until the rank takes it or it is
    closed; one over the share is refused and ends (the rank restores when it asks); a
    job whose owner is not known starts none."""
    limits = UidLimits(1, 1, memory_bytes=100)
    owners = {"5": 1000, "6": 1000}
    clock = [100.0]
    restores = _Restores(holds=60)
    early = _early(restores, {("5", 2): 7, ("6", 1): 7, ("7", 0): 7}, hold_s=30.0,
                   monotonic=lambda: clock[0])
    early.charge_for = early_charges(limits, owners.get)
    assert early.start("5", 2)
    assert early._slots[("5", 2)].done.wait(10)
    assert limits.held(1000) == 60
    assert early.start("6", 1)  # 60 more would pass the owner's 100
    assert early._slots[("6", 1)].done.wait(10)
    assert early._slots[("6", 1)].result is None and limits.held(1000) == 60
    got = early.take("5", 2)
    assert got is not None and limits.held(1000) == 0  # the rank has it now
    assert early.start("7", 0)  # no owner known: nothing restored, nothing charged
    assert early._slots[("7", 0)].done.wait(10)
    assert early._slots[("7", 0)].result is None and len(restores.calls) == 2
    restores.holds = 40
    early._asked.clear()
    assert early.start("5", 2)
    assert early._slots[("5", 2)].done.wait(10)
    assert limits.held(1000) == 40
    clock[0] += 31.0
    assert early.expire() >= 1 and limits.held(1000) == 0  # never claimed: dropped


def _plan(state: str = "running", target: str = "n3", planned: bool = False,
          rank: int = 4) -> Plan:
    return Plan(f"12-{rank}-2", "12", rank, "n1", target, 2, "node n1 DEAD", 1 << 20,
                state=state, planned=planned)


def test_which_plans_start_an_early_restore() -> None:
    assert restore_early(_plan(), "n3")
    assert not restore_early(_plan(), "n2")  # another node's
    assert not restore_early(_plan(state="queued"), "n3")  # not started by the leader
    assert not restore_early(_plan(state="restored"), "n3")
    assert not restore_early(_plan(planned=True), "n3")  # its last save is still to come


def test_the_watch_starts_each_plan_moving_a_rank_here_once() -> None:
    store, keys = MemoryStore(), Keys("/raps/")
    started: list[tuple[str, int]] = []
    watcher = PlanWatcher(store, keys, "n3", lambda job, rank: started.append((job, rank))
                          or True)
    watcher.start()
    try:
        deadline = time.monotonic() + 10
        assert watcher.watching.wait(10)  # it watches from the revision after its start
        store.put(keys.plan("12-9-2"), b"{not json")
        store.put(keys.plan("12-5-2"), _plan(target="n2", rank=5).to_json())
        store.put(keys.plan("12-4-2"), _plan(state="queued").to_json())
        store.put(keys.plan("12-4-2"), _plan().to_json())
        store.put(keys.plan("12-4-2"), _plan().to_json())  # written again: started once
        store.put(keys.plan("12-4-2"), _plan(state="restored").to_json())
        # Events come in order: once this one is handled, every earlier one was.
        store.put(keys.plan("12-6-2"), _plan(rank=6).to_json())
        while time.monotonic() < deadline and ("12", 6) not in started:
            time.sleep(0.01)
    finally:
        watcher.stop()
    assert started == [("12", 4), ("12", 6)], started
    assert watcher.malformed == 1 and watcher.started == 2
