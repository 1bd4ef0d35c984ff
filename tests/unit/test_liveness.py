"""Starved is not hung: the pure decisions (raps_slurm.core.liveness), the detector's
progress window in a rank's own time, the agent's reader of /proc on real processes and
its relay's choice of which silent ranks to vouch for (raps_slurm.agent.sched)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.agent.local_api import RankInfo
from raps_slurm.agent.sched import RankLiveness, read_sched
from raps_slurm.core.detector import Detector, DetectorSettings, Verdict
from raps_slurm.core.liveness import (
    MAX_STRETCH,
    WAITED_MODULUS,
    SchedSample,
    active_between,
    own_time,
    progress_due,
    waited_delta,
    waited_ms,
)
from raps_slurm.testing.cluster import wait_until

S = 1_000_000_000  # ns


def sample(at: float, cpu: float, wait: float, *, main_wait: float | None = None,
           state: str = "R", start: int = 7) -> SchedSample:
    return SchedSample(at, start, int(cpu * S), int(wait * S),
                       int((wait if main_wait is None else main_wait) * S), state)


# --- pure decisions --------------------------------------------------------------------------


def test_cpu_or_run_delay_growing_is_alive() -> None:
    before = sample(10.0, 1.0, 1.0)
    assert active_between(before, sample(11.0, 1.5, 1.0))   # ran half the second
    assert active_between(before, sample(11.0, 1.0, 1.9))   # starved: waited 0.9 s for a CPU
    assert active_between(before, sample(11.0, 1.01, 1.01))  # 2 % of the second together


def test_no_cpu_and_no_run_delay_is_not_alive() -> None:
    before = sample(10.0, 1.0, 1.0)
    assert not active_between(before, sample(11.0, 1.0, 1.0))     # blocked, stopped, frozen
    assert not active_between(before, sample(11.0, 1.0001, 1.0))  # a heartbeat timer's wakeup
    assert not active_between(before, sample(11.0, 2.0, 1.0, state="T"))  # stopped by a signal
    assert not active_between(before, sample(11.0, 2.0, 1.0, state="Z"))  # exited
    assert not active_between(before, sample(11.0, 2.0, 1.0, start=8))  # another process
    assert not active_between(None, sample(11.0, 2.0, 1.0))
    assert not active_between(before, None)                       # gone
    assert not active_between(before, sample(10.0, 2.0, 1.0))     # no time between


def test_the_window_stretches_by_the_run_delay_up_to_max_stretch() -> None:
    assert progress_due(100.0, 0.0, 10.0) == 110.0               # never waited: as before
    assert progress_due(100.0, 4.0, 10.0) == 114.0
    assert progress_due(100.0, 50.0, 10.0) == 100.0 + MAX_STRETCH * 10.0
    assert progress_due(100.0, -3.0, 10.0) == 110.0
    # own_time is its inverse: at the due time the rank has had exactly the window
    for waited in (0.0, 4.0, 9.9):
        due = progress_due(0.0, waited, 10.0)
        assert own_time(due, waited) == pytest.approx(10.0)
    assert own_time(30.0, 29.0) == 30.0 / MAX_STRETCH


def test_run_delay_counter_wraps_and_a_restart_credits_nothing() -> None:
    assert waited_ms(sample(0.0, 0.0, 0.0, main_wait=2.5)) == 2500
    assert waited_delta(1000, 1600, elapsed=1.0, slack=3.0) == pytest.approx(0.6)
    assert waited_delta(WAITED_MODULUS - 100, 400, elapsed=1.0, slack=3.0) == pytest.approx(0.5)
    # the counter went back (a new process): its delta wraps to 24 days, not credited
    assert waited_delta(90_000, 5, elapsed=1.0, slack=3.0) == 0.0
    assert waited_delta(0, 10_000, elapsed=1.0, slack=3.0) == 0.0


# --- the detector: a frozen step judged in the rank's own time --------------------------------

CFG = DetectorSettings(interval=0.5, miss_threshold=3, fence_margin=0.2, app_interval=1.0,
                       app_miss_threshold=3, app_progress_timeout=10.0)


def run(until: float, step_at: float | None, wait_share: float | None,
        silent_from: float | None = None) -> list[Verdict]:
    """Drive one rank of job 1 on n1 for ``until`` s: one app heartbeat a second (none from
    ``silent_from`` on), its step advancing every ``step_at`` s (never if None), its main
    thread waiting for a CPU ``wait_share`` of the time (None: not reported)."""
    det = Detector(CFG, 0.0)
    det.watch("n1", 0.0)
    out: list[Verdict] = []
    t = 0.0
    while t <= until + 1e-9:
        det.heartbeat("n1", t, t, acked=True)
        if abs(t - round(t)) < 1e-9 and (silent_from is None or t < silent_from):
            step = 1 + (int(t // step_at) if step_at else 0)
            waited = None if wait_share is None else int(t * wait_share * 1000)
            det.app_heartbeat("1", 0, "n1", step, None, t, waited_ms=waited)
        out += det.tick(t)
        t = round(t + 0.25, 2)
    return out


def test_a_starved_rank_that_progresses_slowly_is_never_hung() -> None:
    # two thirds of the time in the run queue: each step, 6 s of work at idle, takes 18 s
    assert run(100.0, step_at=18.0, wait_share=2 / 3) == []


def test_negative_control_the_same_rank_without_run_delays_is_hung() -> None:
    # what the detector did before it knew run delays: a false HUNG for want of progress
    [v] = run(17.0, step_at=18.0, wait_share=None)
    assert v.evidence["reason"] == "no progress" and v.at == pytest.approx(CFG.progress_window, abs=0.3)


def test_negative_control_a_rank_frozen_with_no_run_delay_is_hung_in_the_window() -> None:
    # heartbeating (its runtime thread), step frozen, never waiting for a CPU: stuck
    [v] = run(60.0, step_at=None, wait_share=0.0)
    assert v.kind == "HUNG" and v.evidence["reason"] == "no progress"
    assert v.at == pytest.approx(CFG.progress_window, abs=0.3)
    assert v.evidence["waited_s"] == 0.0


def test_a_frozen_step_under_load_is_hung_by_max_stretch_times_the_window() -> None:
    # a spinning rank given a third of a core: found, within twice the idle time
    [v] = run(60.0, step_at=None, wait_share=2 / 3)
    assert v.evidence["reason"] == "no progress"
    assert CFG.progress_window < v.at <= MAX_STRETCH * CFG.progress_window + 0.3


def test_negative_control_a_silent_rank_is_hung_by_its_silence() -> None:
    # no report at all (the agent did not vouch: no CPU, no run delay): HUNG in the window
    [v] = run(20.0, step_at=1.0, wait_share=0.5, silent_from=5.0)
    assert v.kind == "HUNG" and "silence_s" in v.evidence
    assert v.at == pytest.approx(4.0 + CFG.app_window, abs=0.3)


# --- the agent's reader on real processes -----------------------------------------------------


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(code: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-c", code])
        procs.append(p)
        return p

    yield start  # type: ignore[misc]
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait(10)


def _running(pid: int) -> SchedSample:
    return wait_until(f"pid {pid} readable", lambda: read_sched(pid), lambda s: s is not None
                      and s.cpu_ns > 20_000_000, 30)  # type: ignore[return-value]


def _over(pid: int, seconds: float) -> tuple[SchedSample, SchedSample]:
    before = read_sched(pid)
    time.sleep(seconds)  # the measured interval itself, not a wait for an outcome
    after = read_sched(pid)
    assert before is not None and after is not None
    return before, after


BUSY = "while True: pass"


def test_a_busy_child_is_alive_a_sleeping_or_stopped_one_is_not(child) -> None:  # type: ignore[no-untyped-def]
    busy, asleep, stopped = child(BUSY), child("import time; time.sleep(600)"), child(BUSY)
    _running(busy.pid)
    _running(stopped.pid)
    os.kill(stopped.pid, signal.SIGSTOP)
    wait_until("the child stopped", lambda: read_sched(stopped.pid),
               lambda s: s is not None and s.state == "T", 10)
    wait_until("the sleeper asleep", lambda: read_sched(asleep.pid),
               lambda s: s is not None and s.state == "S", 10)
    b = _over(busy.pid, 0.5)
    assert b[1].cpu_ns > b[0].cpu_ns and active_between(*b), b
    s = _over(asleep.pid, 0.5)
    assert not active_between(*s), s
    t = _over(stopped.pid, 0.5)
    assert t[1].cpu_ns == t[0].cpu_ns and not active_between(*t), t
    assert read_sched(999_999_999) is None


def test_two_busy_children_on_one_cpu_wait_for_it(child) -> None:  # type: ignore[no-untyped-def]
    """Run delay is read, not assumed: two busy loops sharing one CPU each wait for it."""
    cpu = min(os.sched_getaffinity(0))
    pair = [child(f"import os; os.sched_setaffinity(0, {{{cpu}}})\n{BUSY}") for _ in range(2)]
    for p in pair:
        _running(p.pid)
    for p in pair:
        before, after = _over(p.pid, 1.0)
        waited = (after.main_wait_ns - before.main_wait_ns) / S
        assert waited > 0.2, (before, after)  # about half the second, less under other load
        assert active_between(before, after)


# --- the relay: which silent ranks the agent vouches for --------------------------------------


def _proc(root: Path, pid: int, state: str, cpu: int, wait: int, start: int = 55) -> None:
    task = root / str(pid) / "task" / str(pid)
    task.mkdir(parents=True, exist_ok=True)
    fields = " ".join([state] + ["0"] * 18 + [str(start)] + ["0"] * 30)
    (root / str(pid) / "stat").write_text(f"{pid} (python3 x) {fields}\n")
    for path in (root / str(pid) / "schedstat", task / "schedstat"):
        path.write_text(f"{cpu} {wait} 9\n")


def _rank(rank: int, pid: int, heard: float, job: str = "12") -> RankInfo:
    return RankInfo(job, rank, 1, pid, 1000, registered_at=0.0, last_heartbeat_at=heard,
                    step=40 + rank, blocked_on=None)


def test_the_relay_vouches_for_silent_ranks_that_run_or_wait_only(tmp_path: Path) -> None:
    live = RankLiveness(tmp_path)
    _proc(tmp_path, 101, "R", 0, 0)        # starved: will wait for a CPU
    _proc(tmp_path, 102, "S", 0, 0)        # blocked: nothing moves
    _proc(tmp_path, 103, "R", 0, 0)        # will be stopped
    _proc(tmp_path, 104, "S", 0, 0)        # heartbeats: reported whatever it does
    ranks = [_rank(1, 101, 0.0), _rank(2, 102, 0.0), _rank(3, 103, 0.0), _rank(4, 104, 5.0),
             _rank(5, 105, 5.0, job="x")]
    first = live.entries(ranks, since=1.0)
    assert [e.rank for e in first] == [4]  # no earlier reading: nobody vouched for yet
    time.sleep(0.05)  # readings are timed by the monotonic clock: let it advance
    _proc(tmp_path, 101, "R", 10**6, 900 * 10**6)
    _proc(tmp_path, 103, "T", 10**6, 900 * 10**6)
    second = live.entries(ranks, since=10.0)
    assert [(e.rank, e.step, e.waited_ms) for e in second] == [(1, 41, 900)]
    # a reused pid (another start time) is another process: not vouched for
    time.sleep(0.05)
    _proc(tmp_path, 101, "R", 10**9, 10**9, start=99)
    assert live.entries(ranks, since=10.0) == []
