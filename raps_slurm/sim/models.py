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

Also the messaging cost of RAPS against native MPI from an application's messages per
step and the speed ratios ``rapsctl bench mpi`` measures per message size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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
    """Useful-work fraction T_s / T_w of Daly's model at ``interval_s`` (0.0 when the job
    MTBF is so short against the interval, checkpoint and restart that it never gets
    through: the exponentials would overflow a float)."""
    m = mtbf_s
    x = (interval_s + checkpoint_s) / m
    # In logs: exp(R/M) and expm1(x) overflow for M of a few seconds. expm1 keeps
    # precision when (tau + delta) << M; for large x, log(expm1(x)) = x + log1p(-e^-x).
    log_expm1 = math.log(math.expm1(x)) if x < 50 else x + math.log1p(-math.exp(-x))
    log_wall = math.log(m) + restart_s / m + log_expm1 - math.log(interval_s)
    return 0.0 if log_wall > 700 else math.exp(-log_wall)


def speed_at(size: float, sizes: Sequence[float], speeds: Sequence[float]) -> float:
    """A measured speed ratio at message ``size``: linear in log size between the
    measured sizes, the nearest one's beyond them."""
    if size <= sizes[0]:
        return speeds[0]
    for i in range(1, len(sizes)):
        if size <= sizes[i]:
            w = math.log(size / sizes[i - 1]) / math.log(sizes[i] / sizes[i - 1])
            return speeds[i - 1] + w * (speeds[i] - speeds[i - 1])
    return speeds[-1]


def messaging_overhead(step_s: float, msg_bytes: Sequence[float],
                       per_step: Sequence[float], latency_s: float, gbps: float,
                       sizes: Sequence[float], speeds: Sequence[float]) -> float:
    """Share of a step's time lost to RAPS's messaging against native MPI: a step computes
    ``step_s`` and sends ``per_step[i]`` messages of ``msg_bytes[i]``, each taking
    ``latency_s + bytes / gbps`` under native MPI and that over the speed ratio at its
    size (:func:`speed_at`) under RAPS: 1 - T_mpi / T_raps."""
    native = raps = step_s
    for b, k in zip(msg_bytes, per_step, strict=True):
        t = k * (latency_s + b / (gbps * 1e9))
        native += t
        raps += t / speed_at(b, sizes, speeds)
    return 0.0 if raps <= 0 else max(0.0, 1.0 - native / raps)
