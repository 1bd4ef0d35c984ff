"""Any MPI program, restarted whole within its allocation: the heat stencils of
examples/c and examples/fortran, compiled with mpicc/mpif90 against libraps, run under
``raps-run --restart-mode step`` (``srun --mpi=pmix``, Debian's Open MPI) on the real
local cluster. Each loses a node mid-run: the step is restarted on a spare, every rank
from the newest common generation, and the job ends with the output of the same program
run failure-free by mpirun, without a requeue (Slurm's restart count stays 0)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm.runner import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import (
    committed,
    crashed,
    finish,
    job_plans,
    job_state,
    last_final,
    wait_mapped,
)
from raps_slurm.testing.programs import build_stencils, export_option, mpirun, register_job

# 4 ranks, one per working node; the plate is cut in 4 bands (C: rows, Fortran: columns).
ARGS = ("1024", "1024", "2000", "200")  # seconds of steps: the crash falls mid-run


@pytest.fixture(scope="module")
def programs() -> Iterator[Path]:
    """The C and Fortran stencils linked to a copy of libraps every uid can read."""
    out = Path(tempfile.mkdtemp(prefix="raps-step-"))
    try:
        build_stencils(out)
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)


@contextlib.contextmanager
def step_job(cluster: LocalCluster, program: Path, name: str) -> Iterator[tuple[str, Path]]:
    job, out = cluster.submit_raps_run(
        [str(program), *ARGS], ["--raps-spares=2", "-N6", export_option()], name,
        run_options=["--restart-mode", "step"])
    try:
        yield job, out
    finally:
        with contextlib.suppress(SlurmCommandError):
            CommandRunner(timeout=60, env=cluster.env).run(["scancel", job])


@pytest.mark.parametrize("name", ["heat", "fheat"])
def test_an_mpi_program_loses_a_node_and_ends_with_the_failure_free_output(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], programs: Path, name: str) -> None:
    # the failure-free result: the same program and ranks under mpirun on this host
    ref = mpirun(cluster.config_path, programs / name, register_job(store, 4), ARGS)
    clean = last_final(ref.stdout)
    assert ref.returncode == 0 and clean, (ref.stdout[-2000:], ref.stderr[-2000:])
    with leading(f"step-{name}"), \
            step_job(cluster, programs / name, f"{name}-crash") as (job, out):
        data = wait_mapped(*store, job)
        ranks = {r["rank"]: r["node"] for r in data["ranks"]}
        host = wait_until("the batch host",
                          lambda: cluster.slurm().job(int(job)).batch_host, bool, 20)
        victim = max(n for n in ranks.values() if n != host)
        lost = sorted(r for r, n in ranks.items() if n == victim)
        # every rank has committed a generation: the crash falls after a checkpoint
        for r in ranks:
            wait_until(f"rank {r} committed", lambda r=r: committed(*store, job, r),
                       bool, 120)
        assert job_state(cluster, job) == "RUNNING", out.read_text()[-3000:]
        with crashed(cluster, store, victim):
            text = finish(cluster, job, out, clean, 240)
            assert "restored step" in text or "restored generation" in text, text[-3000:]
            # done: each moved rank reported it was back at its pre-fault step. (A rank
            # that fails at start-up, e.g. Open MPI's TCP connect under load, is HUNG
            # and restarted in place: a plan of its own, not a move off the victim.)
            plans = wait_until("the moves done", lambda: [
                p for p in job_plans(*store, job) if p.source == victim != p.target],
                lambda ps: ps and all(p.state == "done" for p in ps), 30)
            assert sorted(p.rank for p in plans) == lost, plans
            assert {p.target for p in plans} <= set(data["spares"]), plans
            assert cluster.slurm().job(int(job)).restart_count == 0, text[-3000:]
            assert "restarting the step" in text, text[-3000:]
