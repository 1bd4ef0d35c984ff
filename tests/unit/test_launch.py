"""raps-run's decisions: which srun options pass, what to relaunch, when the job is over."""

from __future__ import annotations

import pytest

from raps_slurm.core.launch import (
    Incarnation,
    Relaunch,
    outcome,
    relaunches,
    run_flags,
    split_command,
)
from raps_slurm.slurm.commands import srun_rank


def test_run_flags_are_taken_out_of_the_srun_options() -> None:
    assert run_flags(["--mem=1G", "-l", "--mpi4py", "-c", "2"]) == (
        {"label", "mpi4py"}, ["--mem=1G", "-c", "2"])
    assert run_flags(["--label"]) == ({"label"}, [])
    assert run_flags(["-J", "x", "--gres=gpu:1"]) == (set(), ["-J", "x", "--gres=gpu:1"])


def test_split_command_passes_user_options_and_refuses_placement_ones() -> None:
    assert split_command(["--mem=1G", "-c", "2", "--", "python", "app.py", "--", "x"]) == (
        ["--mem=1G", "-c", "2"], ["python", "app.py", "--", "x"])
    for bad, name in ((["-N2"], "--nodes"), (["-n", "4"], "--ntasks"), (["-wn1"], "--nodelist"),
                      (["--nodelist=n[1-2]"], "--nodelist"), (["--exact"], "--exact"),
                      (["--jobid=3"], "--jobid")):
        with pytest.raises(ValueError, match=f"raps-run sets {name} itself"):
            split_command([*bad, "--", "true"])
    with pytest.raises(ValueError, match="'--' is missing"):
        split_command(["python", "app.py"])
    with pytest.raises(ValueError, match="no program"):
        split_command(["--mem=1G", "--"])


def test_srun_argv_is_one_task_on_one_named_node() -> None:
    argv = srun_rank("n4", "raps-7-r3e2", ["--mem=1G"], ["python", "app.py"])
    assert argv[:8] == ["srun", "-N1", "-n1", "-w", "n4", "--exact", "--no-kill",
                        "--kill-on-bad-exit=0"]
    assert argv[-3:] == ["--mem=1G", "python", "app.py"]


CURRENT = {0: Incarnation(0, "n1", 1), 1: Incarnation(1, "n3", 1), 2: Incarnation(2, "n5", 3)}


def plan(rank: int, epoch: int, state: str, run: int = 0, target: str = "n6") -> dict[str, object]:
    return {"plan_id": f"7-{rank}-{epoch}", "run": run, "rank": rank, "target": target,
            "epoch": epoch, "state": state}


def test_relaunch_only_started_plans_of_this_run_with_a_newer_epoch() -> None:
    plans = [plan(1, 2, "running"), plan(0, 2, "queued"), plan(2, 3, "done"),
             plan(0, 2, "running", run=1), plan(1, 3, "escalated")]
    assert relaunches(CURRENT, plans, 0) == [Relaunch(1, "n6", 2, "7-1-2")]
    # after the relaunch the same plan asks for nothing more
    moved = {**CURRENT, 1: Incarnation(1, "n6", 2)}
    assert relaunches(moved, plans, 0) == []


def test_outcome_done_failed_or_waiting() -> None:
    done = {r: Incarnation(r, "n1", 1, 0, 5.0) for r in range(3)}
    assert outcome(done, 10.0, 6.0).done
    failed = {**done, 1: Incarnation(1, "n3", 1, 9, 5.0)}
    assert not outcome(failed, 10.0, 6.0).failed  # within the grace period: a plan may come
    o = outcome(failed, 11.5, 6.0)
    assert o.failed and o.rank == 1 and o.exit_code == 9
    running = {**done, 2: Incarnation(2, "n5", 1)}
    assert outcome(running, 100.0, 6.0) == outcome({}, 0.0, 1.0)


def test_a_rank_that_stopped_as_fenced_is_waited_for_longer() -> None:
    from raps_slurm.core.launch import FENCED_EXIT

    fenced = {0: Incarnation(0, "n1", 1, FENCED_EXIT, 5.0), 1: Incarnation(1, "n3", 1)}
    assert not outcome(fenced, 20.0, 6.0, fenced_grace=60.0).failed
    o = outcome(fenced, 65.0, 6.0, fenced_grace=60.0)
    assert o.failed and o.exit_code == FENCED_EXIT
    assert outcome(fenced, 20.0, 6.0).failed  # without a longer grace: the usual one


