"""``rapsctl bench recovery`` and ``rapsctl bench efficiency``: a node crash in a real
``--raps`` job on a private local cluster (brought up for the command, taken down after).

``recovery``: ``examples/heat_ring.py`` (``--program heat_ring``, its steps sleep) or
``raps_slurm/bench/jacobi_prog.py`` (``compute``: Jacobi sweeps; ``sleep``: the same
program sleeping instead) under ``raps-run`` on 4 nodes with 2 spares,
``--ranks-per-node`` ranks each, checkpointing every ``--checkpoint-sec`` seconds (1 by
default; ``configs/raps.yaml`` has 600); every rank of the last node carries ``--state``
bytes of extra state (random, so nothing compresses). At a random point of a checkpoint
interval (drawn from ``--seed``: uniform between the last rank's newest commit on its
whole group and the next checkpoint due), that node is crashed (cgroup kill) and all its
ranks move to one spare. ``total_s`` (= ``caught_up_s``) runs from the crash until the
last moved rank has regained its pre-fault progress (it has sent again everything it had
sent before the crash): the lost part of the interval redone is inside it;
``running_s`` ends at its first step after the restore. The phases come from the plans'
timelines (the slowest rank for each). ``--runs`` jobs, one crash each, on the same
cluster: p50 and p90 of the phases, the goal (``GOAL_TOTAL_S``) judged on the p50 of
``total_s``, and the run at the median at the top level. jacobi_prog also gives
``replay_speed`` (``reexecution``): the lost steps' work at the same run's failure-free
step time over the time the moved rank took to redo them. The cluster runs the
test profile but for what nodes and ranks report in the background, which keeps its
defaults (``bench/cluster.py`` ``QUIET``; listed in ``background_at_defaults``): the
test profile's statistics every second, telemetry twice a second and DEBUG logs from
48 ranks and 6 agents took a quarter of the machine a production cluster does not spend.

``efficiency``: the same application and the same failure twice in one command: once
recovered by raps-slurm (spares), once by a whole-job restart from each rank's last
checkpoint (no spare: the leader requeues the job, which is what ``--requeue`` gives,
here with raps-slurm's fast detection and an immediate restart, so the comparison
flatters the restart). Useful work is ``steps x step_sec`` (the program's compute);
the fraction is that over the wall time from the job's start to its end. A third run,
the raps job without a failure (``failure_free``), gives the machine's own pace, which
``rapsctl simulate validate`` needs to compare the failed run with the simulator. The
restart run's ``requeue`` holds its phases from the leader's escalation record and the
ranks' "resumed" lines; ``requeue_calibration`` the same phases of another such crash,
stopped once its ranks restored, whose relaunch the simulated requeue is given (the
validated run's own would make the comparison circular).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from raps_slurm.bench.cluster import QUIET, REPO, private_cluster
from raps_slurm.config import load_file
from raps_slurm.coordinator.plan_book import read_plans
from raps_slurm.core.planner import Plan, PlanEvent
from raps_slurm.errors import BenchError, SlurmCommandError
from raps_slurm.slurm import CommandRunner, commands
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import back_in_service

FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
# heat_ring in bench recovery: seconds of work per step, steps between checkpoints, and the
# halo messages each rank sends per step (what a relaunched rank sends again while it
# replays: the "replayed" count of its recovery); reported so that `rapsctl simulate
# calibrate` can turn replayed messages into replayed work.
RECOVERY_STEP_SEC, RECOVERY_EVERY, HALO_MESSAGES_PER_STEP = 0.05, 20, 2
# --program: heat_ring (sleeping steps), or bench/jacobi_prog.py computing (a band of
# JACOBI_ROWS x JACOBI_COLS float64, JACOBI_SWEEPS sweeps a step) or sleeping
# RECOVERY_STEP_SEC a step instead; the latter two print every step's time.
PROGRAMS = ("heat_ring", "compute", "sleep")
JACOBI_ROWS, JACOBI_COLS, JACOBI_SWEEPS = 512, 1024, 6
FREE_WINDOW = 100  # failure-free steps before the crash whose times give the pace
GOAL_TOTAL_S = 12.0  # crash to every moved rank caught up, judged on the runs' p50
# the phases summarized over the runs (p50 and p90 of each)
SUMMARIZED = ("total", "running", "detect", "restore", "reexecute")
_LINE = re.compile(r"^(progress|resumed) (\d+) (\d+) (\d+) ([0-9.]+) ([0-9.]+)$", re.M)


def crash_points(seed: int, runs: int, checkpoint_sec: float) -> list[float]:
    """Seconds after a commit at which each run's crash comes: uniform over the
    checkpoint interval, the same for the same seed."""
    rng = random.Random(seed)
    return [round(rng.uniform(0.0, checkpoint_sec), 3) for _ in range(runs)]


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, interpolated between the two nearest
    (numpy's default); BenchError without values."""
    if not values:
        raise BenchError("bench recovery: no run to summarize")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 3)


