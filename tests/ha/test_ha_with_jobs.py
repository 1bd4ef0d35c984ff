"""Coordinator HA and a three-member etcd under a running job (issue: system resilience).

One ``heat_ring`` job under ``raps-run`` on the real cluster, three ``raps-coordinator``
processes, three etcd members:

- a node crash makes a plan; the leader is frozen (SIGSTOP) while the plan is in flight;
  a standby leads within the lease, finishes the plan exactly once, and the thawed old
  leader steps down;
- one etcd member stopped: checkpoints still commit;
- two stopped: ``rapsctl ping`` says the quorum is lost, the agents say they keep their
  ranks, the ranks go on computing (their checkpoints are not committed, said once per
  attempt), and none is killed; a member back: the job ends with the failure-free result,
  every rank started once but the crashed one, started twice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.config import load_file
from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import (
    CoordinatorProcess,
    LocalCluster,
    leader_name,
    wait_until,
)
from raps_slurm.testing.jobs import (
    HEAT_RING,
    committed,
    finish,
    heat_reference,
    job_plans,
    rank_entries,
)

# 1,000 steps of 0.05 s: the job still runs long after the three phases (over 24 s after
# the submission on a loaded 2-core machine, where 1,500 steps ran 125 s); a job that
# ended before them would fail the test, not pass it
STEPS = ["--steps", "1000", "--every", "20"]
NAMES = ("ha-a", "ha-b", "ha-c")


@pytest.fixture
def store(cluster3: LocalCluster) -> Iterator[tuple[StateStore, Keys]]:
    s, keys = open_store(load_file(cluster3.config_path).store)
    with s:
        yield s, keys


@pytest.fixture
def coordinators(cluster3: LocalCluster) -> Iterator[dict[str, CoordinatorProcess]]:
    started = {name: cluster3.coordinator(name) for name in NAMES}
    try:
        yield started
    finally:
        for c in started.values():
            c.stop()


def ping(cluster: LocalCluster) -> str:
    """``rapsctl ping``'s report (it exits 1 when something is down)."""
    return subprocess.run([sys.executable, "-m", "raps_slurm.cli", "--config",
                           str(cluster.config_path), "ping"], capture_output=True, text=True,
                          timeout=60, check=False, env={**os.environ, **cluster.env}).stdout


def agent_logs(cluster: LocalCluster) -> str:
    return "".join((cluster.run_dir / "log" / f"agent-{n}.log").read_text(errors="replace")
                   for n in cluster.node_names)


def test_leader_frozen_mid_plan_and_etcd_quorum_lost_kill_no_rank(
        cluster3: LocalCluster, store: tuple[StateStore, Keys],
        coordinators: dict[str, CoordinatorProcess], tmp_path: Path) -> None:
    s, keys = store
    lease = load_file(cluster3.config_path).coordinator.leader_lease_sec
    clean = heat_reference(tmp_path, 4, STEPS)
    coordinators["ha-a"].start()
    wait_until("ha-a to lead", lambda: leader_name(s, keys), lambda n: n == "ha-a", 20)
    coordinators["ha-b"].start()
    coordinators["ha-c"].start()
    job, out = cluster3.submit_raps_run(
        [sys.executable, str(HEAT_RING), *STEPS, "--step-sec", "0.05"],
        ["--raps-spares=2", "-N6"], "ha")
    try:
        ranks = wait_until("the rank map", lambda: rank_entries(s, keys, job),
                           lambda e: len(e) == 4, 60)
        host = wait_until("the batch host", lambda: cluster3.slurm().job(int(job)).batch_host,
                          bool, 20)
        victim = max(r for r, e in ranks.items() if e.node != host)
        node = ranks[victim].node
        wait_until(f"rank {victim} committed", lambda: committed(s, keys, job, victim), bool, 60)

        # 1. The leader frozen while a plan is in flight.
        cluster3.crash(node)
        wait_until("a plan", lambda: job_plans(s, keys, job), bool, 30, interval=0.02)
        coordinators["ha-a"].signal(signal.SIGSTOP)
        [frozen] = job_plans(s, keys, job)
        assert frozen.state in ("queued", "running"), frozen  # not finished when frozen
        new = wait_until("a standby to lead", lambda: leader_name(s, keys),
                         lambda n: n in ("ha-b", "ha-c"), lease + 5, interval=0.05)
        wait_until("the plan done", lambda: job_plans(s, keys, job),
                   lambda p: len(p) == 1 and p[0].state == "done", 60)
        coordinators["ha-a"].signal(signal.SIGCONT)
        wait_until("the thawed leader steps down", coordinators["ha-a"].log,
                   lambda t: "lost leadership" in t, 15)
        assert leader_name(s, keys) == new
        [plan] = job_plans(s, keys, job)
        assert (plan.plan_id, plan.rank, plan.epoch) == (frozen.plan_id, victim, 2)
        # it logs the step after committing it: the plan can be seen done first
        wait_until(f"{new} to log the plan", coordinators[new].log,
                   lambda t: f"plan {plan.plan_id}" in t, 10)
        assert {r: e.epoch for r, e in rank_entries(s, keys, job).items()} == {
            r: 2 if r == victim else 1 for r in ranks}

        # 2. One etcd member stopped (every client's first endpoint): checkpoints commit.
        others = [r for r in ranks if r != victim]
        newest = max(max(committed(s, keys, job, r), default=0) for r in others)
        cluster3.etcd_stop(1)
        wait_until("a checkpoint committed with two members",
                   lambda: max(max(committed(s, keys, job, r), default=0) for r in others),
                   lambda g: g > newest, 30)

        # 3. Two stopped: no quorum. Ranks go on, none is killed.
        cluster3.etcd_stop(2)
        wait_until("ping to report the lost quorum", lambda: ping(cluster3),
                   lambda t: "no quorum" in t, 30)
        wait_until("an agent to keep its ranks", lambda: agent_logs(cluster3),
                   lambda t: "etcd has no quorum" in t, 30)
        wait_until("ranks computing on past two uncommitted checkpoints",
                   lambda: out.read_text(errors="replace"),
                   lambda t: t.count("checkpoint not committed") >= 2, 60)
        cluster3.etcd_start(1)
        wait_until("a leader again", lambda: leader_name(s, keys), bool, 30)
        text = finish(cluster3, job, out, clean, timeout=240)
    finally:
        with contextlib.suppress(SlurmCommandError):
            CommandRunner(timeout=60, env=cluster3.env).run(["scancel", job])
        with contextlib.suppress(Exception):
            cluster3.etcd_start(2)
        with contextlib.suppress(Exception):
            cluster3.etcd_start(1)
    logs = agent_logs(cluster3)
    assert "fencing" not in logs and "fenced" not in logs, logs[-3000:]
    started = sorted(x for x in text.splitlines()
                     if x.startswith("raps-run: rank ") and " started on " in x)
    assert started == sorted(
        [f"raps-run: rank {r} epoch 1 started on {e.node}" for r, e in ranks.items()]
        + [f"raps-run: rank {victim} epoch 2 started on {plan.target}"]), text[-4000:]
    # the victim's first epoch died with its node; no other rank exited
    exits = [x for x in text.splitlines() if " exited with " in x]
    assert all(x.startswith(f"raps-run: rank {victim} epoch 1 on {ranks[victim].node} ")
               for x in exits), text[-4000:]
    [plan] = job_plans(s, keys, job)
    assert plan.state == "done"
