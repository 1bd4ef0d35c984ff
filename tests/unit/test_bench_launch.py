"""``rapsctl bench launch`` without a cluster: the launch time from the time stamps, the
JSON object and its goals, one-line errors, and the count of a process's descendants."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from raps_slurm.bench.launch import (
    Run,
    Sampler,
    launch_times,
    one_line,
    sampled_processes,
    summary,
)
from raps_slurm.errors import BenchError


def test_launch_time_is_the_last_rank_after_the_start() -> None:
    last, first = launch_times(100.0, {0: 100.5, 1: 102.25, 2: 101.0}, 3)
    assert (last, first) == (pytest.approx(2.25), pytest.approx(0.5))


def test_ranks_that_never_ran_are_named() -> None:
    with pytest.raises(BenchError, match=r"^2 of 4 ranks never ran: 1, 3$"):
        launch_times(0.0, {0: 1.0, 2: 1.0}, 4)


def test_errors_become_one_line() -> None:
    assert one_line("scontrol failed: a\n  b\n\nc") == "scontrol failed: a / b / c"


def runs(launch: list[float], processes: list[int]) -> list[Run]:
    return [Run(s, s / 2, s / 4, 0.5, n) for s, n in zip(launch, processes, strict=True)]


def test_summary_takes_medians_and_judges_the_goals() -> None:
    got = summary(6, 16, runs([3.0, 4.0, 3.5], [2, 3, 2]), runs([2.0, 3.0, 2.5], [1, 1, 1]))
    assert (got["ranks"], got["repeats"]) == (96, 3)
    assert (got["raps_launch_s"], got["srun_launch_s"], got["ratio"]) == (3.5, 2.5, 1.4)
    assert (got["raps_first_rank_s"], got["raps_step_started_s"]) == (1.75, 0.5)
    # submission -> batch script, and from there the launcher's own part
    assert (got["raps_batch_start_s"], got["srun_batch_start_s"]) == (0.875, 0.625)
    assert (got["raps_from_exec_s"], got["srun_from_exec_s"]) == (2.625, 1.875)
    assert got["batch_host_processes"] == 3 and got["srun_batch_host_processes"] == 1
    assert got["goals"] == {"ratio_max": 1.5, "batch_host_processes_max": 16}
    assert got["goals_met"] is True
    slow = summary(6, 16, runs([4.0], [2]), runs([2.0], [1]))
    assert slow["ratio"] == 2.0 and slow["goals_met"] is False
    crowded = summary(2, 16, runs([1.0], [13]), runs([1.0], [1]))
    assert crowded["goals"]["batch_host_processes_max"] == 12 and not crowded["goals_met"]
    unseen = summary(1, 1, [Run(1.0, 1.0, 0.5, None, 0)], runs([1.0], [0]))
    assert unseen["raps_step_started_s"] is None


def test_sampler_counts_descendants_of_the_written_pid(tmp_path: Path) -> None:
    start = tmp_path / "start"
    proc = subprocess.Popen(["bash", "-c", f'echo "$$ 0" > {start}; sleep 1 & sleep 1 & wait'])
    sampler = Sampler(start)
    sampler.start()
    proc.wait(10)
    sampler.halt.set()
    sampler.join(5)
    assert sampler.most == 2 and sampler.first_seen is not None and sampler.error is None


def test_a_failed_sample_is_an_error_not_a_zero() -> None:
    with pytest.raises(BenchError, match=r"^batch-host sample failed: cannot sample"):
        sampled_processes("cannot sample process 7: access denied", 0, raps=False)
    with pytest.raises(BenchError, match="no process under raps-run"):
        sampled_processes(None, 0, raps=True)
    assert sampled_processes(None, 0, raps=False) == 0  # srun may hold no child
    assert sampled_processes(None, 3, raps=True) == 3


def test_sampler_without_a_pid_or_a_process_reports_why(tmp_path: Path) -> None:
    never = Sampler(tmp_path / "start")
    never.start()
    never.halt.set()
    never.join(5)
    assert never.error is not None and "never ran" in never.error
    gone = subprocess.Popen(["true"])
    gone.wait(10)
    (tmp_path / "start").write_text(f"{gone.pid} 0\n")
    ended = Sampler(tmp_path / "start")
    ended.start()
    ended.join(5)
    assert ended.samples == 0 and ended.error is not None and str(gone.pid) in ended.error
