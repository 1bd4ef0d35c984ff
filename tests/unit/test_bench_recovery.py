"""``rapsctl bench recovery`` without a cluster: the drawn crash points, the quantiles and
the summary over runs (goal judged on the p50, the median run at the top level)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.bench.recovery import (
    GOAL_TOTAL_S,
    crash_points,
    percentile,
    program_args,
    reexecution,
    summarize,
)
from raps_slurm.errors import BenchError
from raps_slurm.sim.calibrate import kind_of


def test_crash_points_cover_the_interval_and_repeat_with_the_seed() -> None:
    points = crash_points(4, 400, 60)
    assert all(0.0 <= p <= 60.0 for p in points)
    # uniform: each third of the interval gets a fair share of 400 draws
    thirds = [sum(1 for p in points if k * 20 <= p < (k + 1) * 20) for k in range(3)]
    assert all(100 < n < 170 for n in thirds), thirds
    assert crash_points(4, 5, 60) == points[:5]
    assert crash_points(5, 5, 60) != points[:5]


def test_percentile_interpolates_between_the_nearest() -> None:
    assert percentile([3.0], 0.9) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0, 5.0], 0.5) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == 4.6
    assert percentile([1.0, 2.0], 0.5) == 1.5
    with pytest.raises(BenchError, match="no run"):
        percentile([], 0.5)


def run(total: float, restarted: int = 0) -> dict[str, Any]:
    return {"total_s": total, "caught_up_s": total, "running_s": total - 2,
            "detect_s": 3.0, "restore_s": 4.0, "reexecute_s": 2.0, "replay_s": 0.5,
            "plan_s": 0.03, "moved_bytes": 1 << 30, "crash_after_commit_s": total / 10,
            "healthy_ranks_restarted": restarted}


def test_the_goal_is_judged_on_the_p50_and_the_median_run_is_on_top() -> None:
    rows = [run(9.0), run(30.0), run(11.0), run(10.0), run(25.0)]
    got = summarize(rows, 1, 7)
    assert (got["runs"], got["seed"], got["checkpoint_interval_s"]) == (5, 7, 1)
    assert got["median_run"] == 2 and got["total_s"] == 11.0 == got["total_p50_s"]
    assert got["total_p90_s"] == 28.0 and got["running_p50_s"] == 9.0
    assert got["goals"] == {"total_p50_s_max": GOAL_TOTAL_S, "healthy_ranks_restarted_max": 0}
    assert got["goals_met"] is True  # two slow runs of five: the p50 is under 12 s
    assert got["per_run"] == rows
    # what rapsctl simulate calibrate reads is there, and it is still a recovery
    assert kind_of(got) == "recovery"
    slow = summarize([run(9.0), run(13.0), run(14.0)], 1, 7)
    assert slow["total_p50_s"] == 13.0 and slow["goals_met"] is False


def test_a_healthy_rank_restarted_in_any_run_misses_the_goal() -> None:
    got = summarize([run(9.0), run(9.5, restarted=1), run(10.0, restarted=2)], 1, 1)
    assert got["healthy_ranks_restarted"] == 3 and got["goals_met"] is False


def test_an_even_count_takes_the_lower_median_run() -> None:
    got = summarize([run(12.0), run(8.0), run(10.0), run(20.0)], 60, 1)
    assert got["median_run"] == 2 and got["total_s"] == 10.0
    assert got["total_p50_s"] == 11.0  # interpolated, as p90 is


def jacobi_output(crashed: float) -> str:
    """jacobi_prog's lines for rank 3: 40 failure-free steps of 0.1 s (0.05 s of CPU)
    until the crash, then a relaunch restored at step 30 that redoes 10 steps at 0.05 s
    (0.04 s of CPU);
    rank 0's lines in between must not count."""
    lines, t, cpu = [], crashed - 4.0, 1.0
    for step in range(1, 41):
        t, cpu = t + 0.1, cpu + 0.05
        lines += [f"progress 3 1 {step} {t:.4f} {cpu:.4f}", f"progress 0 1 {step} {t:.4f} 9"]
    lines.append(f"resumed 3 2 30 {crashed + 5:.4f} 0.4")
    for step in range(31, 45):
        lines.append(f"progress 3 2 {step} {crashed + 5 + (step - 30) * 0.05:.4f} "
                     f"{0.4 + (step - 30) * 0.04:.4f}")
    return "\n".join(lines) + "\nfinal a b c d\n"


