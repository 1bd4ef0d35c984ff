"""Recovery end to end on the real local cluster: ``sbatch --raps --no-kill`` running
``raps-run``, a node crashed mid-run, only its rank relaunched on a spare, restored and
replayed, the result identical to a failure-free run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.config import load_file, node_dir
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import RankEntry
from raps_slurm.core.planner import Plan
from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm.runner import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import (
    CoordinatorProcess,
    LocalCluster,
    wait_leading,
    wait_until,
)
from raps_slurm.testing.jobs import (
    HEAT_RING,
    back_in_service,
    crashed,
    damage_chunks,
    finish,
    heat_reference,
    job_plans,
    job_state,
    node_dead,
    rank_entries,
    rank_pids,
    sruns_of_run,
    wait_mapped,
)
from raps_slurm.testing.jobs import committed as committed_generations

HEAT = ["--steps", "240", "--every", "20", "--step-sec", "0.05"]


def reference(tmp: Path, ranks: int) -> str:
    """The failure-free result, from the local launcher (the same program and arithmetic)."""
    return heat_reference(tmp, ranks, ["--steps", "240", "--every", "20"])


@contextmanager
def raps_job(cluster: LocalCluster, *sbatch: str) -> Iterator[tuple[str, Path]]:
    """A --raps job running heat_ring under raps-run; cancelled when the block ends."""
    run = CommandRunner(timeout=60, env=cluster.env)
    job, out = cluster.submit_raps_run(
        [sys.executable, str(HEAT_RING), *HEAT], list(sbatch), "job")
    try:
        yield job, out
    finally:
        with contextlib.suppress(SlurmCommandError):
            run.run(["scancel", job])


def entries(store: tuple[StateStore, Keys], job: str) -> dict[int, RankEntry]:
    return rank_entries(*store, job)


def records(store: tuple[StateStore, Keys], job: str, rank: int) -> list[CkptRecord]:
    s, k = store
    return sorted((CkptRecord.from_json(kv.key, kv.value)
                   for kv in s.get_prefix(k.ckpt_prefix(job, rank))),
                  key=lambda r: r.generation)


def committed(store: tuple[StateStore, Keys], job: str, rank: int) -> list[int]:
    """Generations copied to the whole group (what a restore elsewhere needs)."""
    return committed_generations(*store, job, rank)


def plans(store: tuple[StateStore, Keys], job: str) -> list[Plan]:
    return job_plans(*store, job)


def only_plan(store: tuple[StateStore, Keys], job: str, out: Path) -> Plan:
    """The job's one plan; failing, every plan and the job's output."""
    got = plans(store, job)
    assert len(got) == 1, f"{got}\n{out.read_text()[-4000:]}"
    return got[0]


@contextmanager
def leading_with(cluster: LocalCluster, store: tuple[StateStore, Keys], name: str, tmp: Path,
                 **recovery: object) -> Iterator[CoordinatorProcess]:
    """A leading coordinator whose config differs in some ``recovery`` keys."""
    cfg = yaml.safe_load(cluster.config_path.read_text())
    cfg.setdefault("recovery", {}).update(recovery)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    c = cluster.coordinator(name, config=path).start()
    try:
        wait_leading(*store, name)
        yield c
    finally:
        c.stop()


def mapped(store: tuple[StateStore, Keys], job: str, run: int = 0) -> dict[str, Any]:
    return wait_mapped(*store, job, run)


def rank_nodes(data: dict[str, Any]) -> dict[int, str]:
    return {r["rank"]: r["node"] for r in data["ranks"]}


def batch_host(cluster: LocalCluster, job: str) -> str:
    return wait_until("the batch host", lambda: cluster.slurm().job(int(job)).batch_host,
                      bool, 20)


def layout(cluster: LocalCluster, store: tuple[StateStore, Keys], job: str
           ) -> tuple[dict[str, Any], dict[int, str], int]:
    """The mapped job, its rank -> node, and the last rank not on the batch script's node
    (the one to fail: losing the batch host escalates, which another test covers)."""
    data = mapped(store, job)
    ranks = rank_nodes(data)
    host = batch_host(cluster, job)
    return data, ranks, max(r for r, n in ranks.items() if n != host)


def test_node_crash_relaunches_only_its_rank_and_the_result_is_unchanged(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Any,
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    clean = reference(tmp_path, 4)
    with leading("recovery"), raps_job(cluster, "--raps-spares=2", "-N6") as (job, out):
        data, ranks, victim = layout(cluster, store, job)
        node = ranks[victim]
        wait_until(f"rank {victim} committed two generations",
                   lambda: committed(store, job, victim), lambda g: len(g) >= 2, 60)
        before = [(r.generation, r.state, r.holders) for r in records(store, job, victim)]
        with crashed(cluster, store, node):
            wait_until(f"job {job} completed", lambda: job_state(cluster, job),
                       lambda s: s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 150)
            text = out.read_text()
            assert job_state(cluster, job) == "COMPLETED", f"{before}\n{text[-4000:]}"
            assert clean in text.splitlines(), text[-4000:]
            plan = only_plan(store, job, out)
            assert (plan.rank, plan.source, plan.epoch, plan.state) == (victim, node, 2, "done")
            assert plan.target in data["spares"]
            now = entries(store, job)
            assert {r: e.epoch for r, e in now.items()} == {
                r: (2 if r == victim else 1) for r in ranks}
            assert now[victim].node == plan.target
            # raps-run started every rank once, and only the victim again
            started = [x for x in text.splitlines() if x.startswith("raps-run: rank ")
                       and " started on " in x]
            assert sorted(started) == sorted(
                [f"raps-run: rank {r} epoch 1 started on {n}" for r, n in ranks.items()]
                + [f"raps-run: rank {victim} epoch 2 started on {plan.target}"]), text[-4000:]
            shown = json.loads(rapsctl("show", "plan", plan.plan_id, "--json").stdout)
            phases = [row["phase"] for row in shown["timeline"]]
            assert phases == ["fault verdict", "plan", "start", "launched", "restored",
                              "running", "caught_up", "done"], shown
            listing = rapsctl("show", "recoveries", job).stdout
            assert plan.plan_id in listing and "done" in listing


def test_two_nodes_of_a_rack_recover_one_after_the_other(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        tmp_path: Path) -> None:
    clean = reference(tmp_path, 4)
    with leading_with(cluster, store, "one-at-a-time", tmp_path, max_concurrent_recoveries=1), \
            raps_job(cluster, "--raps-spares=2", "-N6") as (job, out):
        data = mapped(store, job)
        ranks = rank_nodes(data)
        host = batch_host(cluster, job)
        topo = cluster.slurm().topology()
        rack = next(r for r, members in topo.racks().items()
                    if set(members) <= set(ranks.values()) and host not in members)
        victims = sorted(r for r, n in ranks.items() if topo.rack_of(n) == rack)
        assert len(victims) == 2
        for r in victims:
            wait_until(f"rank {r} committed", lambda r=r: committed(store, job, r), bool, 60)
        with crashed(cluster, store, *topo.racks()[rack]):
            finish(cluster, job, out, clean)
            # now: the job's keys go purge_grace_sec (5 s here) after its end, and the
            # nodes' return to service below may take longer
            got = sorted(plans(store, job), key=lambda p: p.started_at or 0.0)
        assert [p.rank for p in sorted(got, key=lambda p: p.rank)] == victims
        assert [p.state for p in got] == ["done", "done"]
        assert {p.target for p in got} == set(data["spares"])
        first, second = got
        # the bound: the second started only once the first had restored (not finished)
        assert first.restored_at is not None and second.started_at is not None
        assert second.started_at >= first.restored_at, (first, second)


def test_primary_and_mirror_lost_restores_from_the_remaining_holder(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    clean = reference(tmp_path, 3)
    with leading("holders"), raps_job(cluster, "--raps-spares=2", "--raps-replicas=2",
                                      "-N5") as (job, out):
        data, ranks, victim = layout(cluster, store, job)
        rec = wait_until(f"rank {victim} committed on three holders",
                         lambda: [r for r in records(store, job, victim)
                                  if r.state == "committed" and len(r.holders) >= 3],
                         bool, 60)[-1]
        primary = ranks[victim]
        # a holder that is not a spare if there is one (a spare would also be a target)
        mirror = next(h for h in sorted(rec.holders, key=lambda h: h in data["spares"])
                      if h not in (primary, batch_host(cluster, job)))
        remaining = set(rec.holders) - {primary, mirror}
        s, k = store
        with crashed(cluster, store, primary, mirror):
            finish(cluster, job, out, clean)
            # now: the job's keys and its nodes' reports go purge_grace_sec (5 s here)
            # after its end, and the nodes' return to service below may take longer
            every = plans(store, job)
            # only the victim's moves: no plan for a rank whose node did not fail
            mine = sorted(every, key=lambda p: p.epoch)
            assert mine, every
            raw = s.get(k.plan_event(mine[-1].target, mine[-1].plan_id, "restored"))
        assert {p.rank for p in mine} == {victim}, every
        # a plan whose target was the crashed mirror (not yet known dead) failed; its
        # successor restored the rank
        assert [p.state for p in mine] == ["failed"] * (len(mine) - 1) + ["done"], every
        assert raw is not None
        restored = json.loads(raw.value)["detail"]
        assert set(restored["sources"]) <= remaining, (restored, remaining)
        assert restored["generation"] is not None


def test_frozen_node_thawed_after_the_relaunch_cannot_run_its_rank_twice(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    clean = reference(tmp_path, 4)
    with leading("freeze"), raps_job(cluster, "--raps-spares=2", "-N6") as (job, out):
        _, ranks, victim = layout(cluster, store, job)
        node = ranks[victim]
        wait_until(f"rank {victim} committed", lambda: committed(store, job, victim), bool, 60)
        old = wait_until(f"rank {victim} epoch 1 running", lambda: rank_pids(job, victim, 1),
                         bool, 20)
        cluster.freeze(node)
        try:
            wait_until(f"rank {victim} restored elsewhere",
                       lambda: [p.state for p in plans(store, job)],
                       lambda st: bool(st) and st[0] in ("restored", "done"), 60)
        finally:
            cluster.thaw(node)
            back_in_service(cluster, *store, node)
        # thawed, the old copy finds its epoch superseded and is gone; it never ran beside
        # the new one past that point, and the job's result is the failure-free one
        wait_until(f"old rank {victim} (pids {old}) gone", lambda: rank_pids(job, victim, 1),
                   lambda p: not p, 30)
        finish(cluster, job, out, clean)
        plan = only_plan(store, job, out)
        assert (plan.rank, plan.source, plan.epoch, plan.state) == (victim, node, 2, "done")
        assert entries(store, job)[victim].epoch == 2


def test_coordinator_killed_mid_plan_the_next_leader_finishes_it(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        tmp_path: Path) -> None:
    clean = reference(tmp_path, 4)
    first = cluster.coordinator("mid-a").start()
    second: CoordinatorProcess | None = None
    try:
        wait_leading(*store, "mid-a")
        second = cluster.coordinator("mid-b").start()
        with raps_job(cluster, "--raps-spares=2", "-N6") as (job, out):
            _, ranks, victim = layout(cluster, store, job)
            wait_until(f"rank {victim} committed", lambda: committed(store, job, victim), bool,
                       60)
            with crashed(cluster, store, ranks[victim]):
                seen = wait_until("a plan", lambda: plans(store, job), bool, 30, interval=0.02)
                first.signal(signal.SIGKILL)
                assert seen[0].state in ("queued", "running"), seen  # killed mid-plan
                wait_leading(*store, "mid-b")
                text = finish(cluster, job, out, clean)
                # now: the job's keys go purge_grace_sec (5 s here) after its end, and
                # the node's return to service below may take longer
                plan = only_plan(store, job, out)
                epoch = entries(store, job)[victim].epoch
            assert (plan.rank, plan.epoch, plan.state) == (victim, 2, "done")
            assert epoch == 2  # started once, not twice
            assert text.count(f"rank {victim} epoch 2 started on ") == 1
            assert f"plan {plan.plan_id}" in second.log()
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_sigusr1_checkpoints_every_rank_and_the_requeued_job_resumes(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    clean = reference(tmp_path, 4)
    run = CommandRunner(timeout=60, env=cluster.env)
    with leading("preempt"), raps_job(cluster, "--raps-spares=2", "-N6",
                                      "--open-mode=append") as (job, out):
        _, ranks, _ = layout(cluster, store, job)
        for r in ranks:
            wait_until(f"rank {r} committed", lambda r=r: committed(store, job, r), bool, 60)
        # what sbatch --signal=B:USR1@T does at T before the time limit
        run.run(["scancel", "--batch", "--signal=USR1", job])
        wait_until(f"job {job} requeued", lambda: cluster.slurm().job(int(job)),
                   lambda j: j.restart_count == 1 and j.state == "PENDING", 60)
        # A requeued job may get its BeginTime delay only once its first run's epilog is
        # over, after a single update (seen: 104 s to start): ask again while it waits.

        def started() -> str:
            state = job_state(cluster, job)
            if state == "PENDING":
                with contextlib.suppress(SlurmCommandError):  # it may have just started
                    run.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
            return state

        wait_until(f"job {job} run 1 to start", started, lambda st: st != "PENDING", 120,
                   interval=1.0)
        text = finish(cluster, job, out, clean)
        assert "raps-run: SIGUSR1: every rank checkpoints now" in text
        stopped = [x for x in text.splitlines() if "checkpointed after SIGUSR1" in x]
        assert stopped, text[-4000:]
        resumed = [x for x in text.splitlines() if " resumed at step " in x]
        # once each: no rank was restarted in place
        assert sorted(int(x.split()[1]) for x in resumed) == sorted(ranks), text[-4000:]


def test_hung_rank_is_relaunched_on_its_own_node(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    clean = reference(tmp_path, 4)
    with leading("hung"), raps_job(cluster, "--raps-spares=2", "-N6") as (job, out):
        _, ranks, victim = layout(cluster, store, job)
        wait_until(f"rank {victim} committed", lambda: committed(store, job, victim), bool, 60)
        [pid] = wait_until(f"rank {victim} running", lambda: rank_pids(job, victim, 1), bool, 20)
        os.kill(pid, signal.SIGSTOP)  # alive, no progress: HUNG, not DEAD
        try:
            got = wait_until(f"rank {victim} relaunched", lambda: plans(store, job),
                             lambda ps: bool(ps) and ps[0].state in ("restored", "done"), 60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        finish(cluster, job, out, clean)
        plan = only_plan(store, job, out)
        assert plan is not None and got
        assert (plan.rank, plan.source, plan.target, plan.epoch, plan.state) == (
            victim, ranks[victim], ranks[victim], 2, "done")
        assert "hung" in plan.reason
        wait_until(f"old rank {victim} gone", lambda: rank_pids(job, victim, 1),
                   lambda p: not p, 30)


def test_a_spare_that_cannot_start_the_rank_is_passed_over(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    from raps_slurm.config import load_file
    from raps_slurm.core.planner import RankSite, choose_target

    clean = reference(tmp_path, 4)
    with leading("launch"), raps_job(cluster, "--raps-spares=2", "-N6") as (job, out):
        data, ranks, victim = layout(cluster, store, job)
        node = ranks[victim]
        newest = wait_until(f"rank {victim} committed", lambda: [
            r for r in records(store, job, victim) if r.state == "committed"], bool, 60)[-1]
        # the spare the leader will pick first (its own rules), made unable to start steps
        entry = entries(store, job)[victim]
        racks = {r: set(n) for r, n in cluster.slurm().topology().racks().items()}
        first = choose_target(RankSite(victim, node, entry.epoch, entry.spares), dead={node},
                              unhealthy=set(), taken=set(), racks=racks,
                              prefer_original_rack=load_file(
                                  cluster.config_path).recovery.prefer_original_rack,
                              holders=set(newest.holders) - set(newest.bad))
        assert first in data["spares"]
        cluster.slurmd_kill(first)
        try:
            with crashed(cluster, store, node):
                text = finish(cluster, job, out, clean)
                # now: the job's keys go purge_grace_sec (5 s here) after its end, and
                # the nodes' return to service below may take longer
                got = sorted(plans(store, job), key=lambda p: p.epoch)
                epoch = entries(store, job)[victim].epoch
        finally:
            cluster.slurmd_start(first)
            back_in_service(cluster, *store, first)
        assert [(p.target, p.state) for p in got] == [
            (first, "failed"), (({*data["spares"]} - {first}).pop(), "done")], got
        assert "before it restored" in got[0].note
        assert epoch == 3
        assert text.count(f"rank {victim} epoch 3 started on ") == 1


def test_a_requeue_whose_node_count_cannot_be_met_runs_with_fewer_spares(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    """-N5 with one spare: the spare dies, then a working node. No spare is left, the job
    is requeued, and only 4 of the cluster's 6 nodes are alive: the requeued run asks
    Slurm for 4 nodes, runs without a spare, and ends with the failure-free result."""
    clean = reference(tmp_path, 4)
    with leading("fewer"), raps_job(cluster, "--raps-spares=1", "-N5",
                                    "--open-mode=append") as (job, out):
        data, ranks, victim = layout(cluster, store, job)
        [spare] = data["spares"]
        for r in ranks:
            wait_until(f"rank {r} committed", lambda r=r: committed(store, job, r), bool, 60)
        with crashed(cluster, store, spare):
            wait_until(f"{spare} held DEAD", lambda: node_dead(*store, spare), bool, 30)
            with crashed(cluster, store, ranks[victim]):
                again = mapped(store, job, run=1)
                esc = escalation(store, job)  # (read while the job runs: purged after it)
                text = finish(cluster, job, out, clean, timeout=180)
        assert esc["run"] == 0 and "no usable spare" in esc["reason"], esc
        assert again["spares"] == [] and len(again["ranks"]) == 4, again
        assert {r["node"] for r in again["ranks"]}.isdisjoint({spare, ranks[victim]})
        assert cluster.slurm().job(int(job)).restart_count == 1, text[-3000:]


def test_raps_gives_up_after_max_requeues_and_says_why(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Any,
        tmp_path: Path) -> None:
    """recovery.max_requeues 0: the first escalation is one too many. The job fails, and
    the reason is in its output and in ``rapsctl show job``; Slurm does not requeue it."""
    with leading_with(cluster, store, "giveup", tmp_path, max_requeues=0), \
            raps_job(cluster, "--raps-spares=0", "-N4") as (job, out):
        _, ranks, victim = layout(cluster, store, job)
        wait_until(f"rank {victim} committed", lambda: committed(store, job, victim), bool, 60)
        with crashed(cluster, store, ranks[victim]):
            shown = ended(cluster, rapsctl, job, out, 120)
        text = out.read_text()
        assert f"RAPS gave up on job {job}" in text, text[-3000:]
        assert "no usable spare" in text, text[-3000:]
        assert "GaveUp" in shown and "max_requeues=0" in shown, shown
        assert cluster.slurm().job(int(job)).restart_count == 0


def escalation(store: tuple[StateStore, Keys], job: str) -> dict[str, Any]:
    """The job's escalation record ({} while there is none)."""
    s, k = store
    kv = s.get(k.job_escalation(job))
    return json.loads(kv.value) if kv is not None else {}


