"""The local cluster with etcd authentication and the least-privilege users
(``RAPS_CLUSTER_ETCD_AUTH=1``: scripts/cluster.sh runs ``rapsctl etcd-roles --apply
--nodes``, docs/store.md, Roles): every agent runs as its own node's etcd user and cannot
write another node's keys, root on a node outside a job cannot steer it through reports,
and a ``--raps`` job whose node dies is recovered by a leader, hooks and agents that each
hold their own credential only, with the failure-free result.

Its own 4-node cluster, 60 ports above ``RAPS_CLUSTER_PORT``, beside the session cluster
of the other tests here."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.config import load_file
from raps_slurm.coordinator.snapshot import read_snapshot
from raps_slurm.core.jobs import JobRecord, RankEntry
from raps_slurm.errors import SlurmCommandError, StorePermissionDenied
from raps_slurm.slurm.runner import CommandRunner
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import (
    HEAT_RING,
    committed,
    finish,
    heat_reference,
    job_plans,
    rank_entries,
)

NODES = ("n1", "n2", "n3", "n4")
HEAT = ["--steps", "200", "--every", "20", "--step-sec", "0.05"]


@pytest.fixture(scope="module")
def authed() -> Iterator[LocalCluster]:
    run_dir = Path(tempfile.mkdtemp(prefix="raps-auth-"))
    run_dir.chmod(0o755)  # slurmctld runs as SlurmUser
    c = LocalCluster(run_dir, nodes=len(NODES), racks=2,
                     port_base=int(os.environ.get("RAPS_CLUSTER_PORT", "17000")) + 60)
    try:
        c.up(extra_env={"RAPS_CLUSTER_ETCD_AUTH": "1"})
        yield c
    finally:
        try:
            c.down()
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def admin(authed: LocalCluster) -> Iterator[tuple[StateStore, Keys]]:
    store, keys = open_store(load_file(authed.config_path).store)  # raps-admin's
    with store:
        yield store, keys


def test_each_agent_is_its_own_node_user(authed: LocalCluster,
                                         admin: tuple[StateStore, Keys]) -> None:
    store, keys = admin
    for n in NODES:
        wait_until(f"{n}'s agent registered", lambda n=n: store.get(keys.node(n)), bool, 30)
    agent_cfg = load_file(authed.run_dir / "etc" / "raps-agent.yaml")
    assert agent_cfg.store.user == "raps-agent-%n"
    n1, _ = open_store(agent_cfg.store, "n1")
    with n1:
        assert n1.get(keys.node("n2")) is not None  # it reads the others' registrations
        for key in (keys.node("n2"), keys.node_health("n2"), keys.node_verdict("n1"),
                    keys.node_health_verdict("n2")):
            with pytest.raises(StorePermissionDenied, match="user 'raps-agent-n1'"):
                n1.put(key, b"forged")
    log = (authed.run_dir / "log" / "etcd-roles.log").read_text()
    for n in NODES:
        assert f"user raps-agent-{n}: created" in log, log
    assert "user raps-agent:" not in log, log  # no user shared by every node


@contextlib.contextmanager
def _heat_job(authed: LocalCluster, store: StateStore, keys: Keys, name: str
              ) -> Iterator[tuple[str, Path, dict[int, RankEntry]]]:
    """A leader with its own credential and a mapped 2-rank heat_ring job on 3 of the 4
    nodes (one spare): the job id, its output file and its rank entries."""
    coordinator = authed.coordinator(
        "auth", config=authed.run_dir / "etc" / "raps-coordinator.yaml").start()
    job, out = authed.submit_raps_run([sys.executable, str(HEAT_RING), *HEAT],
                                      ["--raps-spares=1", "-N3"], name)
    try:
        yield job, out, wait_until(f"job {job} mapped", lambda: rank_entries(store, keys, job),
                                   lambda e: len(e) == 2, 60)
    finally:
        with contextlib.suppress(SlurmCommandError):
            CommandRunner(timeout=60, env=authed.env).run(["scancel", job])
        coordinator.stop()


def test_root_on_a_node_not_of_the_job_cannot_steer_it(
        authed: LocalCluster, admin: tuple[StateStore, Keys], tmp_path: Path) -> None:
    """Root on the node outside the job, with its agent's credential: what it writes under
    its own name (an ESCALATE with the rank's epoch, a ``done`` peer entry) the leader
    ignores; under a node of the job's name, as a plan phase or an admin's cancel, etcd
    refuses. The job ends with the failure-free result, not requeued."""
    store, keys = admin
    clean = heat_reference(tmp_path, 2, ["--steps", "200", "--every", "20"])
    with _heat_job(authed, store, keys, "auth-forge") as (job, out, ranks):
        record = JobRecord.from_json("job", store.get(keys.job(job)).value)  # type: ignore[union-attr]
        [outsider] = sorted(set(NODES) - set(record.nodes))
        inside = ranks[0].node
        pid = f"{job}-0-{ranks[0].epoch + 1}"
        forged = json.dumps({"kind": "ESCALATE", "job": job, "rank": 0, "node": inside,
                             "epoch": ranks[0].epoch, "at": time.time(), "requeue": True,
                             "lost": True, "evidence": {"reason": "forged"}}).encode()
        done = json.dumps({"host": "127.0.0.1", "port": 9, "epoch": ranks[0].epoch,
                           "done": True, "node": inside}).encode()
        agent_cfg = load_file(authed.run_dir / "etc" / "raps-agent.yaml")
        root, _ = open_store(agent_cfg.store, outsider)
        with root:
            root.put(keys.rank_escalation(outsider, job, 0), forged)
            root.put(keys.job_peer(outsider, job, 0), done)
            for key in (keys.rank_escalation(inside, job, 0), keys.job_peer(inside, job, 0),
                        keys.plan_event(inside, pid, "launch_failed"),
                        keys.plan_cancel(pid), keys.job_hung_verdict(job, 0)):
                with pytest.raises(StorePermissionDenied, match=f"raps-agent-{outsider}"):
                    root.put(key, forged)
        snap = read_snapshot(store, keys)
        assert snap.refused == sorted(
            f"{k}: from {outsider}, not a node of job {job}"
            for k in (keys.rank_escalation(outsider, job, 0), keys.job_peer(outsider, job, 0)))
        assert 0 not in snap.jobs[job].escalated and 0 not in snap.jobs[job].done
        finish(authed, job, out, clean)
        assert job_plans(store, keys, job) == []
        assert store.get(keys.job_escalation(job)) is None
        assert authed.slurm().job(int(job)).restart_count == 0


def test_a_node_lost_under_authentication_is_recovered(
        authed: LocalCluster, admin: tuple[StateStore, Keys], tmp_path: Path) -> None:
    store, keys = admin
    clean = heat_reference(tmp_path, 2, ["--steps", "200", "--every", "20"])
    with _heat_job(authed, store, keys, "auth") as (job, out, ranks):
        host = wait_until("the batch host", lambda: authed.slurm().job(int(job)).batch_host,
                          bool, 20)
        victim = next(r for r, e in sorted(ranks.items()) if e.node != host)
        wait_until(f"rank {victim} committed", lambda: committed(store, keys, job, victim),
                   bool, 60)
        authed.crash(ranks[victim].node)
        finish(authed, job, out, clean)
        [plan] = job_plans(store, keys, job)
        assert (plan.rank, plan.state) == (victim, "done"), plan
        assert plan.target not in {e.node for e in ranks.values()}
