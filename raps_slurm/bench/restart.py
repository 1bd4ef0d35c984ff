"""``rapsctl bench restart``: the C heat stencil (examples/c/heat.c) loses a node, once
restarted by RAPS within its allocation (``raps-run --restart-mode step``), once by a
plain Slurm requeue; on a private local cluster brought up for the command.

Both runs are the same program with the same arguments on 4 ranks, one per node, each
rank holding ``--state`` bytes of plate (its band), checkpointing every ``--every``
steps and printing every step with the wall clock (``RAPS_HEAT_LOG``):

- **RAPS**: ``sbatch --raps --no-kill --raps-spares=2 -N6``, libraps checkpoints (the
  node-local incremental store, copies in the backup group).
- **requeue**: ``sbatch --requeue -N4``, ``srun --mpi=pmix``, the program's own
  checkpoint files on the shared file system (``RAPS_HEAT_FILE_CKPT``); Slurm finds the
  node dead after ``SlurmdTimeout`` (this cluster's, reported), requeues the job, which
  starts again on the remaining nodes and reads its files back.

In each, the node of the last rank is crashed (cgroup kill) once every rank committed
its ``--crash-after``-th checkpoint and the program is half-way to the next. Measured
from the crash: ``caught_up_s``, until the program prints again the highest step it had
printed before it stopped (its pre-fault progress), after a restart; ``running_s``, its
first step after the restart. For RAPS also the plans' phases: ``detect_s`` (crash to
DEAD verdict), ``relaunch_s`` (verdict to the new step launched), ``restore_s`` (launched
to the moved ranks restored). Both runs must print the same final line.

The cluster runs the test profile with the node detection at ``--interval``, but the
ranks' heartbeats at their shipped values (``detection.app_*``): a rank silent while
the step restarts is judged at the production rhythm, not the tests' 3 s.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from raps_slurm.bench.cluster import private_cluster
from raps_slurm.bench.recovery import restart_node
from raps_slurm.config import load_file
from raps_slurm.coordinator.plan_book import read_plans
from raps_slurm.errors import BenchError, SlurmCommandError
from raps_slurm.slurm import CommandRunner, commands
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import back_in_service, committed
from raps_slurm.testing.programs import build_stencils, export_option

RANKS = 4
PLATE_COLUMNS = 2048  # the C stencil's NY: a rank's band is state / (8 x NY) rows
GOAL_CAUGHT_UP_S = 20.0  # with 256 MiB per rank on 4 ranks
GOAL_SPEEDUP = 5.0  # the requeue path's caught_up_s over RAPS's
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
APP_DEFAULTS = (("detection", "app_heartbeat_interval_sec"), ("detection", "app_miss_threshold"),
                ("detection", "app_progress_timeout_sec"))
_PROGRESS = re.compile(r"^progress (\d+) ([0-9.]+)$")


def plate(state: int) -> tuple[int, int]:
    """(NX, NY) of a plate whose band per rank holds ``state`` bytes (at least 8 rows)."""
    rows = max(8, state // (8 * PLATE_COLUMNS))
    return rows * RANKS, PLATE_COLUMNS


def progress(text: str, crashed_at: float) -> dict[str, Any]:
    """From a job's output (every run's lines, in order): the highest step printed before
    the restart (the first ``restored step`` line after the last step printed before the
    crash), and the times of the first step after the restart and of the first at that
    highest step again; the failure-free step time (median before the crash) and
    ``redo_speed``, the steps from the restarted run's first to that highest one at the
    failure-free pace over the time they took; BenchError naming what is missing."""
    lines = text.splitlines()
    steps = [(i, int(m[1]), float(m[2])) for i, y in enumerate(lines) if (m := _PROGRESS.match(y))]
    last = max((i for i, _, t in steps if t <= crashed_at), default=-1)
    restart = next((i for i, x in enumerate(lines) if i > last and x.startswith("restored step")),
                   None)
    if restart is None:
        raise BenchError("no restart after the crash in the job's output")
    before = [(s, t) for i, s, t in steps if i < restart]
    after = [(s, t) for i, s, t in steps if i > restart]
    if not before or not after:
        raise BenchError("no progress line before or after the restart")
    reached = max(s for s, _ in before)
    caught = next((t for s, t in after if s >= reached), None)
    if caught is None:
        raise BenchError(f"the restarted run never printed step {reached} again")
    # the failure-free step time (median over the steps printed before the crash) and
    # the lost steps redone after the first one of the restarted run, at that pace
    free = [b[1] - a[1] for a, b in itertools.pairwise(x for x in before if x[1] <= crashed_at)
            if b[0] == a[0] + 1]
    step_s = statistics.median(free) if free else None
    redo, took = reached - after[0][0], caught - after[0][1]
    return {"pre_fault_step": reached, "restored_step": int(lines[restart].split()[-1]),
            "running_s": round(after[0][1] - crashed_at, 3),
            "caught_up_s": round(caught - crashed_at, 3),
            "failure_free_step_s": None if step_s is None else round(step_s, 4),
            "redo_steps": redo, "redo_s": round(took, 3),
            "redo_speed": round(redo * step_s / took, 4)
            if step_s is not None and redo > 0 and took > 0 else None}


def final_line(text: str) -> str | None:
    """The program's result line (the last ``final ...``)."""
    return next((x for x in reversed(text.splitlines()) if x.startswith("final ")), None)


