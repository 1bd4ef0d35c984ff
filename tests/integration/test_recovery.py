"""Recovery end to end on the real local cluster: ``sbatch --raps --no-kill`` running
``raps-run``, a node crashed mid-run, only its rank relaunched on a spare, restored and
replayed, the result identical to a failure-free run."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import RankEntry
from raps_slurm.core.planner import Plan
from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm.runner import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HEAT = ["--steps", "240", "--every", "20", "--step-sec", "0.05"]


def reference(tmp: Path, ranks: int) -> str:
    """The failure-free result, from the local launcher (the same program and arithmetic)."""
    proc = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", "-n", str(ranks),
                           "--dir", str(tmp / "ref"), "--", sys.executable,
                           str(REPO / "examples" / "heat_ring.py"), "--steps", "240",
                           "--every", "20"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("final ")]
    return line


@contextmanager
def raps_job(cluster: LocalCluster, *sbatch: str) -> Iterator[tuple[str, Path]]:
    """A --raps job running heat_ring under raps-run; cancelled when the block ends."""
    run = CommandRunner(timeout=60, env=cluster.env)
    out = cluster.run_dir / "jobs"
    out.mkdir(exist_ok=True)
    out.chmod(0o777)
    script = out / "heat.sh"
    script.write_text("#!/bin/bash\n"
                      f"exec {BIN / 'raps-run'} -- {sys.executable} "
                      f"{REPO / 'examples' / 'heat_ring.py'} {' '.join(HEAT)}\n")
    job = run.run(["sbatch", "--parsable", "-o", str(out / "job-%j.out"), "--raps",
                   "--no-kill", *sbatch, str(script)]).strip().split(";")[0]
    try:
        yield job, out / f"job-{job}.out"
    finally:
        with contextlib.suppress(SlurmCommandError):
            run.run(["scancel", job])


def entries(store: tuple[StateStore, Keys], job: str) -> dict[int, RankEntry]:
    s, k = store
    return {e.rank: e for e in (RankEntry.from_json(kv.key, kv.value)
                                for kv in s.get_prefix(k.job_ranks_prefix(job)))}


def records(store: tuple[StateStore, Keys], job: str, rank: int) -> list[CkptRecord]:
    s, k = store
    return sorted((CkptRecord.from_json(kv.key, kv.value)
                   for kv in s.get_prefix(k.ckpt_prefix(job, rank))),
                  key=lambda r: r.generation)


def committed(store: tuple[StateStore, Keys], job: str, rank: int) -> list[int]:
    """Generations copied to the whole group (what a restore elsewhere needs)."""
    return [r.generation for r in records(store, job, rank) if r.state == "committed"]


def plans(store: tuple[StateStore, Keys], job: str) -> list[Plan]:
    s, k = store
    prefix = k.plans_prefix()
    return [Plan.from_json(kv.key, kv.value) for kv in s.get_prefix(k.job_plans_prefix(job))
            if "/" not in kv.key[len(prefix):]]


def job_state(cluster: LocalCluster, job: str) -> str:
    return cluster.slurm().job(int(job)).state


def test_node_crash_relaunches_only_its_rank_and_the_result_is_unchanged(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Any,
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    clean = reference(tmp_path, 4)
    with leading("recovery"), raps_job(cluster, "--raps-spares=2", "-N6") as (job, out):
        data = wait_until(f"job {job} mapped", lambda: rapsctl.job(int(job)),
                          lambda d: d is not None and d["state"] == "mapped", 30)
        batch_host = wait_until("the batch host", lambda: cluster.slurm().job(int(job)).batch_host,
                                bool, 20)
        ranks = {r["rank"]: r["node"] for r in data["ranks"]}
        victim = max(r for r, n in ranks.items() if n != batch_host)
        node = ranks[victim]
        wait_until(f"rank {victim} committed two generations",
                   lambda: committed(store, job, victim), lambda g: len(g) >= 2, 60)
        before = [(r.generation, r.state, r.holders) for r in records(store, job, victim)]
        cluster.crash(node)
        try:
            wait_until(f"job {job} completed", lambda: job_state(cluster, job),
                       lambda s: s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 150)
            text = out.read_text()
            assert job_state(cluster, job) == "COMPLETED", f"{before}\n{text[-4000:]}"
            assert clean in text.splitlines(), text[-4000:]
            [plan] = plans(store, job)
            assert (plan.rank, plan.source, plan.epoch, plan.state) == (victim, node, 2, "done")
            assert plan.target in data["spares"]
            now = entries(store, job)
            assert {r: e.epoch for r, e in now.items()} == {
                r: (2 if r == victim else 1) for r in ranks}
            assert now[victim].node == plan.target
            # raps-run started every rank once, and only the victim again
            started = [x for x in text.splitlines() if x.startswith("raps-run: rank ")
                       and " started on " in x]
            assert sorted(started) == sorted(
                [f"raps-run: rank {r} epoch 1 started on {n}" for r, n in ranks.items()]
                + [f"raps-run: rank {victim} epoch 2 started on {plan.target}"]), text[-4000:]
            shown = json.loads(rapsctl("show", "plan", plan.plan_id, "--json").stdout)
            phases = [row["phase"] for row in shown["timeline"]]
            assert phases == ["fault verdict", "plan", "start", "launched", "restored",
                              "running", "done"], shown
            listing = rapsctl("show", "recoveries", job).stdout
            assert plan.plan_id in listing and "done" in listing
        finally:
            cluster.restart(node)
            CommandRunner(timeout=60, env=cluster.env).run(
                ["scontrol", "update", f"NodeName={node}", "State=RESUME"])
