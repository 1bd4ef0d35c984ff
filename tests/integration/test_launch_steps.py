"""raps-run's launch on the real local cluster: one step for all ranks, one node
supervisor per node, each rank pinned to its share of the node's CPUs."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm.runner import CommandRunner
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import HEAT_RING, finish, heat_reference, sruns_of_run

ARGS = ["--steps", "160", "--every", "20"]


def job_ranks(job: str) -> dict[int, int]:
    """rank -> pid of the job's running ranks, found by the environment raps-run gave them."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(x.split(b"=", 1) for x in (d / "environ").read_bytes().split(b"\0")
                       if b"=" in x)
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if env.get(b"RAPS_JOB") == job.encode() and b"heat_ring.py" in cmd:
            found[int(env[b"RAPS_RANK"])] = int(d.name)
    return found


def allowed_cpus(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return ""


def test_four_ranks_per_node_start_as_one_step(
        cluster: LocalCluster, rapsctl: Any, leading: Callable[[str], Any],
        tmp_path: Path) -> None:
    clean = heat_reference(tmp_path, 8, ARGS)
    run = CommandRunner(timeout=60, env=cluster.env)
    with leading("launch"):
        job, out = cluster.submit_raps_run(
            [sys.executable, str(HEAT_RING), *ARGS, "--step-sec", "0.05"],
            ["--raps-spares=2", "--raps-ranks-per-node=4", "-N4"], "launch",
            ["--lab"])  # a prefix of --label, as srun reads it (core/srun_options.py)
        try:
            data = wait_until(f"job {job} mapped", lambda: rapsctl.job(int(job)),
                              lambda d: d is not None and d["state"] == "mapped", 60)
            nodes = {r["rank"]: r["node"] for r in data["ranks"]}
            assert sorted(Counter(nodes.values()).values()) == [4, 4], nodes
            pids = wait_until("all 8 ranks running", lambda: job_ranks(job),
                              lambda p: len(p) == 8, 60)
            # raps-run took --lab itself: srun would label the supervisors' tasks (nodes)
            argvs = []
            for pid in sruns_of_run(cluster, job, 0):
                with contextlib.suppress(OSError):
                    argvs.append(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
            assert argvs, "the run's srun is not found"
            assert not [a for argv in argvs for a in argv if a.startswith((b"--lab", b"-l"))], \
                argvs
            steps = run.run(["squeue", "--steps", "-j", job, "-h", "-o", "%i|%N|%j"])
            rows = [x.split("|") for x in steps.splitlines() if x.strip()]
            ours = [r for r in rows if not r[0].endswith((".batch", ".extern"))]
            # one step for the 8 ranks, over both working nodes; besides it the batch step
            assert len(ours) == 1, rows
            assert ours[0][2] == f"raps-{job}-run0", rows
            assert {r[0] for r in rows} - {ours[0][0]} <= {f"{job}.batch", f"{job}.extern"}
            # the fake nodes share this 2-CPU machine: 4 ranks per node, one CPU each,
            # round-robin over the supervisor's CPUs
            cpus = [allowed_cpus(p) for p in pids.values()]
            assert all(c and "," not in c and "-" not in c for c in cpus), cpus
            text = finish(cluster, job, out, f"0: {clean}")  # --label: rank 0's line
        finally:
            with contextlib.suppress(SlurmCommandError):
                run.run(["scancel", job])
    started = [x for x in text.splitlines() if x.startswith("raps-run: rank ")
               and " started on " in x]
    assert sorted(started) == sorted(f"raps-run: rank {r} epoch 1 started on {n}"
                                     for r, n in nodes.items()), text[-4000:]
    assert text.count("raps-run: supervisor on ") == 2, text[-4000:]
    assert "raps-run: all 8 ranks finished" in text
    assert clean not in text.splitlines()  # labelled, and only so