def summarize(rows: list[dict[str, Any]], checkpoint_sec: float, seed: int
              ) -> dict[str, Any]:
    """The JSON object of ``bench recovery`` from its runs: the run at the median of
    ``total_s`` at the top level (the lower one of an even count; what ``rapsctl
    simulate calibrate`` reads), p50 and p90 of each phase over the runs, healthy ranks
    restarted summed over the runs, the goals and every run."""
    order = sorted(range(len(rows)), key=lambda i: rows[i]["total_s"])
    median = order[(len(rows) - 1) // 2]
    out: dict[str, Any] = {**rows[median], "benchmark": "recovery", "runs": len(rows),
                           "seed": seed, "checkpoint_interval_s": checkpoint_sec,
                           "median_run": median}
    for phase in SUMMARIZED:
        values = [float(r[f"{phase}_s"]) for r in rows]
        out[f"{phase}_p50_s"] = percentile(values, 0.5)
        out[f"{phase}_p90_s"] = percentile(values, 0.9)
    for key in ("replay_speed", "replay_speed_cpu", "replay_speed_core"):
        speeds = [float(r[key]) for r in rows if r.get(key) is not None]
        if speeds:
            out[f"{key}_p50"] = percentile(speeds, 0.5)
            out[f"{key}_min"] = min(speeds)
    out["healthy_ranks_restarted"] = sum(int(r["healthy_ranks_restarted"]) for r in rows)
    out["goals"] = {"total_p50_s_max": GOAL_TOTAL_S, "healthy_ranks_restarted_max": 0}
    out["goals_met"] = out["total_p50_s"] <= GOAL_TOTAL_S \
        and out["healthy_ranks_restarted"] == 0
    out["per_run"] = rows
    return out


class JobBench:
    """One ``--raps`` heat_ring job on the bench cluster and the etcd keys about it."""

    def __init__(self, cluster: LocalCluster, store: StateStore, keys: Keys, name: str,
                 sbatch: list[str], heat: list[str],
                 program: Path = REPO / "examples" / "heat_ring.py") -> None:
        self.cluster, self.store, self.keys = cluster, store, keys
        self.run = CommandRunner(timeout=60, env=cluster.env)
        out = cluster.run_dir / "bench-jobs"
        out.mkdir(exist_ok=True)
        out.chmod(0o777)
        script = out / f"{name}.sh"
        bindir = Path(sys.executable).parent
        script.write_text("#!/bin/bash\n"
                          f"exec {bindir / 'raps-run'} -- {sys.executable} "
                          f"{program} {' '.join(heat)}\n")
        self.job = self.run.run(["sbatch", "--parsable", "-o", str(out / f"{name}-%j.out"),
                                 "--open-mode=append", "--raps", "--no-kill", *sbatch,
                                 str(script)]).strip().split(";")[0]
        self.out = out / f"{name}-{self.job}.out"

    def state(self) -> str:
        return self.cluster.slurm().job(int(self.job)).state

    def ranks(self, run: int = 0) -> dict[int, tuple[str, int]]:
        """rank -> (node, epoch) once the leader mapped the given run."""
        def read() -> dict[int, tuple[str, int]]:
            m = self.store.get(self.keys.job_map(self.job))
            if m is None or json.loads(m.value).get("restart_count") != run:
                return {}
            return {int(d["rank"]): (str(d["node"]), int(d["epoch"]))
                    for d in (json.loads(kv.value) for kv in
                              self.store.get_prefix(self.keys.job_ranks_prefix(self.job)))}
        return wait_until(f"job {self.job} mapped", read, bool, 90)

    def committed(self, rank: int) -> int:
        """Generations of ``rank`` copied to its whole group."""
        return len(self.committed_gens(rank))

    def committed_gens(self, rank: int) -> list[int]:
        return sorted(int(d["generation"]) for d in (
            json.loads(kv.value)
            for kv in self.store.get_prefix(self.keys.ckpt_prefix(self.job, rank)))
            if d.get("state") == "committed")

    def newest(self, rank: int) -> int:
        """The rank's newest generation, committed on its group or not."""
        return max((int(json.loads(kv.value)["generation"]) for kv in
                    self.store.get_prefix(self.keys.ckpt_prefix(self.job, rank))), default=0)

    def after_next_commit(self, rank: int, checkpoint_sec: float = 1.0) -> None:
        """Return as soon as a generation newer than the newest committed one is committed
        on the rank's whole group (a checkpoint interval starts then)."""
        wait_until(f"rank {rank}'s state committed on its group", lambda: self.committed(rank),
                   lambda n: n >= 2, 600 + 3 * checkpoint_sec, interval=0.05)
        newest = self.committed_gens(rank)[-1]
        wait_until(f"rank {rank}'s next committed generation", lambda: self.committed_gens(rank),
                   lambda g: bool(g) and g[-1] > newest, 120 + 2 * checkpoint_sec,
                   interval=0.01)

    def victim(self) -> tuple[int, str]:
        """The last rank, which must not share the batch script's node."""
        ranks = self.ranks()
        host = wait_until("the batch host",
                          lambda: self.cluster.slurm().job(int(self.job)).batch_host, bool, 30)
        rank = max(ranks)
        if ranks[rank][0] == host:
            raise BenchError(f"rank {rank} shares the batch host {host}")
        return rank, ranks[rank][0]

    def plans(self) -> dict[int, tuple[Plan, dict[str, PlanEvent]]]:
        """rank -> its newest plan and that plan's reported phases."""
        book = read_plans(self.store, self.keys)  # as the leader reads them
        newest: dict[int, Plan] = {}
        for p, _ in book.plans.values():
            if p.job == self.job and (p.rank not in newest or p.epoch > newest[p.rank].epoch):
                newest[p.rank] = p
        return {r: (p, book.events.get(p.plan_id, {})) for r, p in newest.items()}

    def wait_final(self, timeout: float) -> str:
        return wait_until(f"job {self.job} to end", self.state, lambda s: s in FINAL, timeout,
                          interval=0.1)

    def cancel(self) -> None:
        with contextlib.suppress(SlurmCommandError):
            self.run.run(commands.cancel(int(self.job)))


def restart_node(cluster: LocalCluster, node: str) -> None:
    """A crashed node's slurmd and agent back, the node resumed in Slurm."""
    cluster.restart(node)
    CommandRunner(timeout=60, env=cluster.env).run(commands.resume([node]))


def program_args(program: str, steps: int, state: int, ranks_per_node: int,
                 checkpoint_sec: int) -> tuple[Path, list[str]]:
    """The script and arguments of ``--program``; BenchError naming the choices."""
    ballast = ["--ballast-mb", str(max(1, state >> 20)), "--ballast-ranks", str(ranks_per_node)]
    if program == "heat_ring":
        every = max(1, round(checkpoint_sec / RECOVERY_STEP_SEC))
        return REPO / "examples" / "heat_ring.py", [
            "--steps", str(steps), "--every", str(every), "--step-sec", str(RECOVERY_STEP_SEC),
            *ballast]
    if program not in PROGRAMS:
        raise BenchError(f"bench recovery: --program {program!r}: one of {', '.join(PROGRAMS)}")
    work = ["--sleep-sec", str(RECOVERY_STEP_SEC)] if program == "sleep" else []
    return REPO / "raps_slurm" / "bench" / "jacobi_prog.py", [
        "--steps", str(steps), "--rows", str(JACOBI_ROWS), "--cols", str(JACOBI_COLS),
        "--sweeps", str(JACOBI_SWEEPS), *work, *ballast]


def reexecution(text: str, rank: int, crashed: float) -> dict[str, Any] | None:
    """From jacobi_prog's output: ``rank``'s failure-free step time before ``crashed``
    (median wall and CPU seconds of its last FREE_WINDOW steps: a step that saved a
    checkpoint is an outlier the median leaves out, as the simulator counts saves apart)
    and its re-execution after the relaunch: the steps from the restored one to its
    pre-fault step, timed from its ``resumed`` line to the first line at that step.
    ``replay_speed`` is work redone (steps x failure-free step time) over that time;
    ``replay_speed_cpu`` takes the failure-free step's CPU time instead (its pace on a core
    of its own, where the wall time is inflated by ranks sharing cores) and
    ``replay_speed_core`` that over the CPU time the re-execution used (both on a core of
    their own: the machine's other load left out). None while the output lacks any of it."""
    rows = [(m[1], int(m[3]), int(m[4]), float(m[5]), float(m[6]))
            for m in _LINE.finditer(text) if int(m[2]) == rank]
    before = [(st, wall, cpu) for kind, epoch, st, wall, cpu in rows
              if kind == "progress" and wall <= crashed and epoch == rows[0][1]] if rows else []
    resumed = [(epoch, st, wall, cpu) for kind, epoch, st, wall, cpu in rows
               if kind == "resumed" and wall > crashed]
    if len(before) < 3 or not resumed:
        return None
    before = before[-FREE_WINDOW:]
    pairs = [(b[1] - a[1], b[2] - a[2]) for a, b in itertools.pairwise(before)
             if b[0] == a[0] + 1]
    if not pairs:
        return None
    epoch, restored, t0, c0 = resumed[-1]
    target = before[-1][0]
    reached, cpu = next(((wall, c) for kind, e, st, wall, c in rows
                         if kind == "progress" and e == epoch and st >= target), (None, 0.0))
    if reached is None:
        return None
    free = statistics.median(w for w, _ in pairs)
    free_cpu = statistics.median(c for _, c in pairs)
    steps, took = target - restored, reached - t0
    out: dict[str, Any] = {
        "rank": rank, "pre_fault_step": target, "restored_step": restored,
        "failure_free_step_s": round(free, 4),
        "failure_free_step_mean_s": round(statistics.fmean(w for w, _ in pairs), 4),
        "failure_free_step_cpu_s": round(free_cpu, 4), "failure_free_steps": len(pairs),
        "reexec_steps": steps, "reexec_s": round(took, 3), "reexec_cpu_s": round(cpu - c0, 3),
        "replay_speed": None, "replay_speed_cpu": None, "replay_speed_core": None}
    if steps > 0 and took > 0:
        out["replay_speed"] = round(steps * free / took, 4)
        out["replay_speed_cpu"] = round(steps * free_cpu / took, 4)
        if cpu > c0:
            out["replay_speed_core"] = round(steps * free_cpu / (cpu - c0), 4)
    return out


def measure_recovery(cluster: LocalCluster, state: int, steps: int,
                     ranks_per_node: int = 1, checkpoint_sec: int = 1,
                     crash_point: float = 0.0, name: str = "recovery",
                     program: str = "heat_ring") -> dict[str, Any]:
    """One crash, ``crash_point`` seconds into a checkpoint interval of
    ``checkpoint_sec``, of the node whose ranks each carry ``state`` bytes; the phases of
    the move of all its ranks to a spare (the slowest rank's, which is what the job waits
    for); with jacobi_prog (``program`` compute or sleep) also the re-execution speed."""
    cfg = load_file(cluster.config_path)
    store, keys = open_store(cfg.store)
    script, args = program_args(program, steps, state, ranks_per_node, checkpoint_sec)
    # the job's own interval, so that the profile's (5 s) does not checkpoint sooner
    bench = JobBench(cluster, store, keys, name,
                     ["--raps-spares=2", "-N6", f"--raps-ranks-per-node={ranks_per_node}",
                      f"--raps-ckpt-interval={checkpoint_sec}"], args, script)
    try:
        rank, node = bench.victim()
        victims = sorted(r for r, (n, _) in bench.ranks().items() if n == node)
        wait_until("every rank of the node committed",
                   lambda: [r for r in victims if not bench.committed(r)],
                   lambda left: not left, 600, interval=0.1)
        # A node dies hours into a job, not while its ranks' first 128 MiB generations
        # are still being copied: the crash comes once every rank of the node has a
        # second generation on its whole group (the first copies are over). Before, the
        # spare restores generations from seconds earlier, and the time to redo them is
        # the start-up's, not a recovery's.
        wait_until("every rank of the node with two generations copied",
                   lambda: [r for r in victims if bench.committed(r) < 2],
                   lambda left: not left, 300 + 3 * checkpoint_sec, interval=0.1)
        bench.after_next_commit(rank, checkpoint_sec)
        committed_at = time.time()
        time.sleep(crash_point)  # the work done since the commit is lost with the node
        crashed = time.time()
        cluster.crash(node)
        # what each rank had saved: the newest generation (on its group or not yet)
        newest = {r: bench.newest(r) for r in victims}
        try:
            moved = wait_until("every rank of the node caught up", bench.plans,
                               lambda ps: len(ps) >= len(victims)
                               and all("caught_up" in ev for _, ev in ps.values()),
                               600, interval=0.05)
            plans = {r: moved[r] for r in victims}
            entries = bench.ranks()
            first = min((p for p, _ in plans.values()), key=lambda p: p.started_at or 1e18)
            started = first.started_at or first.created_at
            detected = first.detected_at or crashed
            restored = [ev["restored"] for _, ev in plans.values() if "restored" in ev]
            caught = [ev["caught_up"] for _, ev in plans.values()]
            running = [ev.get("running", ev["caught_up"]) for _, ev in plans.values()]
            launched = [ev["launched"] for _, ev in plans.values() if "launched" in ev]
            last_restore = max((e.at for e in restored), default=max(e.at for e in running))
            last_running = max(e.at for e in running)
            speed = _speed(bench, program, victims, crashed)
            return {"program": program, **speed,
                "state_bytes": state, "ranks_per_node": ranks_per_node,
                "checkpoint_interval_s": checkpoint_sec,
                "crash_after_commit_s": round(crashed - committed_at, 3),
                "moved_bytes": state * len(victims), "ranks": victims, "crashed_node": node,
                "targets": sorted({p.target for p, _ in plans.values()}),
                "detection_interval_sec": cfg.detection.kernel_heartbeat_interval_sec,
                "detect_s": round(detected - crashed, 3),
                "plan_s": round(started - detected, 3),
                "launch_s": round(max(e.at for e in launched) - started, 3)
                if launched else None,
                "restore_s": round(last_restore - started, 3),
                # restored -> running again (replay served, the first step done), then
                # running again -> caught up (the lost steps redone)
                "replay_s": round(last_running - last_restore, 3),
                "reexecute_s": round(max(e.at for e in caught) - last_running, 3),
                "running_s": round(last_running - crashed, 3),
                "caught_up_s": round(max(e.at for e in caught) - crashed, 3),
                "total_s": round(max(e.at for e in caught) - crashed, 3),
                "bytes_pulled": sum(int(e.detail.get("bytes_pulled", 0)) for e in restored),
                # each moved rank, in seconds after the plan started: its restore asked
                # of the spare's agent and done (the agent runs a few at once: chunks
                # pulled, then decoded and checked), its first step, its pre-fault progress
                "per_rank": [{**_phases(r, ev, started), "newest_generation": newest[r]}
                             for r, (_, ev) in sorted(plans.items())],
                "generations": sorted({e.detail.get("generation") for e in restored},
                                      key=str),
                "replayed_messages": sum(int(e.detail.get("replayed", 0)) for e in caught),
                "received_messages": sum(int(e.detail.get("received", 0)) for e in caught),
                "step_sec": RECOVERY_STEP_SEC if program != "compute" else None,
                "checkpoint_every_steps": int(args[3]) if program == "heat_ring" else None,
                "messages_per_step_per_rank": HALO_MESSAGES_PER_STEP,
                "healthy_ranks_restarted": sum(1 for r, (_, epoch) in entries.items()
                                               if r not in victims and epoch > 1),
            }
        finally:
            bench.cancel()
            restart_node(cluster, node)
    finally:
        bench.cancel()
        store.close()


def _speed(bench: JobBench, program: str, victims: list[int], crashed: float
           ) -> dict[str, Any]:
    """jacobi_prog's re-execution figures of the moved ranks (the slowest rank's at the
    top, ``reexec`` per rank); nothing for heat_ring, which prints no step times."""
    if program == "heat_ring":
        return {}
    found = wait_until("the moved ranks' steps in the job's output", lambda: [
        reexecution(bench.out.read_text() if bench.out.exists() else "", r, crashed)
        for r in victims], lambda xs: all(x is not None for x in xs), 30, interval=0.2)
    got = [x for x in found if x is not None]
    slowest = min(got, key=lambda x: (x["replay_speed"] is None, x["replay_speed"] or 0))
    keys = ("failure_free_step_s", "failure_free_step_cpu_s", "reexec_steps", "reexec_s",
            "reexec_cpu_s", "replay_speed", "replay_speed_cpu", "replay_speed_core")
    return {**{k: slowest[k] for k in keys}, "reexec": got}


def _phases(rank: int, events: dict[str, PlanEvent], started: float) -> dict[str, Any]:
    """One moved rank's phases (``measure_recovery``'s ``per_rank``)."""
    out: dict[str, Any] = {"rank": rank}
    restored = events.get("restored")
    if restored is not None:
        out["asked_s"] = round(float(restored.detail.get("asked_at", restored.at)) - started, 3)
        out["restored_s"] = round(restored.at - started, 3)
        out["pull_s"] = round(float(restored.detail.get("pull_s", 0.0)), 3)
        out["local_s"] = round(float(restored.detail.get("local_s", 0.0)), 3)
        out["generation"] = restored.detail.get("generation")
        out["early"] = bool(restored.detail.get("early", False))
    for phase in ("running", "caught_up"):
        if phase in events:
            out[f"{phase}_s"] = round(events[phase].at - started, 3)
    return out


def measure_run(cluster: LocalCluster, name: str, sbatch: list[str], steps: int,
                step_sec: float, crash: bool = True, stop_resumed: bool = False
                ) -> dict[str, Any]:
    """Run heat_ring with one node crash after two committed checkpoints of the last rank
    (none with ``crash=False``); wall time from the job's start to its end, and the
    useful-work fraction. A run the leader escalates also gets ``requeue``: its phases
    (``requeue_phases``); ``stop_resumed`` cancels it once every rank resumed, which is
    all a calibration run needs."""
    cfg = load_file(cluster.config_path)
    store, keys = open_store(cfg.store)
    heat = ["--steps", str(steps), "--every", str(RECOVERY_EVERY), "--step-sec", str(step_sec)]
    bench = JobBench(cluster, store, keys, name, sbatch, heat)
    node = ""
    crashed: float | None = None
    try:
        wait_until(f"job {bench.job} running", bench.state, lambda s: s == "RUNNING", 120,
                   interval=0.05)
        started = time.time()
        size = 0
        if crash:
            rank, node = bench.victim()
            size = len(bench.ranks())
            wait_until(f"rank {rank} committed twice", lambda: bench.committed(rank),
                       lambda n: n >= 2, 300, interval=0.05)
            crashed = time.time()
            cluster.crash(node)
        escalation, resumed = _follow(bench, size, stop_resumed) if crash \
            else (None, None)
        final = bench.wait_final(600) if not (stop_resumed and resumed) else "RESUMED"
        ended = time.time()
        text = bench.out.read_text() if bench.out.exists() else ""
        useful = steps * step_sec
        out: dict[str, Any] = {
            "state": final, "wall_s": round(ended - started, 2),
            "crash_after_s": None if crashed is None else round(crashed - started, 2),
            "useful_s": round(useful, 2),
            "useful_fraction": round(useful / (ended - started), 3),
            "ranks_restarted": text.count(" started on ") - 4,
            "result": next((x for x in text.splitlines() if x.startswith("final ")), None)}
        if crashed is not None and escalation is not None:
            out["requeue"] = requeue_phases(crashed, escalation, resumed, text)
        return out
    finally:
        bench.cancel()
        if node:
            restart_node(cluster, node)
        store.close()


def _follow(bench: JobBench, size: int, stop_resumed: bool
            ) -> tuple[dict[str, Any] | None, float | None]:
    """Until the job ends (or, with ``stop_resumed``, every rank resumed): the leader's
    escalation record, once it says requeued, and when the ``size``-th rank of the
    requeued run printed that it resumed (restored, before its first step)."""
    escalation: dict[str, Any] | None = None
    resumed: float | None = None
    while bench.state() not in FINAL:
        if escalation is None:
            kv = bench.store.get(bench.keys.job_escalation(bench.job))
            rec = json.loads(kv.value) if kv is not None else None
            if rec and rec.get("requeued_at") is not None:
                escalation = rec
        if escalation is not None and resumed is None and bench.out.exists() \
                and bench.out.read_text().count(" resumed at step ") >= size:
            resumed = time.time()
            if stop_resumed:
                break
        time.sleep(0.05)
    return escalation, resumed


def requeue_phases(crashed: float, escalation: dict[str, Any], resumed: float | None,
                   text: str) -> dict[str, Any]:
    """A requeued run's phases in seconds: ``detect_s`` crash -> the leader's escalation
    (detection and the plan that found no spare); ``requeued_s`` / ``released_s``
    escalation -> the job requeued in Slurm / released after Slurm's requeue delay;
    ``relaunch_s`` escalation -> every rank of the requeued run restored (what the
    simulator's requeue costs: ``cluster.queue_wait_s`` + ``job.reinit_s`` + restore);
    ``resumed_steps``: the steps each rank resumed at (its newest checkpoint)."""
    at = float(escalation["at"])

    def since(key: str) -> float | None:
        v = escalation.get(key)
        return None if v is None else round(float(v) - at, 3)

    steps = sorted({int(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                    if " resumed at step " in x and x.rsplit(" ", 1)[1].isdigit()})
    return {"reason": escalation.get("reason"), "detect_s": round(at - crashed, 3),
            "requeued_s": since("requeued_at"), "released_s": since("released_at"),
            "relaunch_s": None if resumed is None else round(resumed - at, 3),
            "resumed_steps": steps}


def run_recovery(state: int, interval: float, port: int, ranks_per_node: int = 1,
                 runs: int = 5, checkpoint_sec: int = 1, seed: int = 1,
                 quiet: bool = True, program: str = "heat_ring") -> dict[str, Any]:
    """Bring up the cluster and a coordinator; ``runs`` times, crash the node whose ranks
    hold ``state`` bytes each at a drawn point of the checkpoint interval and bring it
    back; take it all down; the JSON object of ``bench recovery`` (progress lines on
    stderr unless ``quiet``)."""
    points = crash_points(seed, runs, checkpoint_sec)
    rows: list[dict[str, Any]] = []
    with private_cluster("raps-bench-rec-", port, interval, quiet=True) as cluster:
        coordinator = cluster.coordinator("bench").start()
        store, keys = open_store(load_file(cluster.config_path).store)
        try:
            for i, point in enumerate(points):
                row = measure_recovery(cluster, state, 100000, ranks_per_node,
                                       checkpoint_sec, point, f"recovery-{i}", program)
                rows.append(row)
                if not quiet:
                    print(f"run {i + 1}: crash {row['crash_after_commit_s']}s after a commit, "
                          f"caught up after {row['total_s']}s (running after "
                          f"{row['running_s']}s)", file=sys.stderr, flush=True)
                back_in_service(cluster, store, keys, row["crashed_node"])
        except AssertionError as exc:  # a wait that timed out: one line, not a traceback
            raise BenchError(f"bench recovery: run {len(rows) + 1}: {exc}") from None
        finally:
            store.close()
            coordinator.stop()
    result = summarize(rows, checkpoint_sec, seed)
    result["background_at_defaults"] = [f"{s}.{k}" for s, k in QUIET]
    return result


def run_efficiency(steps: int, step_sec: float, interval: float, port: int) -> dict[str, Any]:
    """The same failure recovered by raps-slurm (2 spares) and by a whole-job restart
    (no spare), and the raps job without a failure (the machine's own pace: start-up,
    checkpoints, slower steps on a loaded machine); the runs and whether they computed the
    same result."""
    with private_cluster("raps-bench-eff-", port, interval) as cluster:
        coordinator = cluster.coordinator("bench").start()
        store, keys = open_store(load_file(cluster.config_path).store)

        def measure(name: str, sbatch: list[str], **kw: Any) -> dict[str, Any]:
            row = measure_run(cluster, name, sbatch, steps, step_sec, **kw)
            back_in_service(cluster, store, keys, *cluster.node_names)  # the next run's nodes
            return row

        try:
            raps = measure("raps", ["--raps-spares=2", "-N6"])
            # the requeue's relaunch measured on a run of its own (stopped once resumed),
            # so that validating the whole-job restart does not use its own figures
            calib = measure("requeue-calibration", ["--raps-spares=0", "-N4"],
                            stop_resumed=True)
            whole = measure("restart", ["--raps-spares=0", "-N4"])
            free = measure("free", ["--raps-spares=2", "-N6"], crash=False)
        finally:
            store.close()
            coordinator.stop()
    return {"steps": steps, "step_sec": step_sec, "checkpoint_every_steps": RECOVERY_EVERY,
            "raps": raps, "whole_job_restart": whole, "failure_free": free,
            "requeue_calibration": calib.get("requeue"),
            "same_result": raps["result"] == whole["result"] == free["result"] is not None}
