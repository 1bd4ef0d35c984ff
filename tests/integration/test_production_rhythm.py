"""Jobs at the production rhythm: checkpoints further apart than every idle limit and
every wait limit of the configuration they run with. Every other test checkpoints every
few seconds; at the shipped 600 s a quiet minute used to break the ranks' agent
connections (Broken pipe at the first checkpoint, no failure needed), and a rank
re-executing more than recv_timeout_sec of lost work made its neighbours give up.

Both jobs run at once (the cluster's six nodes: two for one, four for the other):
- no failure: the first checkpoint comes after the agent closed the quiet connections;
- a node crashed just before the first checkpoint: its ranks re-execute everything they
  did, for longer than recv_timeout_sec and recovery_timeout_sec.
Both must complete with the failure-free result and no requeue."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.config import load_file
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm.runner import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import (
    FINAL,
    HEAT_RING,
    crashed,
    ended_seeing,
    finish,
    heat_reference,
    job_state,
    rank_entries,
)

INTERVAL = 100  # --raps-ckpt-interval: above every limit below (checked by the test)
CRASH_AT = 90   # seconds after the ranks run: just before the first checkpoint
# 2,400 steps of 0.05 s: the first checkpoint (at INTERVAL) comes well before the end
HEAT = ["--steps", "2400", "--every", "1000000", "--step-sec", "0.05"]
# The crashed job: 2,000 steps, still past CRASH_AT (and INTERVAL) when nothing fails;
# after the crash its work ends 10 s after the victims caught up, not 30
HIT_HEAT = ["--steps", "2000", *HEAT[2:]]


def limits(cluster: LocalCluster) -> dict[str, float]:
    """The idle and wait limits of the cluster's configuration (agent/main.py sets the
    local API's idle limit to max(60, 3 app heartbeats))."""
    cfg = load_file(cluster.config_path)
    d = cfg.detection
    return {"agent idle": max(60.0, 3 * d.app_heartbeat_interval_sec),
            "messagelog.recv_timeout_sec": cfg.messagelog.recv_timeout_sec,
            "recovery.recovery_timeout_sec": cfg.recovery.recovery_timeout_sec,
            "hang window": d.app_progress_timeout_sec or 5 * d.app_heartbeat_interval_sec}


def generations(s: StateStore, k: Keys, job: str) -> dict[int, list[tuple[int, str]]]:
    """Per rank of ``job``, the generations recorded (committed or under-replicated: a
    mirror may be the crashed node)."""
    out: dict[int, list[tuple[int, str]]] = {}
    for kv in s.get_prefix(k.job_ckpts_prefix(job)):
        rec = CkptRecord.from_json(kv.key, kv.value)
        out.setdefault(rec.rank, []).append((rec.generation, rec.state))
    return out


def reporting(s: StateStore, k: Keys, job: str) -> set[int]:
    """The ranks of ``job`` that have reported their message figures: running."""
    ranks = set()
    for kv in s.get_prefix(k.rank_reports_root()):
        parts = k.split(kv.key)[2:]  # <node>/<job>/msgstats/<rank>
        if parts[1:3] == (job, "msgstats"):
            ranks.add(int(kv.key.rsplit("/", 1)[1]))
    return ranks


@pytest.mark.timeout(1200)
def test_jobs_checkpointing_minutes_apart_complete_with_and_without_a_crash(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Any,
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    limit = limits(cluster)
    assert all(v < INTERVAL for v in limit.values()), limit
    # The crashed node's ranks re-execute CRASH_AT s of work: longer than a receive may
    # wait with no progress, and than a plan may take to run again.
    assert limit["messagelog.recv_timeout_sec"] < CRASH_AT, limit
    assert limit["recovery.recovery_timeout_sec"] < CRASH_AT, limit
    quiet_ref = heat_reference(tmp_path / "quiet", 4, HEAT[:4])
    crash_ref = heat_reference(tmp_path / "crash", 6, HIT_HEAT)
    s, k = store
    run = CommandRunner(timeout=60, env=cluster.env)
    program = [sys.executable, str(HEAT_RING), *HEAT]
    jobs: list[str] = []
    outs: list[Path] = []
    try:
        with leading("rhythm"):
            quiet, quiet_out = cluster.submit_raps_run(
                program, [f"--raps-ckpt-interval={INTERVAL}", "--raps-ranks-per-node=2",
                          "-N2"], "quiet")
            jobs.append(quiet)
            outs.append(quiet_out)
            hit, hit_out = cluster.submit_raps_run(
                [sys.executable, str(HEAT_RING), *HIT_HEAT],
                [f"--raps-ckpt-interval={INTERVAL}", "--raps-ranks-per-node=2",
                          "--raps-spares=1", "-N4"], "crash")
            jobs.append(hit)
            outs.append(hit_out)
            wait_until(f"job {hit}'s 6 ranks running (their message figures reported)",
                       lambda: reporting(s, k, hit), lambda r: len(r) == 6, 120)
            running_at = time.monotonic()
            ranks = rank_entries(s, k, hit)
            host = wait_until("the batch host",
                              lambda: cluster.slurm().job(int(hit)).batch_host, bool, 20)
            node = max(e.node for e in ranks.values() if e.node != host)
            victims = sorted(r for r, e in ranks.items() if e.node == node)
            # The crash point is a time, not a condition: the test's own schedule.
            time.sleep(max(0.0, running_at + CRASH_AT - time.monotonic()))
            assert not set(generations(s, k, hit)) & set(victims), \
                "a checkpoint came before the crash: the job is not at the tested rhythm"
            assert job_state(cluster, quiet) == "RUNNING"
            with crashed(cluster, store, node):
                # its first checkpoint, after a quiet minute and more (read while the job
                # runs: a finished job's keys are purged within seconds)
                wait_until(f"every rank of job {quiet} saved a checkpoint",
                           lambda: generations(s, k, quiet), lambda g: len(g) == 4,
                           INTERVAL + 120)
                seen, escalated = ended_seeing(cluster, s, k, [quiet, hit], 900)
                text = finish(cluster, quiet, quiet_out, quiet_ref)
                assert cluster.slurm().job(int(quiet)).restart_count == 0, \
                    f"{escalated}\n{text[-3000:]}"
                assert seen[quiet] == {}, seen
                text = finish(cluster, hit, hit_out, crash_ref)
                plans = list(seen[hit].values())
                assert cluster.slurm().job(int(hit)).restart_count == 0, \
                    f"{escalated}\n{text[-3000:]}"
                assert sorted(p.rank for p in plans) == victims, plans
                assert {(p.source, p.state) for p in plans} == {(node, "done")}, plans
    finally:
        for out in outs:  # shown by pytest when the test failed
            print(f"--- {out}:", out.read_text()[-3000:] if out.exists() else "(none)")
        for job in jobs:
            with contextlib.suppress(SlurmCommandError):
                if job_state(cluster, job) not in FINAL:
                    run.run(["scancel", job])
