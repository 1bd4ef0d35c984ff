"""Starved or hung: what a rank's scheduler statistics say about it; pure, no I/O.

A rank on a node whose every core is busy falls behind: its heartbeat thread and its
application thread wait in the run queue. It wants the CPU and cannot get it: starved,
alive. A hung rank wants nothing: stopped (SIGSTOP, a frozen cgroup), asleep on a lock
that nobody releases, stuck in the kernel. The kernel tells them apart per thread in
``/proc/PID/task/TID/schedstat``: time on the CPU and time runnable but waiting for one
(the run delay). The agent reads them (:mod:`raps_slurm.agent.sched`); the decisions are
here:

- :func:`active_between`: silence. A rank that sent no app heartbeat is still vouched
  for by its agent while its process, between two readings, spent at least
  ``ACTIVE_SHARE`` of the time on or waiting for a CPU. A stopped, blocked or zombie
  process spends none.
- :func:`progress_due`: a frozen step. The detector's progress window counts the rank's
  own time, wall time minus the time its main thread waited for a CPU, so a rank given a
  third of a core gets up to ``MAX_STRETCH`` times the window; a rank blocked outside a
  peer wait gets exactly the window.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVE_SHARE = 0.02   # on or waiting for a CPU this share of the time: alive, not stopped
# A window stretched by at most this: a spinning rank on a saturated node is found within
# twice the idle time, and a rank starved for longer than that is taken for hung.
MAX_STRETCH = 2.0
STOPPED_STATES = frozenset("TtZXx")  # stopped, traced, zombie, dead: never alive
WAITED_MODULUS = 1 << 31  # the reported run delay (ms) wraps here: 24.8 days of waiting
NS = 1e9


@dataclass(frozen=True, slots=True)
class SchedSample:
    """One reading of a process's scheduler statistics.

    ``cpu_ns`` and ``wait_ns`` sum every thread; ``main_wait_ns`` is the run delay of the
    main thread (the application's, where the step advances); ``start_time`` names the
    process (a pid reused by another process has another one); ``state`` is the main
    thread's letter from ``/proc/PID/stat`` (R, S, D, T, Z...)."""

    at: float
    start_time: int
    cpu_ns: int
    wait_ns: int
    main_wait_ns: int
    state: str


def active_between(before: SchedSample | None, after: SchedSample | None) -> bool:
    """Whether the process ran or waited to run for at least ``ACTIVE_SHARE`` of the time
    between two readings of the same process: alive, maybe starved, not stopped or stuck."""
    if before is None or after is None or before.start_time != after.start_time:
        return False
    if after.state in STOPPED_STATES:
        return False
    elapsed = after.at - before.at
    if elapsed <= 0:
        return False
    used = (after.cpu_ns - before.cpu_ns) + (after.wait_ns - before.wait_ns)
    return used >= ACTIVE_SHARE * elapsed * NS


def waited_ms(sample: SchedSample) -> int:
    """The main thread's run delay as the wire carries it: ms modulo ``WAITED_MODULUS``."""
    return (sample.main_wait_ns // 1_000_000) % WAITED_MODULUS


def waited_delta(before_ms: int, after_ms: int, elapsed: float, slack: float) -> float:
    """Seconds waited between two reported counters (wrapping at ``WAITED_MODULUS``); 0 when
    the counter cannot belong to the same process (more waiting than ``elapsed`` + ``slack``
    seconds: the rank was restarted and its counter began again)."""
    delta = ((after_ms - before_ms) % WAITED_MODULUS) / 1000.0
    return 0.0 if delta > max(0.0, elapsed) + slack else delta


def progress_due(progress_at: float, waited: float, window: float) -> float:
    """When a rank whose step has not changed since ``progress_at``, and whose main thread
    has waited ``waited`` seconds for a CPU since then, has had ``window`` seconds of its
    own: ``progress_at + window + waited``, at most ``progress_at + MAX_STRETCH x window``."""
    return progress_at + min(window + max(0.0, waited), MAX_STRETCH * window)


def own_time(wall: float, waited: float) -> float:
    """The part of ``wall`` seconds a rank had for itself (the inverse of
    :func:`progress_due`): minus its wait for a CPU, at least ``wall / MAX_STRETCH``."""
    return max(wall - max(0.0, waited), wall / MAX_STRETCH)
