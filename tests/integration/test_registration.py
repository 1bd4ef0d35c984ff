"""Job registration on the real local cluster: hooks, coordinator rank maps, rapsctl show job.

One coordinator runs for the module. Every job a test submits is cancelled at its end,
so the next test finds the six nodes idle.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from raps_slurm.config import load_file
from raps_slurm.errors import SlurmCommandError
from raps_slurm.model import Topology
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import CoordinatorProcess, LocalCluster, wait_until

if TYPE_CHECKING:  # the fixture's type; conftest is not importable at run time
    from conftest import Rapsctl

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
SLURM_COMMANDS = ("scontrol", "squeue", "sinfo", "sbatch", "srun", "salloc", "scancel", "sacct",
                  "sacctmgr", "sprio", "sstat", "sshare", "sreport", "strigger", "sattach")


@pytest.fixture(scope="module")
def leader(leading: Callable[[str], Any]) -> Iterator[CoordinatorProcess]:
    """One coordinator, leading before the first test of the module."""
    with leading("reg") as c:
        yield c


class Jobs:
    """sbatch/scontrol for a test; cancels what it submitted when the test ends."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.run = CommandRunner(timeout=60, env=cluster.env)
        self.submitted: list[int] = []

    def submit(self, *args: str) -> int:
        out = self.run.run(["sbatch", "--parsable", "-o", "/dev/null", *args])
        job = int(out.strip().split(";")[0])
        self.submitted.append(job)
        return job

    def state(self, job: int) -> str:
        return self.cluster.slurm().job(job).state

    def wait_finished(self, job: int, timeout: float = 60) -> str:
        return wait_until(f"job {job} to finish", lambda: self.state(job),
                          lambda s: s in FINISHED, timeout=timeout)

    def cancel_all(self) -> None:
        if self.submitted:
            self.run.run(["scancel", *map(str, self.submitted)])
            for job in self.submitted:
                wait_until(f"job {job} to end", lambda j=job: self.state(j),  # type: ignore[misc]
                           lambda s: s in FINISHED, timeout=60)


@pytest.fixture
def jobs(cluster: LocalCluster, leader: CoordinatorProcess) -> Iterator[Jobs]:
    j = Jobs(cluster)
    try:
        yield j
    finally:
        j.cancel_all()


def mapped(rapsctl: Rapsctl, job: int, timeout: float, restart_count: int = 0) -> dict[str, Any]:
    data = wait_until(
        f"job {job} run {restart_count} to be mapped", lambda: rapsctl.job(job),
        lambda d: d is not None and d["state"] == "mapped" and d["restart_count"] == restart_count,
        timeout=timeout, interval=0.1)
    assert data is not None
    return data


def job_dir(cluster: LocalCluster, node: str, job: int) -> Path:
    return cluster.run_dir / "ckpt" / node / f"job-{job}"


def test_raps_job_is_mapped_within_5s_with_rack_disjoint_groups(
        cluster: LocalCluster, jobs: Jobs, rapsctl: Rapsctl) -> None:
    topo: Topology = cluster.slurm().topology()
    started, submitted = time.monotonic(), time.time()
    job = jobs.submit("--raps", "--raps-spares=2", "-N6", "--wrap", "sleep 120")
    data = mapped(rapsctl, job, timeout=5)
    print(f"job {job}: registered {data['registered_at'] - submitted:.2f}s, mapped "
          f"{data['mapped_at'] - submitted:.2f}s, seen by rapsctl "
          f"{time.monotonic() - started:.2f}s after sbatch")

    assert data["job_id"] == str(job) and data["restart_count"] == 0
    assert data["owner_uid"] == os.getuid()
    assert len(data["ranks"]) == 4 and len(data["spares"]) == 2
    rank_nodes = {r["node"] for r in data["ranks"]}
    assert rank_nodes.isdisjoint(data["spares"])
    assert rank_nodes | set(data["spares"]) == set(cluster.node_names)
    assert len({topo.rack_of(s) for s in data["spares"]}) == 2, data["spares"]
    replicas = load_file(cluster.config_path).checkpoint.replica_count
    for r in data["ranks"]:
        g = r["group"]
        assert g["primary"] == r["node"] and r["epoch"] == 1 and g["degraded"] is None
        assert len(g["ckpt_mirrors"]) == replicas - 1
        members = [g["primary"], g["log_backup"], *g["ckpt_mirrors"]]
        assert len({topo.rack_of(m) for m in members}) == len(members) == 3, r
        assert sorted(r["spares"]) == sorted(data["spares"])
    # The node Prolog (run at allocation, beside PrologSlurmctld) makes each node's
    # checkpoint dir, root-only.
    for node in cluster.node_names:
        d = job_dir(cluster, node, job)
        wait_until(f"{d} to exist", d.is_dir, timeout=10)
        assert stat.S_IMODE(d.stat().st_mode) == 0o700

    groups = rapsctl("show", "groups", str(job)).stdout.splitlines()
    assert groups[0].split() == ["rank", "primary", "log_backup", "ckpt_mirrors", "spares",
                                 "degraded"]
    assert len(groups) == 5
    block = rapsctl("show", "job", str(job)).stdout
    assert block.startswith(f"JobId={job} RestartCount=0 ") and "State=mapped" in block
    one = rapsctl("show", "job", str(job), "-o").stdout.strip().splitlines()
    assert len(one) == 1 and one[0].count("Rank=") == 4