def test_reexecution_speed_is_lost_work_at_the_failure_free_pace_over_its_time() -> None:
    crashed = 1000.0
    got = reexecution(jacobi_output(crashed), 3, crashed)
    assert got is not None
    assert (got["pre_fault_step"], got["restored_step"], got["reexec_steps"]) == (40, 30, 10)
    assert got["failure_free_step_s"] == pytest.approx(0.1, abs=1e-3)
    assert got["failure_free_step_cpu_s"] == pytest.approx(0.05, abs=1e-3)
    assert got["reexec_s"] == pytest.approx(0.5, abs=1e-3)
    # 10 steps of 0.1 s redone in 0.5 s: twice the failure-free speed; on CPU time, once
    assert got["replay_speed"] == pytest.approx(2.0, rel=0.01)
    assert got["replay_speed_cpu"] == pytest.approx(1.0, rel=0.01)
    # core for core: 10 steps of 0.05 s of CPU redone with 0.04 s of CPU each
    assert got["replay_speed_core"] == pytest.approx(1.25, rel=0.01)
    # not yet at the pre-fault step again, or no relaunch yet: nothing to report
    cut = jacobi_output(crashed).split("progress 3 2 40 ")[0]
    assert reexecution(cut, 3, crashed) is None
    assert reexecution(jacobi_output(crashed).split("resumed")[0], 3, crashed) is None


def test_the_summary_gives_the_replay_speed_over_runs() -> None:
    rows = [{**run(5.0), "replay_speed": 2.0, "replay_speed_cpu": 0.7},
            {**run(6.0), "replay_speed": 1.0, "replay_speed_cpu": 0.5},
            {**run(7.0), "replay_speed": None, "replay_speed_cpu": None}]
    out = summarize(rows, 4.0, 1)
    assert (out["replay_speed_p50"], out["replay_speed_min"]) == (1.5, 1.0)
    assert out["replay_speed_cpu_p50"] == 0.6
    assert "replay_speed_p50" not in summarize([run(5.0)], 4.0, 1)


def test_program_args_name_the_choices() -> None:
    script, args = program_args("compute", 100, 64 << 20, 1, 4)
    assert script.name == "jacobi_prog.py" and "--sleep-sec" not in args
    assert "--sleep-sec" in program_args("sleep", 100, 64 << 20, 1, 4)[1]
    assert program_args("heat_ring", 100, 64 << 20, 1, 1)[0].name == "heat_ring.py"
    with pytest.raises(BenchError, match="one of heat_ring, compute, sleep"):
        program_args("fortran", 100, 1, 1, 1)


def test_jacobi_prog_prints_a_timed_line_per_step(tmp_path: Path) -> None:
    """The program the benchmark parses, run by the local launcher on two ranks."""
    out = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", "-n", "2",
                          "--dir", str(tmp_path), "--", sys.executable, "-m",
                          "raps_slurm.bench.jacobi_prog", "--steps", "5", "--rows", "8",
                          "--cols", "16", "--sweeps", "2"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    lines = [x.split() for x in out.splitlines() if x.startswith("progress ")]
    assert sorted((int(x[1]), int(x[3])) for x in lines) == [
        (r, s) for r in (0, 1) for s in range(1, 6)]
    assert all(float(x[4]) > 1e9 and float(x[5]) >= 0 for x in lines)
    assert any(x.startswith("final ") for x in out.splitlines())
