"""Proactive migration on the real cluster: a node whose NVMe heats past the threshold is
drained for health; its rank checkpoints, stops and moves to a spare through a planned
plan before anything fails; the job's result equals the failure-free run."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from raps_slurm.core.planner import Plan
from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import FINAL, HEAT_RING, heat_reference, job_plans, phase_report
from raps_slurm.testing.sysfs import make_tree

# 400 steps of 0.05 s: the planned move was done 8 s after the submission on a loaded
# 2-core machine, and the job runs 20 s and more (a job that ended first fails the test)
STEPS = ["--steps", "400", "--every", "20"]
HOT = "n5"  # runs a rank, not the batch script, with the placement of a 6-node job


def reference(tmp: Path) -> str:
    return heat_reference(tmp, 4, STEPS)


def plans(store: tuple[StateStore, Keys], job: str) -> list[Plan]:
    return job_plans(*store, job)


def test_a_heating_node_moves_its_rank_before_it_fails(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Any, leading: Any,
        tmp_path: Path) -> None:
    s, keys = store
    clean = reference(tmp_path)
    run = CommandRunner(timeout=60, env=cluster.env)
    root = cluster.run_dir / f"sysfs-{HOT}"
    make_tree(root, nvme_temp_c=40.0)
    cluster.agent_stop(HOT)
    cluster.agent_start(HOT, "--probe-root", str(root))
    job = ""
    try:
        with leading("migrate"):
            # restarting the agent may have made the node DEAD and drained: take it back
            wait_until(f"{HOT} registered", lambda: s.get(keys.node(HOT)), bool, 20)
            with contextlib.suppress(SlurmCommandError):
                run.run(["scontrol", "update", f"NodeName={HOT}", "State=RESUME"])
            wait_until(f"{HOT} in service", lambda: cluster.slurm().node(HOT).state_text,
                       lambda t: "DRAIN" not in t.upper() and "DOWN" not in t.upper(), 20)
            job, out = cluster.submit_raps_run(
                [sys.executable, str(HEAT_RING), *STEPS,
                 "--step-sec", "0.05"], ["-N6", "--raps-spares=2", "--open-mode=append"],
                "migrate")
            data = wait_until(f"job {job} mapped", lambda: rapsctl.job(int(job)),
                              lambda d: d is not None and d["state"] == "mapped", 60)
            ranks = {r["rank"]: r["node"] for r in data["ranks"]}
            assert HOT in ranks.values(), f"the placement changed: {ranks}"
            rank = next(r for r, n in ranks.items() if n == HOT)
            wait_until(f"rank {rank} checkpointed", lambda: s.get_prefix(
                keys.ckpt_prefix(job, rank)), bool, 60)
            make_tree(root, nvme_temp_c=72.0)  # past the 70 C threshold: drained for health
            plan = wait_until(f"rank {rank}'s planned move done", lambda: plans(store, job),
                              lambda ps: any(p.planned and p.state == "done" for p in ps),
                              90)
            [moved] = [p for p in plan if p.planned]
            assert moved.rank == rank and moved.source == HOT and moved.target != HOT
            assert moved.reason.startswith(f"planned: {HOT} drained: nvme0 temp")
            assert phase_report(s, keys, moved.plan_id, "checkpointed") is not None
            state = wait_until(f"job {job} ended", lambda: cluster.slurm().job(int(job)).state,
                               lambda st: st in FINAL, 150)
            text = out.read_text()
            assert state == "COMPLETED", text[-4000:]
            assert clean in text.splitlines(), text[-4000:]
            assert f"rank {rank} moves off {HOT} (drained for health): checkpoint now" in text
            assert "checkpointed and stopped for its move" in text
            # Nothing died: no DEAD verdict for the hot node, no other rank restarted.
            kv = s.get(keys.node_verdict(HOT))
            assert kv is None or json.loads(kv.value)["kind"] != "DEAD" or \
                float(json.loads(kv.value)["at"]) < moved.created_at, kv
            starts = [x for x in text.splitlines() if x.startswith("raps-run: rank ")
                      and " started on " in x]
            assert len(starts) == len(ranks) + 1, starts
    finally:
        if job:
            with contextlib.suppress(SlurmCommandError):
                run.run(["scancel", job])
        make_tree(root, nvme_temp_c=40.0)
        cluster.agent_stop(HOT)
        cluster.agent_start(HOT)
        with contextlib.suppress(SlurmCommandError):
            run.run(["scontrol", "update", f"NodeName={HOT}", "State=RESUME"])