def ended(cluster: LocalCluster, rapsctl: Any, job: str, out: Path, timeout: float) -> str:
    """Wait until ``job`` ended, not COMPLETED (failing, its output); what ``rapsctl show
    job`` says then."""
    state = wait_until(f"job {job} to end", lambda: job_state(cluster, job),
                       lambda st: st in ("FAILED", "CANCELLED", "COMPLETED", "NODE_FAIL",
                                         "TIMEOUT"), timeout)
    assert state != "COMPLETED", out.read_text()[-3000:]
    return str(rapsctl("show", "job", job, check=False).stdout)


def damage(cluster: LocalCluster, job: str, rank: int, holders: list[str]) -> int:
    """Flip one byte of every chunk of every generation of ``rank`` that ``holders`` keep
    (once each: generations share chunks); how many chunks were damaged."""
    cfg = load_file(cluster.config_path)
    hit = 0
    for node in holders:
        chunks = ChunkStore(node_dir(cfg.checkpoint.local_dir, node))
        digests: set[str] = set()
        for gen in chunks.generations(job, rank):
            m = chunks.manifest(job, rank, gen)
            digests.update(m.digests() if m is not None else [])
        hit += damage_chunks(chunks, job, digests)
    return hit


def test_a_rank_whose_every_copy_is_damaged_makes_raps_give_up_without_a_requeue(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Any,
        leading: Callable[[str], Any]) -> None:
    """A rank stopped (HUNG) and every copy of its generations damaged on every holder:
    its relaunch's restore checks them all and finds none whole. Nothing else is tried
    (another spare, a requeue would find the same): RAPS gives up, with the reason in the
    job's output and in ``rapsctl show job``."""
    with leading("lost"), raps_job(cluster, "--raps-spares=2", "-N5") as (job, out):
        _, ranks, victim = layout(cluster, store, job)
        wait_until(f"rank {victim} committed", lambda: committed(store, job, victim), bool, 60)
        [pid] = wait_until(f"rank {victim} running", lambda: rank_pids(job, victim, 1), bool, 20)
        os.kill(pid, signal.SIGSTOP)  # no newer generation from now on
        try:
            holders = sorted({h for r in records(store, job, victim) for h in r.holders})
            assert ranks[victim] in holders and len(holders) >= 2, holders
            assert damage(cluster, job, victim, holders) > 0, holders
            # read while the job runs: a finished job's keys are purged 5 s after it
            # a generation whose copy landed after the damage would be restored whole: a
            # timeout says which generations were where, and what the plans did
            esc = wait_until(
                "RAPS to give up", lambda: escalation(store, job),
                lambda e: bool(e.get("gave_up")), 90,
                explain=lambda: f"rank {victim}'s generations now: "
                f"{[(r.generation, r.state, r.holders) for r in records(store, job, victim)]}"
                f"\nits plans: "
                f"{[(p.source, p.target, p.state) for p in plans(store, job) if p.rank == victim]}"
                f"\njob output:\n{out.read_text()[-2000:] if out.exists() else ''}")
            mine = wait_until("its plan escalated",
                              lambda: [p for p in plans(store, job) if p.rank == victim],
                              lambda ps: bool(ps) and ps[-1].state == "escalated", 10)
            shown = ended(cluster, rapsctl, job, out, 60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        text = out.read_text()
        assert "could not be restored (no checkpoint generation whole)" in text, text[-3000:]
        assert f"RAPS gave up on job {job}" in text, text[-3000:]
        assert f"rank {victim}'s checkpoint is damaged on every holder" in text, text[-3000:]
        assert "GaveUp" in shown and "resubmit the job" in shown, shown
        assert [(p.source, p.target, p.state) for p in mine] == [
            (ranks[victim], ranks[victim], "escalated")], mine
        assert esc["run"] == 0 and esc["lost"] == victim, esc
        assert cluster.slurm().job(int(job)).restart_count == 0


def test_no_spare_left_requeues_the_job_which_resumes_from_checkpoints(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    """A node crash with no spare left: the job is requeued (the escalation recorded, and
    its release once the requeued run starts), every rank of the requeued run resumes once
    from a checkpoint, and the job ends with the failure-free result. The first run's
    srun waits for a task on the dead node, and one left behind would cancel the step of
    the same number ``KillWait`` + 2 s later, by then the requeued run's (the fault
    campaign's 'STEP 2.0 ON n1 CANCELLED'): no srun outlives the run that started it, and
    the requeued run (longer than that) finishes."""
    # 160 steps of 0.3 s: resumed from step 20 or 40, the requeued run computes for 36 s
    # and more, past KillWait + 2 s after the requeue (checked below)
    slow = ["--steps", "160", "--every", "20", "--step-sec", "0.3"]
    clean = heat_reference(tmp_path, 4, slow)
    run = CommandRunner(timeout=60, env=cluster.env)
    kill_wait = next(int(x.split("=")[1].split()[0]) for x in
                     run.run(["scontrol", "show", "config"]).splitlines()
                     if x.split("=")[0].strip() == "KillWait")
    job, out = cluster.submit_raps_run([sys.executable, str(HEAT_RING), *slow],
                                       ["--raps-spares=0", "-N4", "--open-mode=append"],
                                       "killwait")
    try:
        with leading("killwait"):
            _, ranks, victim = layout(cluster, store, job)
            for r in ranks:
                wait_until(f"rank {r} committed", lambda r=r: committed(store, job, r),
                           bool, 60)
            assert sruns_of_run(cluster, job, 0), "the first run's sruns are not found"
            with crashed(cluster, store, ranks[victim]):
                wait_until(f"job {job} requeued", lambda: cluster.slurm().job(int(job)),
                           lambda j: j.restart_count == 1, 60)
                requeued = time.monotonic()
                wait_until("the first run's sruns gone",
                           lambda: sruns_of_run(cluster, job, 0), lambda pids: not pids, 15)
                mapped(store, job, run=1)
                # Read while the job runs (purged after it); the leader records the release
                # just after it starts the requeued run, whose ranks may be mapped first.
                esc = wait_until("the requeued run's release recorded",
                                 lambda: escalation(store, job),
                                 lambda e: e.get("released_at") is not None, 30)
                text = finish(cluster, job, out, clean, timeout=240)
                lasted = time.monotonic() - requeued
        assert esc["run"] == 0 and "no usable spare" in esc["reason"], esc
        assert esc["requeued_at"] is not None and esc["released_at"] is not None, esc
        # every rank of the second run resumed from a checkpoint, none from scratch, and
        # once: no healthy rank was restarted in place
        resumed = [x for x in text.splitlines() if " resumed at step " in x]
        assert sorted(int(x.split()[1]) for x in resumed) == sorted(ranks), text[-4000:]
        assert all(int(x.rsplit(" ", 1)[1]) > 0 for x in resumed)
        # a shorter requeued run would pass whether or not an srun was left behind
        assert lasted > kill_wait + 2, f"the requeued run ended {lasted:.0f} s after the " \
            f"requeue, within KillWait ({kill_wait} s) + 2 s"
        # (the first run's step and job are cancelled "DUE TO JOB REQUEUE": before it)
        second = text[text.index(f"job {job} run 1:"):]
        assert " CANCELLED " not in second, second[-4000:]
    finally:
        with contextlib.suppress(SlurmCommandError):
            CommandRunner(timeout=60, env=cluster.env).run(["scancel", job])
