"""Statistics of a failure log: how sure its MTBF is, and which distribution its uptimes follow.

Pure functions, no I/O. The chi-square quantiles come from the regularized incomplete
gamma function (series and continued fraction, as in Numerical Recipes), so no
statistics library is needed; the tests check them against tabulated values.

- :func:`mtbf_interval`: the two-sided confidence interval of an MTBF estimated from
  ``n`` failures over a total exposure ``T`` (node-hours), for an observation that ended
  at a time chosen in advance, not at a failure (time-truncated):
  ``[2T / chi2(1 - a/2, 2n + 2), 2T / chi2(a/2, 2n)]``.
- :func:`fit_uptimes`: maximum-likelihood exponential and Weibull fits of per-node
  uptimes, some right-censored (a node still up when the log ends), with their
  log-likelihoods, AIC and the likelihood-ratio test of the exponential (Weibull with
  shape 1) against the Weibull.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-14


def _gamma_series(a: float, x: float) -> float:
    term = total = 1.0 / a
    ap = a
    for _ in range(10_000):
        ap += 1.0
        term *= x / ap
        total += term
        if abs(term) < abs(total) * _EPS:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _gamma_fraction(a: float, x: float) -> float:
    """Q(a, x) by Lentz's continued fraction (x >= a + 1)."""
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def gamma_p(a: float, x: float) -> float:
    """The regularized lower incomplete gamma function P(a, x), a > 0, x >= 0."""
    if a <= 0:
        raise ValueError(f"gamma_p: a must be > 0, got {a}")
    if x <= 0:
        return 0.0
    if x < a + 1.0:
        return _gamma_series(a, x)
    return 1.0 - _gamma_fraction(a, x)


def chi2_cdf(x: float, dof: float) -> float:
    """P(X <= x) for X chi-square with ``dof`` degrees of freedom."""
    return gamma_p(dof / 2.0, x / 2.0)


def chi2_quantile(p: float, dof: float) -> float:
    """The ``p`` quantile of the chi-square distribution with ``dof`` degrees of freedom."""
    if not 0.0 < p < 1.0 or dof <= 0:
        raise ValueError(f"chi2_quantile: expected 0 < p < 1 and dof > 0, got p={p}, dof={dof}")
    lo, hi = 0.0, max(1.0, dof)
    while chi2_cdf(hi, dof) < p:
        hi *= 2.0
    for _ in range(200):  # bisection: the cdf is monotone; 200 halvings reach float precision
        mid = (lo + hi) / 2.0
        if chi2_cdf(mid, dof) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return (lo + hi) / 2.0


def mtbf_interval(failures: int, exposure: float, confidence: float = 0.95
                  ) -> tuple[float, float]:
    """Two-sided confidence interval of the MTBF from ``failures`` over ``exposure`` (the
    units of the result), time-truncated; the upper bound is infinite with no failure."""
    if failures < 0 or exposure <= 0 or not 0.0 < confidence < 1.0:
        raise ValueError(f"mtbf_interval: expected failures >= 0, exposure > 0 and "
                         f"0 < confidence < 1, got {failures}, {exposure}, {confidence}")
    alpha = 1.0 - confidence
    low = 2.0 * exposure / chi2_quantile(1.0 - alpha / 2.0, 2 * failures + 2)
    high = math.inf if failures == 0 else \
        2.0 * exposure / chi2_quantile(alpha / 2.0, 2 * failures)
    return low, high


@dataclass(frozen=True)
class UptimeFit:
    """Exponential and Weibull fits of uptimes (hours), and which one the data prefer."""

    uptimes: int                 # observed, failures and censored together
    failures: int                # uptimes that ended in a failure
    exp_mean_h: float            # exponential MLE: total time / failures
    exp_log_likelihood: float
    weibull_shape: float
    weibull_scale_h: float
    weibull_mean_h: float
    weibull_log_likelihood: float
    exp_aic: float
    weibull_aic: float
    lr_p_value: float            # P(the exponential fits this much worse by chance)

    @property
    def better(self) -> str:
        """``weibull`` when its AIC is lower, else ``exponential``."""
        return "weibull" if self.weibull_aic < self.exp_aic else "exponential"

    def as_json(self) -> dict[str, object]:
        """The fit as the report prints it."""
        return {"uptimes": self.uptimes, "failures": self.failures,
                "exponential": {"mean_h": round(self.exp_mean_h, 2),
                                "log_likelihood": round(self.exp_log_likelihood, 3),
                                "aic": round(self.exp_aic, 3)},
                "weibull": {"shape": round(self.weibull_shape, 4),
                            "scale_h": round(self.weibull_scale_h, 2),
                            "mean_h": round(self.weibull_mean_h, 2),
                            "log_likelihood": round(self.weibull_log_likelihood, 3),
                            "aic": round(self.weibull_aic, 3)},
                "better": self.better, "lr_p_value": float(f"{self.lr_p_value:.4g}")}


