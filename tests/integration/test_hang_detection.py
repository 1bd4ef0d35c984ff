"""Progress-based hang detection on the real local cluster: a rank that spins in a Python
loop (alive, its runtime thread heartbeating, its step frozen) is found HUNG by its step
alone and restarted in place; a slow rank that keeps making progress never is; the
agents run above the ranks' CPU priority (a busy node must not starve them)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raps_slurm.config import load_file
from raps_slurm.core.detector import PROGRESS_STRIKES
from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm.runner import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import (
    FINAL,
    HEAT_RING,
    finish,
    heat_reference,
    job_plans,
    job_state,
    rank_pids,
)


def _progress_window(cluster: LocalCluster) -> float:
    d = load_file(cluster.config_path).detection
    return d.app_progress_timeout_sec or PROGRESS_STRIKES * d.app_heartbeat_interval_sec


def _run(cluster: LocalCluster, tmp: Path, args: list[str], name: str, *fault: str
         ) -> tuple[str, Path, str]:
    clean = heat_reference(tmp, 4, args)
    job, out = cluster.submit_raps_run([sys.executable, str(HEAT_RING), *args, *fault],
                                       ["--raps-spares=2", "-N6"], name)
    return job, out, clean


def test_a_spinning_rank_is_restarted_in_place_and_the_result_is_unchanged(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    args = ["--steps", "120", "--every", "20", "--step-sec", "0.05"]
    with leading("spin"):
        job, out, clean = _run(cluster, tmp_path, args, "spin", "--spin-at", "50")
        try:
            [pid] = wait_until("rank 3 running", lambda: rank_pids(job, 3, 1), bool, 60)
            got = wait_until("rank 3 restarted", lambda: job_plans(*store, job),
                             lambda ps: any(p.state == "done" for p in ps),
                             _progress_window(cluster) + 90)
            verdict = store[0].get(store[1].job_hung_verdict(job, 3))
            plans = job_plans(*store, job)
            text = finish(cluster, job, out, clean)
        finally:
            with contextlib.suppress(SlurmCommandError):
                CommandRunner(timeout=60, env=cluster.env).run(["scancel", job])
        assert [(p.rank, p.source == p.target, p.state) for p in plans] == [
            (3, True, "done")], (plans, text[-3000:])
        assert "hung" in plans[0].reason, plans[0].reason
        assert verdict is not None and b"no progress" in verdict.value, verdict
        assert "rank 3 epoch 2 resumed at step " in text, text[-3000:]
        wait_until("the spinning copy gone", lambda: rank_pids(job, 3, 1), lambda p: not p, 30)
        assert got and pid


def test_a_slow_rank_that_progresses_is_never_restarted(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    # each step takes half the progress window: slow, but every step is progress
    step = round(0.5 * _progress_window(cluster), 2)
    args = ["--steps", "5", "--every", "3", "--step-sec", str(step)]
    with leading("slow"):
        job, out, clean = _run(cluster, tmp_path, args, "slow")
        verdicts: dict[str, dict[str, Any]] = {}

        def ended() -> str:
            # read while the job runs: its keys are purged soon after it ends
            for kv in store[0].get_prefix(store[1].job_prefix(job) + "verdicts/"):
                verdicts[kv.key] = json.loads(kv.value)
            return job_state(cluster, job)

        try:
            wait_until(f"job {job} to end", ended, lambda st: st in FINAL, 120 + 6 * step)
            finish(cluster, job, out, clean)
        finally:
            with contextlib.suppress(SlurmCommandError):
                CommandRunner(timeout=60, env=cluster.env).run(["scancel", job])
        # No verdict at all: neither for want of progress nor for silence (a rank starved
        # on this loaded 2-core machine is reported by its agent, not taken for hung).
        assert verdicts == {}, verdicts


def test_the_agents_run_above_the_ranks(cluster: LocalCluster, store: tuple[StateStore, Keys],
                                        leading: Callable[[str], Any], tmp_path: Path) -> None:
    """As raps-agent.service does (Nice=-5): every agent's nice value is below its ranks'."""
    args = ["--steps", "40", "--every", "20", "--step-sec", "0.05"]
    with leading("nice"):
        job, out, clean = _run(cluster, tmp_path, args, "nice")
        try:
            [pid] = wait_until("rank 0 running", lambda: rank_pids(job, 0, 1), bool, 60)
            rank_nice = os.getpriority(os.PRIO_PROCESS, pid)
            finish(cluster, job, out, clean)
        finally:
            with contextlib.suppress(SlurmCommandError):
                CommandRunner(timeout=60, env=cluster.env).run(["scancel", job])
    agents = {n: int((cluster.run_dir / "pids" / f"agent-{n}.pid").read_text())
              for n in cluster.node_names}
    nice = {n: os.getpriority(os.PRIO_PROCESS, p) for n, p in agents.items()}
    assert all(v < rank_nice for v in nice.values()), (nice, rank_nice)