class Run:
    """One job of the bench: its output and state."""

    def __init__(self, cluster: LocalCluster, name: str, sbatch: list[str], script: str) -> None:
        self.cluster = cluster
        self.runner = CommandRunner(timeout=60, env=cluster.env)
        out = cluster.run_dir / "bench-jobs"
        out.mkdir(exist_ok=True)
        out.chmod(0o777)
        path = out / f"{name}.sh"
        path.write_text(f"#!/bin/bash\n{script}\n")
        self.job = self.runner.run(["sbatch", "--parsable", "-o", str(out / f"{name}-%j.out"),
                                    "--open-mode=append", *sbatch, str(path)]
                                   ).strip().split(";")[0]
        self.out = out / f"{name}-{self.job}.out"

    def text(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def state(self) -> str:
        return self.cluster.slurm().job(int(self.job)).state

    def step(self) -> int:
        """The highest step the program printed so far."""
        return max((int(m[1]) for y in self.text().splitlines() if (m := _PROGRESS.match(y))),
                   default=0)

    def wait_step(self, step: int, timeout: float) -> None:
        wait_until(f"job {self.job} at step {step}", self.step, lambda s: s >= step, timeout,
                   interval=0.05)

    def victim(self) -> str:
        """The node of the last rank (never the batch script's)."""
        info = wait_until(f"job {self.job} running", lambda: self.cluster.slurm().job(
            int(self.job)), lambda j: j.state == "RUNNING" and bool(j.batch_host), 120)
        nodes = [n for n in info.nodes if n != info.batch_host]
        if not nodes:
            raise BenchError(f"job {self.job} has no node besides its batch host")
        return max(nodes)

    def finish(self, timeout: float) -> str:
        state = wait_until(f"job {self.job} to end", self.state, lambda s: s in FINAL, timeout)
        text = self.text()
        if state != "COMPLETED" or final_line(text) is None:
            raise BenchError(f"job {self.job} ended {state}: {text[-1500:]}")
        return text

    def cancel(self) -> None:
        with contextlib.suppress(SlurmCommandError):
            self.runner.run(commands.cancel(int(self.job)))


def _raps_phases(store: StateStore, keys: Keys, job: str, node: str,
                 crashed: float) -> dict[str, Any]:
    """detect_s, relaunch_s and restore_s from the plans that moved ``node``'s ranks."""
    book = read_plans(store, keys)
    plans = [p for p, _ in book.plans.values() if p.job == job and p.source == node]
    if not plans:
        raise BenchError(f"no plan moved the ranks of {node}")
    events = [book.events.get(p.plan_id, {}) for p in plans]
    detected = min(p.detected_at or p.created_at for p in plans)
    launched = [ev["launched"].at for ev in events if "launched" in ev]
    restored = [ev["restored"].at for ev in events if "restored" in ev]
    return {"detect_s": round(detected - crashed, 3),
            "relaunch_s": round(max(launched) - detected, 3) if launched else None,
            "restore_s": round(max(restored) - max(launched), 3)
            if restored and launched else None,
            "targets": sorted({p.target for p in plans}),
            "bytes_pulled": sum(int(ev["restored"].detail.get("bytes_pulled", 0))
                                for ev in events if "restored" in ev),
            "plans": len(plans)}


def _wait_copied(store: StateStore, keys: Keys, job: str, generations: int) -> None:
    """Until every rank has ``generations`` generations copied to its whole group."""
    wait_until("every rank's checkpoint copied", lambda: [
        r for r in range(RANKS) if len(committed(store, keys, job, r)) < generations],
        lambda left: not left, 300, interval=0.1)


def measure(cluster: LocalCluster, program: Path, state: int, steps: int, every: int,
            crash_after: int, files: Path, say: Any) -> dict[str, Any]:
    """The RAPS run and the requeue run; the JSON object's body."""
    cfg = load_file(cluster.config_path)
    store, keys = open_store(cfg.store)
    nx, ny = plate(state)
    args = f"{program} {nx} {ny} {steps} {every}"
    crash_step = crash_after * every + every // 2
    bindir = Path(sys.executable).parent
    out: dict[str, Any] = {}
    for mode in ("raps", "requeue"):
        if mode == "raps":
            run = Run(cluster, "restart-raps",
                      ["--raps", "--no-kill", "--raps-spares=2", "-N6",
                       export_option({"RAPS_HEAT_LOG": "1"})],
                      f"exec {bindir / 'raps-run'} --restart-mode step -- {args}")
        else:
            run = Run(cluster, "restart-requeue",
                      ["--requeue", f"-N{RANKS}",
                       export_option({"RAPS_HEAT_LOG": "1", "RAPS_HEAT_FILE_CKPT": str(files)})],
                      f"exec srun --mpi=pmix --ntasks={RANKS} --ntasks-per-node=1 {args}")
        node = ""
        try:
            node = run.victim()
            run.wait_step(crash_step, 600)
            if mode == "raps":  # and that checkpoint copied to every rank's backup group
                _wait_copied(store, keys, run.job, crash_after)
            crashed = time.time()
            cluster.crash(node)
            say(f"{mode}: crashed {node} at step {run.step()}")
            text = run.finish(900)
            row = {"crashed_node": node, **progress(text, crashed), "result": final_line(text),
                   "slurm_restarts": cluster.slurm().job(int(run.job)).restart_count}
            if mode == "raps":
                row.update(_raps_phases(store, keys, run.job, node, crashed))
                row["step_restarts"] = len(re.findall(r"^raps-run: step \d+: ", text, re.M)) - 1
            out[mode] = row
            say(f"{mode}: caught up {row['caught_up_s']}s after the crash")
        finally:
            run.cancel()
            if node:
                restart_node(cluster, node)
                back_in_service(cluster, store, keys, node)
    return out


def run_restart(state: int, steps: int, every: int, crash_after: int, interval: float,
                port: int, say: Any) -> dict[str, Any]:
    """Bring up the cluster and a coordinator, measure both runs, take it all down."""
    with private_cluster("raps-bench-restart-", port, interval, quiet=True,
                         defaults_for=APP_DEFAULTS) as cluster:
        work = Path(tempfile.mkdtemp(prefix="prog-", dir=cluster.run_dir))
        files = work / "ckpt"
        files.mkdir(mode=0o777)
        program = build_stencils(work, fortran=False)["heat"]
        coordinator = cluster.coordinator("bench").start()
        try:
            body = measure(cluster, program, state, steps, every, crash_after, files, say)
        finally:
            coordinator.stop()
        conf = (cluster.run_dir / "etc" / "slurm.conf").read_text()
        timeout = re.search(r"^SlurmdTimeout=(\d+)", conf, re.M)
    raps, requeue = body["raps"], body["requeue"]
    speedup = round(requeue["caught_up_s"] / raps["caught_up_s"], 2) \
        if raps["caught_up_s"] > 0 else None
    return {"benchmark": "restart", "ranks": RANKS, "state_per_rank_bytes": state,
            "plate": list(plate(state)), "steps": steps, "checkpoint_every_steps": every,
            "crash_step": crash_after * every + every // 2,
            "detection_interval_sec": interval,
            "slurmd_timeout_s": int(timeout[1]) if timeout else None,
            "detect_s": raps["detect_s"], "relaunch_s": raps["relaunch_s"],
            "restore_s": raps["restore_s"], "caught_up_s": raps["caught_up_s"],
            "requeue_caught_up_s": requeue["caught_up_s"], "speedup": speedup,
            "failure_free_step_s": raps["failure_free_step_s"],
            "redo_speed": raps["redo_speed"],
            "same_result": raps["result"] == requeue["result"] is not None,
            "goals": {"caught_up_s_max": GOAL_CAUGHT_UP_S, "speedup_min": GOAL_SPEEDUP,
                      "at_state_per_rank_bytes": 256 << 20},
            "goals_met": raps["caught_up_s"] <= GOAL_CAUGHT_UP_S
            and speedup is not None and speedup >= GOAL_SPEEDUP and state >= 256 << 20,
            "raps": raps, "requeue": requeue}


def dumps(result: dict[str, Any]) -> str:
    """The JSON line the command prints."""
    return json.dumps(result, sort_keys=False)
