"""``rapsctl bench launch`` without a cluster: the launch time from the time stamps, the
JSON object and its goals, and the count of a process's descendants."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from raps_slurm.bench.launch import Sampler, launch_seconds, summary
from raps_slurm.errors import BenchError


def test_launch_time_is_the_last_rank_after_the_start() -> None:
    assert launch_seconds(100.0, {0: 100.5, 1: 102.25, 2: 101.0}, 3) == pytest.approx(2.25)


def test_ranks_that_never_ran_are_named() -> None:
    with pytest.raises(BenchError, match=r"^2 of 4 ranks never ran: 1, 3$"):
        launch_seconds(0.0, {0: 1.0, 2: 1.0}, 4)


def test_summary_takes_medians_and_judges_the_goals() -> None:
    got = summary(6, 16, [3.0, 4.0, 3.5], [2.0, 3.0, 2.5], [2, 3, 2], [1, 1, 1])
    assert (got["ranks"], got["repeats"]) == (96, 3)
    assert (got["raps_launch_s"], got["srun_launch_s"], got["ratio"]) == (3.5, 2.5, 1.4)
    assert got["batch_host_processes"] == 3 and got["srun_batch_host_processes"] == 1
    assert got["goals"] == {"ratio_max": 1.5, "batch_host_processes_max": 16}
    assert got["goals_met"] is True
    slow = summary(6, 16, [4.0], [2.0], [2], [1])
    assert slow["ratio"] == 2.0 and slow["goals_met"] is False
    crowded = summary(2, 16, [1.0], [1.0], [13], [1])
    assert crowded["goals"]["batch_host_processes_max"] == 12 and not crowded["goals_met"]


def test_sampler_counts_descendants_of_the_written_pid(tmp_path: Path) -> None:
    start = tmp_path / "start"
    proc = subprocess.Popen(["bash", "-c", f'echo "$$ 0" > {start}; sleep 1 & sleep 1 & wait'])
    sampler = Sampler(start)
    sampler.start()
    proc.wait(10)
    sampler.halt.set()
    sampler.join(5)
    assert sampler.most == 2
