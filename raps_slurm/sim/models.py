"""Closed-form checkpoint models the simulator is checked against.

Young (1974): the first-order optimum interval sqrt(2 delta M). Daly (2006, "A higher
order estimate of the optimum checkpoint interval for restart dumps", FGCS 22): with
exponential failures of mean M that may strike during computation, checkpoints and
restarts alike, the wall time to finish T_s of work in segments of tau, each followed by
a checkpoint of delta, with restart R after every failure, is

    T_w(tau) = M e^(R/M) (e^((tau + delta)/M) - 1) T_s / tau

exactly (a renewal argument: each segment must run tau + delta without failure, each
failure costs the time lost plus a restart that may itself fail), and its optimum is

    tau_opt = sqrt(2 delta M) [1 + sqrt(delta/(2M))/3 + delta/(18 M)] - delta, delta < 2M
            = M,                                                          otherwise.
"""

from __future__ import annotations

import math


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's interval sqrt(2 delta M)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum interval (compute time between checkpoints)."""
    d, m = checkpoint_s, mtbf_s
    if d >= 2.0 * m:
        return m
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def daly_fraction(interval_s: float, checkpoint_s: float, restart_s: float,
                  mtbf_s: float) -> float:
    """Useful-work fraction T_s / T_w of Daly's model at ``interval_s``."""
    m = mtbf_s
    # expm1 keeps precision when (tau + delta) << M.
    return interval_s / (m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_s) / m))
