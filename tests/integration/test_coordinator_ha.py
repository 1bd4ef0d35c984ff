"""Coordinator fail-over on the real cluster: kill the leader, freeze the leader.

The standby takes over once the leader key's lease has run out in etcd
(``coordinator.leader_lease_sec``; etcd checks lease expiry every 500 ms), and
a deposed leader can write nothing: every leader write is guarded by the
revision of the leader key it created.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from raps_slurm.config import load_file
from raps_slurm.coordinator.election import Leadership
from raps_slurm.errors import NotLeader, SlurmCommandError
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, Lease, Put, StateStore
from raps_slurm.testing.cluster import CoordinatorProcess, LocalCluster, wait_until
from raps_slurm.testing.cluster import leader_name as leader_in_etcd

if TYPE_CHECKING:  # the fixture's type; conftest is not importable at run time
    from conftest import Rapsctl

# etcd revokes expired leases in a loop that runs every 500 ms; a standby polls
# every cycle_interval_sec (0.2 s in the test profile).
ETCD_EXPIRY_SLACK = 1.0


def leader_name(rapsctl: Rapsctl) -> str | None:
    proc = rapsctl("ping", "--json", check=False)
    leader = json.loads(proc.stdout).get("leader") if proc.stdout else None
    return leader.get("name") if isinstance(leader, dict) else None


@pytest.fixture
def coordinators(cluster: LocalCluster) -> Iterator[dict[str, CoordinatorProcess]]:
    started: dict[str, CoordinatorProcess] = {}
    try:
        yield started
    finally:
        for c in started.values():
            c.stop()


@pytest.fixture
def submitted(cluster: LocalCluster) -> Iterator[list[int]]:
    jobs: list[int] = []
    try:
        yield jobs
    finally:
        if jobs:
            CommandRunner(timeout=60, env=cluster.env).run(["scancel", *map(str, jobs)])


def submit_raps_job(cluster: LocalCluster, jobs: list[int]) -> int:
    out = CommandRunner(timeout=60, env=cluster.env).run(
        ["sbatch", "--parsable", "-o", "/dev/null", "--raps", "--raps-spares=2", "-N6",
         "--wrap", "sleep 60"])
    job = int(out.strip().split(";")[0])
    jobs.append(job)
    return job


def mapped_by(rapsctl: Rapsctl, job: int, timeout: float,
              cluster: LocalCluster | None = None,
              leader: CoordinatorProcess | None = None) -> dict[str, Any]:
    """The job as ``rapsctl`` shows it once mapped; a timeout also says where Slurm has
    the job and what the leader logged last (not registered at all is Slurm's side, or
    the hooks'; registered and not mapped, the leader's)."""

    def explain() -> str:
        seen = ""
        if cluster is not None:
            try:
                seen += "squeue: " + CommandRunner(timeout=30, env=cluster.env).run(
                    ["squeue", "-h", "-j", str(job), "-o", "%T %r %N"]).strip()
            except SlurmCommandError as err:
                seen += f"squeue: {err}"
        if leader is not None:
            seen += "\nleader's log:\n" + leader.log()[-2000:]
        return seen

    data = wait_until(f"job {job} mapped", lambda: rapsctl.job(job),
                      lambda d: d is not None and d["state"] == "mapped", timeout=timeout,
                      explain=explain)
    assert data is not None
    return data


def test_standby_takes_over_and_a_thawed_leader_writes_nothing(
        cluster: LocalCluster, rapsctl: Rapsctl, coordinators: dict[str, CoordinatorProcess],
        submitted: list[int], store: tuple[StateStore, Keys]) -> None:
    lease = load_file(cluster.config_path).coordinator.leader_lease_sec
    wait_until("no leader left by earlier tests", lambda: leader_name(rapsctl),
               lambda n: n is None, timeout=lease + 5)
    for name in ("ha-a", "ha-b"):
        coordinators[name] = cluster.coordinator(name).start()
        wait_until(f"{name} running", lambda: leader_name(rapsctl), lambda n: n == "ha-a",
                   timeout=20)
    wait_until("ha-b on standby", lambda: coordinators["ha-b"].log(),
               lambda t: "standby: leader is ha-a" in t, timeout=10)

    coordinators["ha-a"].signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_until("ha-b to lead", lambda: leader_in_etcd(*store), lambda n: n == "ha-b",
               timeout=lease + 5, interval=0.05)
    took = time.monotonic() - killed
    print(f"takeover after SIGKILL: {took:.2f}s (leader_lease_sec {lease:g})")
    assert took <= lease + ETCD_EXPIRY_SLACK
    wait_until("the CLI to show ha-b", lambda: leader_name(rapsctl), lambda n: n == "ha-b",
               timeout=10)
    job = submit_raps_job(cluster, submitted)
    assert mapped_by(rapsctl, job, 10, cluster, coordinators["ha-b"])["built_by"] == "ha-b"

    # Freeze the leader: the standby takes over; thawed, the old leader steps down.
    coordinators["ha-c"] = cluster.coordinator("ha-c").start()
    wait_until("ha-c on standby", lambda: coordinators["ha-c"].log(),
               lambda t: "standby: leader is ha-b" in t, timeout=10)
    coordinators["ha-b"].signal(signal.SIGSTOP)
    wait_until("ha-c to lead", lambda: leader_name(rapsctl), lambda n: n == "ha-c",
               timeout=lease + 5)
    job2 = submit_raps_job(cluster, submitted)
    assert mapped_by(rapsctl, job2, 10, cluster, coordinators["ha-c"])["built_by"] == "ha-c"
    coordinators["ha-b"].signal(signal.SIGCONT)
    wait_until("ha-b to step down", lambda: coordinators["ha-b"].log(),
               lambda t: "lost leadership" in t, timeout=10)
    wait_until("ha-b on standby again", lambda: coordinators["ha-b"].log(),
               lambda t: "standby: leader is ha-c" in t, timeout=10)
    assert leader_name(rapsctl) == "ha-c"
    assert f"mapped job {job2}" not in coordinators["ha-b"].log()
    assert mapped_by(rapsctl, job2, timeout=1)["built_by"] == "ha-c"


def test_deposed_leader_write_is_refused_by_etcd(store: tuple[StateStore, Keys]) -> None:
    """The guard itself, on the real etcd: no local clock check stands in the way."""
    s, cluster_keys = store
    # under the installation's prefix: the cluster's etcd users may touch nothing else
    keys = Keys(f"{cluster_keys.prefix}ha-test/{time.monotonic_ns()}/")
    old = Leadership(s, keys.leader(), 2, {"name": "old"})
    new = Leadership(s, keys.leader(), 2, {"name": "new"})
    assert old.step() and not new.step()
    assert new.leader_name == "old"
    lease_id = s.get(keys.leader())
    assert lease_id is not None and lease_id.lease_id is not None
    # What a pause past the TTL looks like from etcd: the old leader's lease is gone.
    s.revoke_lease(Lease(lease_id.lease_id, 2))
    assert new.step() and new.leader_name == "new"
    target = keys.job(1)
    with pytest.raises(NotLeader, match="another coordinator leads"):
        old.commit([], [Put(target, b"stale")])
    assert s.get(target) is None
    assert new.commit([], [Put(target, b"fresh")])
    kv = s.get(target)
    assert kv is not None and kv.value == b"fresh"
    s.delete_prefix(keys.prefix)
