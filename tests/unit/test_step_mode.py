"""raps-run --restart-mode step: its option, the step's host file and epochs, and the
Slurm commands it runs (pure functions)."""

from __future__ import annotations

import pytest

from raps_slurm.core.launch import restart_mode, step_epochs, step_hostfile, step_overcommit
from raps_slurm.slurm import commands
from raps_slurm.slurm.parsers import parse_steps


def test_restart_mode_is_read_and_removed_from_the_srun_options() -> None:
    assert restart_mode(["--mem=1G"]) == ("ranks", ["--mem=1G"])
    assert restart_mode(["--restart-mode", "step", "-c2"]) == ("step", ["-c2"])
    assert restart_mode(["-c2", "--restart-mode=ranks"]) == ("ranks", ["-c2"])


@pytest.mark.parametrize("words, what", [
    (["--restart-mode"], "needs a value: ranks or step"),
    (["--restart-mode=steps"], "'steps': expected ranks or step"),
    (["--restart-mode", ""], "'': expected ranks or step"),
])
def test_a_bad_restart_mode_is_refused_in_one_line(words: list[str], what: str) -> None:
    with pytest.raises(ValueError, match=what):
        restart_mode(words)


def test_the_host_file_puts_task_i_on_rank_is_node() -> None:
    placement = {0: ("n3", 1), 1: ("n1", 1), 2: ("n5", 2), 3: ("n1", 1)}
    assert step_hostfile(placement) == "n3\nn1\nn5\nn1\n"
    with pytest.raises(ValueError, match=r"not 0\.\.1"):
        step_hostfile({0: ("n1", 1), 2: ("n2", 1)})


def test_epochs_name_only_the_ranks_that_differ_from_the_most_common() -> None:
    assert step_epochs({0: ("n1", 1), 1: ("n1", 1)}) == {"RAPS_EPOCH": "1", "RAPS_EPOCHS": ""}
    got = step_epochs({0: ("n1", 1), 1: ("n2", 3), 2: ("n1", 1), 3: ("n2", 2)})
    assert got == {"RAPS_EPOCH": "1", "RAPS_EPOCHS": "1=3,3=2"}
    # every rank moved once: the common epoch is 2, nothing to list
    assert step_epochs({0: ("n2", 2), 1: ("n2", 2)})["RAPS_EPOCHS"] == ""


def test_overcommit_only_when_a_node_runs_more_ranks_than_the_cpus_it_holds() -> None:
    two_per_node = {0: ("n1", 1), 1: ("n1", 1), 2: ("n2", 1), 3: ("n2", 1)}
    assert step_overcommit(two_per_node, [2, 2, 2]) == []
    assert step_overcommit(two_per_node, [1, 2]) == ["--overcommit"]
    assert step_overcommit(two_per_node, []) == ["--overcommit"]


def test_the_mpi_step_uses_pmix_unless_the_user_names_an_mpi_plugin() -> None:
    argv = commands.srun_mpi_step(8, "raps-7-run0-step1", ["--mem=1G"], ["./heat", "9"])
    assert argv == ["srun", "--mpi=pmix", "--ntasks=8", "--distribution=arbitrary",
                    "--kill-on-bad-exit=1", "--job-name=raps-7-run0-step1", "--mem=1G",
                    "./heat", "9"]
    assert "--mpi=pmix" not in commands.srun_mpi_step(2, "x", ["--mpi=pmi2"], ["./a"])
    with pytest.raises(ValueError):
        commands.srun_mpi_step(0, "x", [], ["./a"])


def test_steps_of_one_job_by_name() -> None:
    text = ("7.batch batch\n7.extern extern\n7.0 raps-7-run0-step1\n"
            "17.3 raps-17-run0-step1\n7.4 raps-7-run0-step2\n")
    assert parse_steps(text, 7) == {"raps-7-run0-step1": 0, "raps-7-run0-step2": 4}
    assert commands.cancel_step(7, 4) == ["scancel", "--signal=KILL", "7.4"]