def test_unknown_job_is_one_line_and_exit_1(rapsctl: Rapsctl, leader: CoordinatorProcess) -> None:
    proc = rapsctl("show", "job", "999999", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("rapsctl: job 999999 is not registered with raps-slurm "
                                   "(not submitted with --raps, or finished and purged)")


def test_job_without_raps_leaves_no_key(cluster: LocalCluster, jobs: Jobs,
                                        store: tuple[StateStore, Keys]) -> None:
    s, keys = store
    job = jobs.submit("-N2", "--wrap", "true")
    assert jobs.wait_finished(job) == "COMPLETED"
    assert s.get(keys.job(job)) is None and s.get_prefix(keys.job_prefix(job)) == []
    assert not any(job_dir(cluster, n, job).exists() for n in cluster.node_names)
    logs = "".join(p.read_text() for p in (cluster.run_dir / "log" / "raps").glob("*.log"))
    assert f"job={job}:" not in logs


def test_hooks_call_no_slurm_command(cluster: LocalCluster, tmp_path: Path,
                                     store: tuple[StateStore, Keys]) -> None:
    """Every Slurm client on PATH is a trap that records its call; the hooks hit none."""
    s, keys = store
    guard = tmp_path / "guard"
    guard.mkdir()
    calls = tmp_path / "calls.log"
    for name in SLURM_COMMANDS:
        trap = guard / name
        trap.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {calls}\nexit 1\n")
        trap.chmod(0o755)
    job = 900000 + int(uuid.uuid4().int % 90000)
    env = {"PATH": f"{guard}:/usr/bin:/bin", "SPANK_RAPS_ENABLED": "1",
           "SPANK_RAPS_SPARES": "1", "SLURM_JOB_ID": str(job), "SLURM_JOB_UID": "4242",
           "SLURM_JOB_USER": "guarded", "SLURM_JOB_NODELIST": "n[1-3]",
           "SLURM_JOB_RESTART_COUNT": "0", "SLURMD_NODENAME": "n1",
           "SLURM_JOB_EXIT_CODE2": "0:0"}
    try:
        for hook in ("prolog-slurmctld", "prolog", "epilog", "epilog-slurmctld"):
            proc = subprocess.run([sys.executable, "-m", "raps_slurm.hooks", hook, "--config",
                                   str(cluster.config_path)], env=env, capture_output=True,
                                  text=True, timeout=30, check=False)
            assert proc.returncode == 0, (hook, proc.stderr)
            if hook == "prolog-slurmctld":
                kv = s.get(keys.job(job))
                assert kv is not None and b'"owner_uid":4242' in kv.value
        kv = s.get(keys.job(job))
        assert kv is not None and b'"state":"ended"' in kv.value
        assert job_dir(cluster, "n1", job).is_dir()
        assert not calls.exists(), calls.read_text()
    finally:
        s.delete_prefix(keys.job_prefix(job))
        s.delete(keys.job(job))


def test_requeue_keeps_checkpoint_dirs_and_reregisters(
        cluster: LocalCluster, jobs: Jobs, rapsctl: Rapsctl) -> None:
    job = jobs.submit("--raps", "--raps-spares=1", "-N3", "--wrap", "sleep 300")
    first = mapped(rapsctl, job, timeout=10)
    node = first["ranks"][0]["node"]
    marker = job_dir(cluster, node, job) / "generation-1"
    wait_until(f"{marker.parent} to exist", marker.parent.is_dir, timeout=10)
    marker.write_text("checkpoint data")
    jobs.run.run(["scontrol", "requeue", str(job)])
    wait_until(f"job {job} pending again", lambda: jobs.state(job), lambda s: s == "PENDING",
               timeout=30)
    # Slurm delays a requeued job (BeginTime); start it now. It may set that delay only
    # once the first run's epilog is over, after the job shows PENDING (seen under load:
    # not started within 60 s), so the start is asked again while it waits.
    second = None
    deadline = time.monotonic() + 120
    while second is None:
        if jobs.state(job) == "PENDING":
            with contextlib.suppress(SlurmCommandError):  # it may have just started
                jobs.run.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
        try:
            second = mapped(rapsctl, job, timeout=5, restart_count=1)
        except AssertionError:
            if time.monotonic() > deadline:
                show = jobs.run.run(["scontrol", "show", "job", str(job)])
                raise AssertionError(f"run 1 of job {job} not mapped in 120 s:\n{show}") \
                    from None

    assert marker.read_text() == "checkpoint data"
    assert [r["epoch"] for r in second["ranks"]] == [2] * len(second["ranks"])
    # The hooks log after their etcd write (the leader may map the run first), and
    # run 0's EpilogSlurmctld is not ordered with run 1's registration: wait for each line.
    hook_logs = cluster.run_dir / "log" / "raps"
    for hook, line in (("prolog-slurmctld", f"job={job}: registered run 1 (requeue)"),
                       ("epilog-slurmctld", f"job={job}: run 0 ended")):
        log_file = hook_logs / f"{hook}.log"
        wait_until(f"{hook} to log {line!r}",
                   lambda f=log_file: f.read_text() if f.exists() else "",
                   lambda t, want=line: want in t, timeout=30)


def test_finished_job_keys_and_data_go_after_the_grace_period(
        cluster: LocalCluster, jobs: Jobs, rapsctl: Rapsctl) -> None:
    grace = load_file(cluster.config_path).coordinator.purge_grace_sec
    job = jobs.submit("--raps", "-N2", "--wrap", "sleep 1")
    mapped(rapsctl, job, timeout=10)
    assert jobs.wait_finished(job) == "COMPLETED"
    ended_seen = time.monotonic()
    data = rapsctl.job(job)
    assert data is not None and data["state"] == "ended" and data["exit_code"] == 0
    dirs = [job_dir(cluster, n, job) for n in data["nodes"]]
    assert all(d.is_dir() for d in dirs)
    wait_until(f"job {job} purged", lambda: rapsctl.job(job), lambda d: d is None,
               timeout=grace + 15)
    assert time.monotonic() - ended_seen >= grace - 1.5  # not before the grace period
    # The agents delete the job's node-local data once they see its tombstone.
    wait_until(f"job {job}'s checkpoint dirs deleted", lambda: [d for d in dirs if d.exists()],
               lambda left: not left, timeout=15)


def test_fail_open_and_fail_closed_when_etcd_is_down(
        cluster: LocalCluster, jobs: Jobs, rapsctl: Rapsctl) -> None:
    conf = cluster.hooks_config_path
    original = conf.read_text()
    log_dir = cluster.run_dir / "log" / "raps"
    out = cluster.run_dir / "failopen"
    out.mkdir(exist_ok=True)
    cluster.etcd_stop()
    try:
        ran = out / f"ran-{uuid.uuid4().hex[:8]}"
        job = jobs.submit("--raps", "-N2", "--wrap", f"touch {ran}")
        assert jobs.wait_finished(job) == "COMPLETED"
        assert ran.exists()
        line = [ln for ln in (log_dir / "prolog-slurmctld.log").read_text().splitlines()
                if f"job={job}:" in ln]
        assert len(line) == 1 and cluster.etcd_url in line[0], line
        assert "continues without RAPS registration" in line[0]

        conf.write_text(original.replace("hooks:\n", "hooks:\n  fail_open: false\n", 1))
        never = out / f"never-{uuid.uuid4().hex[:8]}"
        held = jobs.submit("--raps", "-N2", "--wrap", f"touch {never}")
        info = wait_until(f"job {held} requeued by Slurm", lambda: cluster.slurm().job(held),
                          lambda j: j.restart_count >= 1 and j.state == "PENDING", timeout=30)
        assert not never.exists(), info
        states = cluster.slurm().nodes()
        assert not [n.name for n in states if "DRAIN" in n.state_text.upper()], states
        logged = (log_dir / "prolog-slurmctld.log").read_text()
        assert f"job={held}:" in logged and "failing the prolog" in logged
    finally:
        conf.write_text(original)
        cluster.etcd_start()
    wait_until("the coordinator to lead again", lambda: rapsctl("ping", check=False).stdout,
               lambda o: "leader reg " in o, timeout=20)
