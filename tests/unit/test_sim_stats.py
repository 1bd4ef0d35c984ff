"""The simulator's statistics: Student-t quantiles and confidence half-widths, bootstrap
intervals of percentiles, seeds for a stated half-width."""

from __future__ import annotations

import csv
import io
import math
import random
import statistics
from typing import Any

import pytest

from raps_slurm.sim.results import (
    T975,
    _pct,
    bootstrap_pct_ci95,
    ci95,
    seeds_for_half_width,
    t975,
    to_csv,
)
from raps_slurm.sim.runner import report, simulate
from raps_slurm.sim.scenario import Scenario
from raps_slurm.sim.scenario import parse_scenario as parse_any


def parse_scenario(data: object, source: str = "scenario") -> Scenario:
    """A scenario whose strategies checkpoint every 600 s unless it says otherwise: these
    tests check the strategies' mechanics, not the planner's interval search."""
    if isinstance(data, dict):
        ck = data.get("checkpoint")
        if ck is None or (isinstance(ck, dict) and "interval_s" not in ck):
            data = {**data, "checkpoint": {**(ck or {}), "interval_s": 600.0}}
    return parse_any(data, source)


def t_cdf(q: float, df: int, steps: int = 20_000) -> float:
    """P(T <= q) for Student's t with ``df`` degrees of freedom, by Simpson's rule."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def pdf(x: float) -> float:
        return c * math.pow(1 + x * x / df, -(df + 1) / 2)

    h = q / steps
    total = pdf(0.0) + pdf(q) + sum((4 if k % 2 else 2) * pdf(k * h) for k in range(1, steps))
    return 0.5 + total * h / 3


@pytest.mark.parametrize("df", sorted(T975))
def test_every_table_entry_is_the_975_quantile(df: int) -> None:
    assert t_cdf(T975[df], df) == pytest.approx(0.975, abs=2e-5)


@pytest.mark.parametrize("df", [21, 27, 35, 50, 90, 200, 1000])
def test_interpolated_quantiles_are_close(df: int) -> None:
    assert t_cdf(t975(df), df) == pytest.approx(0.975, abs=2e-4)


def test_small_samples_get_wider_intervals_than_the_normal() -> None:
    values = [0.90, 0.92, 0.91, 0.95, 0.93]
    sd = statistics.stdev(values)
    assert ci95(values) == pytest.approx(2.7764 * sd / math.sqrt(5))
    assert ci95(values) > 1.96 * sd / math.sqrt(5)
    assert ci95([0.5]) == 0.0


def test_bootstrap_interval_covers_the_true_quantile() -> None:
    """Percentile bootstrap of a median and a p90 of exponential samples: the interval holds
    the true quantile about 95 % of the time and narrows with more samples."""
    rng = random.Random(7)
    hits = {0.5: 0, 0.9: 0}
    trials = 200
    for k in range(trials):
        values = [rng.expovariate(1.0) for _ in range(150)]
        for q in hits:
            got = bootstrap_pct_ci95(values, q, seed=k)
            assert got is not None
            lo, hi = got
            assert lo <= _pct(values, q) <= hi  # type: ignore[operator]
            hits[q] += lo <= -math.log(1 - q) <= hi
    for q, n in hits.items():
        assert 0.88 <= n / trials <= 0.995, (q, n)
    small = bootstrap_pct_ci95([rng.expovariate(1.0) for _ in range(50)], 0.5)
    large = bootstrap_pct_ci95([rng.expovariate(1.0) for _ in range(5000)], 0.5)
    assert small is not None and large is not None
    assert large[1] - large[0] < (small[1] - small[0]) / 3
    assert bootstrap_pct_ci95([1.0], 0.5) is None


def test_seeds_for_a_half_width_is_the_smallest_that_reaches_it() -> None:
    values = [0.90, 0.92, 0.91, 0.95, 0.93]
    sd = statistics.stdev(values)
    n = seeds_for_half_width(values, 0.005)
    assert t975(n - 1) * sd / math.sqrt(n) <= 0.005 < t975(n - 2) * sd / math.sqrt(n - 1)
    assert seeds_for_half_width(values, 1.0) == 2  # any two seeds would do
    assert seeds_for_half_width([0.5, 0.5, 0.5], 0.001) == 3


def test_half_width_runs_seeds_until_it_is_reached() -> None:
    run: dict[str, Any] = {"horizon_days": 10, "seeds": 2, "strategies": ["global", "raps"]}
    base: dict[str, Any] = {"job": {"nodes": 16}, "failures": {"mtbf_h": 300}}
    s = parse_scenario({**base, "run": {**run, "half_width": 0.004}}, "t")
    runs = simulate(s)
    n = len(runs["global"])
    assert n >= 3 and len(runs["raps"]) == n
    rep = report(s, runs, 0.0)
    assert rep["seeds"] == n and rep["half_width"]["reached"]
    for name, rs in runs.items():
        assert ci95([r.useful_work_fraction for r in rs]) <= 0.004, name
    # A target out of reach stops at run.max_seeds and says so.
    capped = parse_scenario({**base, "run": {**run, "half_width": 1e-6, "max_seeds": 4}}, "t")
    rep = report(capped, simulate(capped), 0.0)
    assert rep["seeds"] == 4 and not rep["half_width"]["reached"]


def test_csv_has_the_bootstrap_bounds() -> None:
    rows = [{"strategy": "raps", "recovery_p50_s": 5.0, "recovery_p50_s_ci95": [4.0, 6.5]}]
    (row,) = csv.DictReader(io.StringIO(to_csv(rows)))
    assert (row["recovery_p50_s_ci95_low"], row["recovery_p50_s_ci95_high"]) == ("4.0", "6.5")
    assert row["recovery_p90_s_ci95_low"] == ""