def _weibull_ll(k: float, times: Sequence[float], logs_fail: float, d: int
                ) -> tuple[float, float]:
    """The profile log-likelihood at shape k (scale at its MLE) and that scale."""
    big = max(times)
    s = sum((t / big) ** k for t in times)  # scaled by the largest time: no overflow
    scale = big * (s / d) ** (1.0 / k)
    ll = d * math.log(k) - d * k * math.log(scale) + (k - 1.0) * logs_fail - d
    return ll, scale


def _shape_equation(k: float, times: Sequence[float], logs: Sequence[float],
                    mean_log_fail: float) -> float:
    big = max(times)
    w = [float((t / big) ** k) for t in times]
    s = math.fsum(w)
    weighted = math.fsum(wi * li for wi, li in zip(w, logs, strict=True))
    return weighted / s - 1.0 / k - mean_log_fail


def fit_uptimes(uptimes: Sequence[float], censored: Sequence[float] = ()) -> UptimeFit:
    """Fit uptimes that ended in a failure and ``censored`` ones (still up at the end).

    Exponential: mean = total time / failures. Weibull: the shape solves
    sum(t^k ln t) / sum(t^k) - 1/k = mean(ln t over failures) (monotone in k, solved by
    bisection), scale = (sum(t^k) / failures)^(1/k). At least two positive failure
    uptimes of different lengths are needed.
    """
    fails = [float(t) for t in uptimes]
    cens = [float(t) for t in censored]
    if any(t <= 0 for t in fails) or any(t <= 0 for t in cens):
        raise ValueError("fit_uptimes: every uptime must be > 0")
    d = len(fails)
    if d < 2 or min(fails) == max(fails):
        raise ValueError(f"fit_uptimes: expected at least two different uptimes that ended "
                         f"in a failure, got {d}")
    times = fails + cens
    logs = [math.log(t) for t in times]
    logs_fail = sum(logs[:d])
    mean_log_fail = logs_fail / d
    total = sum(times)
    exp_mean = total / d
    exp_ll = -d * math.log(exp_mean) - total / exp_mean
    lo, hi = 1e-3, 1.0
    while _shape_equation(hi, times, logs, mean_log_fail) < 0 and hi < 1e3:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if _shape_equation(mid, times, logs, mean_log_fail) < 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    k = (lo + hi) / 2.0
    w_ll, scale = _weibull_ll(k, times, logs_fail, d)
    stat = max(0.0, 2.0 * (w_ll - exp_ll))
    return UptimeFit(uptimes=len(times), failures=d, exp_mean_h=exp_mean,
                     exp_log_likelihood=exp_ll, weibull_shape=k, weibull_scale_h=scale,
                     weibull_mean_h=scale * math.gamma(1.0 + 1.0 / k),
                     weibull_log_likelihood=w_ll, exp_aic=2.0 - 2.0 * exp_ll,
                     weibull_aic=4.0 - 2.0 * w_ll,
                     lr_p_value=1.0 - chi2_cdf(stat, 1.0))


def young_scale(mtbf: float, low: float, high: float) -> tuple[float, float]:
    """How an interval proportional to sqrt(MTBF) (Young's, Daly's first order) moves when
    the MTBF is ``low`` or ``high`` instead of ``mtbf``: the two factors."""
    return math.sqrt(low / mtbf), (math.inf if math.isinf(high) else math.sqrt(high / mtbf))


def node_uptimes(outages: Sequence[tuple[str, float, float | None]], window_end: float
                 ) -> tuple[list[float], list[float]]:
    """Per-node uptimes from outages ``(node, start, end or None)``, in one unit of time.

    An uptime runs from a node's repair (its ``end``; without one, the failure itself) to
    its next failure; a failure at or before that repair is the same outage. The time
    before a node's first failure is left out (when that uptime began is unknown); the
    time from its last repair to ``window_end`` is a censored uptime (still up).
    Returns (uptimes ended by a failure, censored uptimes).
    """
    by_node: dict[str, list[tuple[float, float]]] = {}
    for node, start, end in outages:
        by_node.setdefault(node, []).append((start, start if end is None else end))
    fails: list[float] = []
    cens: list[float] = []
    for spans in by_node.values():
        spans.sort()
        up_from = spans[0][1]
        for start, end in spans[1:]:
            if start > up_from:
                fails.append(start - up_from)
                up_from = end
            else:
                up_from = max(up_from, end)
        if window_end > up_from:
            cens.append(window_end - up_from)
    return fails, cens
