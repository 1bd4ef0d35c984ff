"""An unchanged-style mpi4py program on the real local cluster: ``raps-run --mpi4py``
runs examples/mpi_master_worker.py (the master takes results with ``recv(ANY_SOURCE)``);
a worker's node crashes mid-run, only that rank is relaunched on a spare, restored and
replayed, and the job prints the failure-free result."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import (
    REPO,
    back_in_service,
    committed,
    ended_seeing,
    finish,
    wait_mapped,
)

PROGRAM = REPO / "examples" / "mpi_master_worker.py"
ARGS = ["--tasks", "240", "--every", "5", "--work-sec", "0.1"]


def reference(tmp: Path) -> str:
    """The failure-free result line, from the local launcher (checked against Open MPI by
    tests/unit/test_mpi_programs.py)."""
    proc = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", "-n", "4",
                           "--mpi4py", "--", sys.executable, str(PROGRAM), "--tasks", "240"],
                          cwd=tmp, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("tasks ")]
    return line


def submit(cluster: LocalCluster, sbatch: list[str]) -> tuple[str, Path]:
    """``sbatch --raps --no-kill`` a script that execs ``raps-run --mpi4py -- PROGRAM``."""
    out = cluster.run_dir / "jobs"
    out.mkdir(exist_ok=True)
    out.chmod(0o777)  # the job may run as another user
    script = out / "mpi.sh"
    script.write_text("#!/bin/bash\n"
                      f"exec {Path(sys.executable).parent / 'raps-run'} --mpi4py -- "
                      f"{sys.executable} {PROGRAM} {' '.join(ARGS)}\n")
    job = CommandRunner(timeout=60, env=cluster.env).run(
        ["sbatch", "--parsable", "-o", str(out / "mpi-%j.out"), "--raps", "--no-kill",
         *sbatch, str(script)]).strip().split(";")[0]
    return job, out / f"mpi-{job}.out"


def test_master_worker_loses_a_worker_node_and_prints_the_failure_free_result(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    clean = reference(tmp_path)
    s, keys = store
    with leading("mpi"):
        job, out = submit(cluster, ["--raps-spares=1", "-N5"])
        try:
            data = wait_mapped(s, keys, job)
            ranks = {r["rank"]: r["node"] for r in data["ranks"]}
            host = wait_until("the batch host", lambda: cluster.slurm().job(int(job)).batch_host,
                              bool, 20)
            # a worker not on the batch script's node (losing that one escalates)
            victim = max(r for r, n in ranks.items() if n != host and r != 0)
            node = ranks[victim]
            wait_until(f"rank {victim} committed a checkpoint",
                       lambda: committed(s, keys, job, victim), bool, 90)
            cluster.crash(node)
            try:
                seen, _ = ended_seeing(cluster, s, keys, [job], 180)
                text = finish(cluster, job, out, clean)
                [plan] = seen[job].values()
                assert (plan.rank, plan.source, plan.state) == (victim, node, "done"), plan
                assert f"raps-run: rank {victim} epoch 2 started on {plan.target}" in text, \
                    text[-4000:]
            finally:
                cluster.restart(node)
                back_in_service(cluster, s, keys, node)
        finally:
            with contextlib.suppress(SlurmCommandError):
                CommandRunner(timeout=60, env=cluster.env).run(["scancel", job])
