"""``rapsctl bench recovery`` without a cluster: the drawn crash points, the quantiles and
the summary over runs (goal judged on the p50, the median run at the top level)."""

from __future__ import annotations

from typing import Any

import pytest

from raps_slurm.bench.recovery import GOAL_TOTAL_S, crash_points, percentile, summarize
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