def test_a_rank_that_could_not_reach_its_agent_waits_for_its_nodes_move() -> None:
    # Exit 1 on n5 with no agent there: a failure of n5, not of the program.
    lost = {0: Incarnation(0, "n5", 1, 1, 5.0, node_failed=True), 1: Incarnation(1, "n3", 1)}
    assert not outcome(lost, 20.0, 6.4, 60.0, node_grace=60.0).failed
    o = outcome(lost, 65.5, 6.4, 60.0, node_grace=60.0)
    assert o.failed and o.rank == 0 and o.exit_code == 1
    # The same exit with its agent there is the program's: the usual grace.
    failed = {**lost, 0: Incarnation(0, "n5", 1, 1, 5.0)}
    assert outcome(failed, 20.0, 6.4, 60.0, node_grace=60.0).failed


def test_planned_moves_ask_the_running_rank_once() -> None:
    from raps_slurm.core.launch import Incarnation, moves_to_prepare

    current = {0: Incarnation(0, "n1", 1), 1: Incarnation(1, "n3", 1),
               2: Incarnation(2, "n5", 1, exit_code=85, exited_at=1.0)}
    plans = [{"plan_id": "7-0-2", "run": 0, "rank": 0, "epoch": 2, "state": "queued",
              "planned": True},
             {"plan_id": "7-1-2", "run": 0, "rank": 1, "epoch": 2, "state": "queued"},
             {"plan_id": "7-2-2", "run": 0, "rank": 2, "epoch": 2, "state": "queued",
              "planned": True},
             {"plan_id": "7-0-9", "run": 1, "rank": 0, "epoch": 9, "state": "queued",
              "planned": True}]
    assert moves_to_prepare(current, plans, 0, ()) == [(0, 2)]
    assert moves_to_prepare(current, plans, 0, [0]) == []


def test_cpus_per_rank_is_taken_out_of_the_step_options() -> None:
    from raps_slurm.core.launch import cpus_per_rank

    assert cpus_per_rank(["--mem=1G"]) == (1, ["--mem=1G"])
    assert cpus_per_rank(["-c", "4", "--mem=1G"]) == (4, ["--mem=1G"])
    assert cpus_per_rank(["-c3"]) == (3, [])
    assert cpus_per_rank(["--cpus-per-task=2", "--gres=gpu:1"]) == (2, ["--gres=gpu:1"])
    for bad in (["-c"], ["-c", "0"], ["--cpus-per-task=x"]):
        with pytest.raises(ValueError, match=r"cpus-per-task|needs a value"):
            cpus_per_rank(bad)


def test_step_cpus_ask_for_every_rank_or_overcommit() -> None:
    from raps_slurm.core.launch import job_cpus_per_node, step_cpu_options

    assert job_cpus_per_node("2(x3),1") == [2, 2, 2, 1]
    assert job_cpus_per_node("64") == [64]
    assert job_cpus_per_node("") == [] and job_cpus_per_node("2(xz)") == []
    assert step_cpu_options(2, 16, [64, 32]) == ["--cpus-per-task=32"]
    assert step_cpu_options(1, 4, [2, 2]) == ["--overcommit"]  # the test cluster: CPUs=2
    assert step_cpu_options(1, 4, []) == ["--overcommit"]  # unknown: never refused


def test_cpu_share_even_contiguous_or_round_robin() -> None:
    from raps_slurm.core.launch import cpu_share

    cpus = list(range(8))
    assert [cpu_share(cpus, s, 4) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [cpu_share(cpus, s, 3) for s in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [cpu_share([4, 0], s, 4) for s in range(4)] == [[0], [4], [0], [4]]
    assert cpu_share(cpus, 0, 1) == cpus
    with pytest.raises(ValueError):
        cpu_share([], 0, 1)


def test_slots_and_targets() -> None:
    from raps_slurm.core.launch import by_target, free_slot, node_slots

    assert node_slots([(3, "n2"), (0, "n1"), (1, "n1"), (2, "n2"), (4, "n2")]) == {
        0: ("n1", 0, 2), 1: ("n1", 1, 2), 2: ("n2", 0, 3), 3: ("n2", 1, 3), 4: ("n2", 2, 3)}
    assert free_slot({0, 2}, 4) == 1 and free_slot(set(), 2) == 0
    assert free_slot({0, 1}, 2) == 0  # every slot taken: round-robin
    todo = [Relaunch(5, "n6", 2, "p5"), Relaunch(4, "n6", 2, "p4"), Relaunch(1, "n1", 3, "p1")]
    assert by_target(todo) == {"n1": [Relaunch(1, "n1", 3, "p1")],
                               "n6": [Relaunch(4, "n6", 2, "p4"), Relaunch(5, "n6", 2, "p5")]}
