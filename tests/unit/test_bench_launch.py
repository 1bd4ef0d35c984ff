"""``rapsctl bench launch`` without a cluster: the launch time from the time stamps, the
JSON object and its goals, one-line errors, and the count of a process's descendants."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from raps_slurm.bench.launch import Run, Sampler, launch_times, one_line, summary
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
    return [Run(s, s / 2, 0.5, n) for s, n in zip(launch, processes, strict=True)]


def test_summary_takes_medians_and_judges_the_goals() -> None:
    got = summary(6, 16, runs([3.0, 4.0, 3.5], [2, 3, 2]), runs([2.0, 3.0, 2.5], [1, 1, 1]))
    assert (got["ranks"], got["repeats"]) == (96, 3)
    assert (got["raps_launch_s"], got["srun_launch_s"], got["ratio"]) == (3.5, 2.5, 1.4)
    assert (got["raps_first_rank_s"], got["raps_step_started_s"]) == (1.75, 0.5)
    assert got["batch_host_processes"] == 3 and got["srun_batch_host_processes"] == 1
    assert got["goals"] == {"ratio_max": 1.5, "batch_host_processes_max": 16}
    assert got["goals_met"] is True
    slow = summary(6, 16, runs([4.0], [2]), runs([2.0], [1]))
    assert slow["ratio"] == 2.0 and slow["goals_met"] is False
    crowded = summary(2, 16, runs([1.0], [13]), runs([1.0], [1]))
    assert crowded["goals"]["batch_host_processes_max"] == 12 and not crowded["goals_met"]
    unseen = summary(1, 1, [Run(1.0, 1.0, None, 0)], runs([1.0], [0]))
    assert unseen["raps_step_started_s"] is None


def test_sampler_counts_descendants_of_the_written_pid(tmp_path: Path) -> None:
    start = tmp_path / "start"
    proc = subprocess.Popen(["bash", "-c", f'echo "$$ 0" > {start}; sleep 1 & sleep 1 & wait'])
    sampler = Sampler(start)
    sampler.start()
    proc.wait(10)
    sampler.halt.set()
    sampler.join(5)
    assert sampler.most == 2 and sampler.first_seen is not None
