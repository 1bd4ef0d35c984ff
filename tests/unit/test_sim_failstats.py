"""The failure statistics: chi-square quantiles against tables, the MTBF's confidence
interval, and the maximum-likelihood exponential and Weibull fits of uptimes."""

from __future__ import annotations

import math
import random

import pytest

from raps_slurm.sim.failstats import (
    chi2_cdf,
    chi2_quantile,
    fit_uptimes,
    gamma_p,
    mtbf_interval,
    node_uptimes,
)


@pytest.mark.parametrize(("p", "dof", "table"), [
    (0.975, 2, 7.377759), (0.025, 2, 0.05063562), (0.975, 10, 20.48318),
    (0.025, 10, 3.246973), (0.95, 1, 3.841459), (0.5, 1, 0.4549364),
    (0.025, 40, 24.43304), (0.975, 40, 59.34171), (0.99, 100, 135.8067),
    (0.975, 22, 36.78071), (0.025, 20, 9.590777),
])
def test_chi2_quantiles_match_the_tables(p: float, dof: int, table: float) -> None:
    assert chi2_quantile(p, dof) == pytest.approx(table, rel=1e-6)


@pytest.mark.parametrize("n", [1, 3, 10, 60])
def test_even_dof_cdf_is_the_poisson_sum(n: int) -> None:
    # P(chi2(2n) <= x) = 1 - sum_{k<n} e^{-x/2} (x/2)^k / k!: an independent closed form
    for x in (0.5, 2.0 * n, 5.0 * n):
        poisson = sum(math.exp(-x / 2) * (x / 2) ** k / math.factorial(k) for k in range(n))
        assert chi2_cdf(x, 2 * n) == pytest.approx(1.0 - poisson, abs=1e-12)


def test_mtbf_interval_of_ten_failures() -> None:
    # 10 failures in 1000 h: [2T / chi2(0.975, 22), 2T / chi2(0.025, 20)] from the tables
    low, high = mtbf_interval(10, 1000.0)
    assert low == pytest.approx(2000.0 / 36.78071, rel=1e-6)
    assert high == pytest.approx(2000.0 / 9.590777, rel=1e-6)
    assert low < 100.0 < high


def test_mtbf_interval_narrows_with_failures_and_is_open_without_one() -> None:
    widths = []
    for n in (5, 50, 500):
        low, high = mtbf_interval(n, 100.0 * n)
        assert low < 100.0 < high
        widths.append(high / low)
    assert widths[0] > widths[1] > widths[2] > 1.0
    low, high = mtbf_interval(0, 1000.0)
    assert math.isinf(high) and low == pytest.approx(2000.0 / 7.377759, rel=1e-6)


@pytest.mark.parametrize("bad", [(-1, 10.0), (3, 0.0)])
def test_mtbf_interval_refuses_bad_input(bad: tuple[int, float]) -> None:
    with pytest.raises(ValueError, match="mtbf_interval"):
        mtbf_interval(*bad)


def test_gamma_p_is_a_cdf() -> None:
    assert gamma_p(1.0, 1.0) == pytest.approx(1.0 - math.exp(-1.0), abs=1e-14)
    assert gamma_p(3.0, 0.0) == 0.0
    assert gamma_p(2.5, 50.0) == pytest.approx(1.0, abs=1e-12)


def _log_likelihood(k: float, scale: float, fails: list[float], cens: list[float]) -> float:
    ll = sum(math.log(k / scale) + (k - 1) * math.log(t / scale) - (t / scale) ** k
             for t in fails)
    return ll - sum((t / scale) ** k for t in cens)


def test_weibull_fit_is_the_maximum_of_the_likelihood() -> None:
    rng = random.Random(7)
    fails = [rng.weibullvariate(500.0, 0.7) for _ in range(300)]
    cens = [rng.uniform(10.0, 2000.0) for _ in range(40)]
    fit = fit_uptimes(fails, cens)
    k, scale = fit.weibull_shape, fit.weibull_scale_h
    best = _log_likelihood(k, scale, fails, cens)
    assert fit.weibull_log_likelihood == pytest.approx(best, rel=1e-9)
    for dk, ds in ((1.01, 1.0), (0.99, 1.0), (1.0, 1.01), (1.0, 0.99)):
        assert _log_likelihood(k * dk, scale * ds, fails, cens) < best
    assert fit.weibull_aic == pytest.approx(4.0 - 2.0 * best)


def test_exponential_fit_is_total_time_over_failures() -> None:
    fit = fit_uptimes([1.0, 2.0, 3.0], [4.0])
    assert fit.exp_mean_h == pytest.approx(10.0 / 3.0)
    assert fit.exp_log_likelihood == pytest.approx(-3.0 * math.log(10.0 / 3.0) - 3.0)
    assert (fit.uptimes, fit.failures) == (4, 3)


def test_weibull_data_are_told_from_exponential_data() -> None:
    rng = random.Random(11)
    weib = fit_uptimes([rng.weibullvariate(100.0, 0.7) for _ in range(3000)])
    assert weib.weibull_shape == pytest.approx(0.7, abs=0.03)
    assert weib.better == "weibull" and weib.lr_p_value < 1e-6
    expo = fit_uptimes([rng.expovariate(0.01) for _ in range(3000)])
    assert expo.weibull_shape == pytest.approx(1.0, abs=0.04)
    assert expo.better == "exponential" and expo.lr_p_value > 0.05


def test_fits_scale_with_the_unit_of_time() -> None:
    rng = random.Random(3)
    xs = [rng.weibullvariate(50.0, 1.6) for _ in range(200)]
    a, b = fit_uptimes(xs), fit_uptimes([x * 60.0 for x in xs])
    assert b.weibull_shape == pytest.approx(a.weibull_shape, rel=1e-9)
    assert b.weibull_scale_h == pytest.approx(a.weibull_scale_h * 60.0, rel=1e-9)
    assert b.exp_mean_h == pytest.approx(a.exp_mean_h * 60.0, rel=1e-12)


@pytest.mark.parametrize(("fails", "cens"), [([5.0], []), ([3.0, 3.0], [1.0]),
                                             ([1.0, 0.0], [])])
def test_a_fit_needs_two_different_positive_uptimes(fails: list[float],
                                                    cens: list[float]) -> None:
    with pytest.raises(ValueError, match="fit_uptimes"):
        fit_uptimes(fails, cens)


def test_node_uptimes_run_from_repair_to_the_next_failure() -> None:
    outages = [("a", 10.0, 12.0), ("a", 30.0, 31.0), ("a", 30.5, 40.0),  # the same outage
               ("a", 60.0, None), ("b", 5.0, 6.0)]
    fails, cens = node_uptimes(outages, 100.0)
    assert sorted(fails) == [18.0, 20.0]        # 12 -> 30, 40 -> 60
    assert sorted(cens) == [40.0, 94.0]         # a up from 60, b from 6, to 100
