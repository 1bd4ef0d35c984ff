"""``rapsctl bench recovery`` and ``rapsctl bench efficiency``: a node crash in a real
``--raps`` job on a private local cluster (brought up for the command, taken down after).

``recovery``: ``examples/heat_ring.py`` under ``raps-run`` over 4 ranks with 2 spares; the
last rank carries ``--state`` bytes of extra state (random, so nothing compresses). Right
after that rank's newest checkpoint is committed on its whole group, its node is crashed
(cgroup kill). ``total_s`` runs from the crash to the relaunched rank's first progress
report after its replay ended; the phases come from the plan's timeline.

``efficiency``: the same application and the same failure twice in one command: once
recovered by raps-slurm (spares), once by a whole-job restart from each rank's last
checkpoint (no spare: the leader requeues the job, which is what ``--requeue`` gives,
here with raps-slurm's fast detection and an immediate restart, so the comparison
flatters the restart). Useful work is ``steps x step_sec`` (the program's compute);
the fraction is that over the wall time from the job's start to its end.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from raps_slurm.cli.bench_ckpt import parse_size
from raps_slurm.config import load_file
from raps_slurm.core.planner import Plan, PlanEvent
from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm import CommandRunner, commands
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until

REPO = Path(__file__).resolve().parents[2]
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


class JobBench:
    """One ``--raps`` heat_ring job on the bench cluster and the etcd keys about it."""

    def __init__(self, cluster: LocalCluster, store: StateStore, keys: Keys, name: str,
                 sbatch: list[str], heat: list[str]) -> None:
        self.cluster, self.store, self.keys = cluster, store, keys
        self.run = CommandRunner(timeout=60, env=cluster.env)
        out = cluster.run_dir / "bench-jobs"
        out.mkdir(exist_ok=True)
        out.chmod(0o777)
        script = out / f"{name}.sh"
        bindir = Path(sys.executable).parent
        script.write_text("#!/bin/bash\n"
                          f"exec {bindir / 'raps-run'} -- {sys.executable} "
                          f"{REPO / 'examples' / 'heat_ring.py'} {' '.join(heat)}\n")
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

    def after_next_commit(self, rank: int) -> None:
        """Return as soon as a generation newer than the newest committed one is committed
        on the rank's whole group (the crash then comes right after a checkpoint)."""
        wait_until(f"rank {rank}'s state committed on its group", lambda: self.committed(rank),
                   lambda n: n >= 2, 600, interval=0.05)
        newest = self.committed_gens(rank)[-1]
        wait_until(f"rank {rank}'s next committed generation", lambda: self.committed_gens(rank),
                   lambda g: bool(g) and g[-1] > newest, 120, interval=0.01)

    def victim(self) -> tuple[int, str]:
        """The last rank, which must not share the batch script's node."""
        ranks = self.ranks()
        host = wait_until("the batch host",
                          lambda: self.cluster.slurm().job(int(self.job)).batch_host, bool, 30)
        rank = max(ranks)
        if ranks[rank][0] == host:
            raise click.ClickException(f"rank {rank} shares the batch host {host}")
        return rank, ranks[rank][0]

    def plan(self) -> tuple[Plan | None, dict[str, PlanEvent]]:
        prefix = self.keys.plans_prefix()
        plan, events = None, {}
        for kv in self.store.get_prefix(self.keys.job_plans_prefix(self.job)):
            rest = kv.key[len(prefix):]
            if "/" in rest:
                e = PlanEvent.from_json(kv.key, kv.value)
                events[e.phase] = e
            else:
                plan = Plan.from_json(kv.key, kv.value)
        return plan, events

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


def measure_recovery(cluster: LocalCluster, state: int, steps: int) -> dict[str, Any]:
    """One crash of the rank carrying ``state`` bytes; the phases of its recovery."""
    cfg = load_file(cluster.config_path)
    store, keys = open_store(cfg.store)
    heat = ["--steps", str(steps), "--every", "20", "--step-sec", "0.05",
            "--ballast-mb", str(max(1, state >> 20))]
    bench = JobBench(cluster, store, keys, "recovery", ["--raps-spares=2", "-N6"], heat)
    try:
        rank, node = bench.victim()
        bench.after_next_commit(rank)
        crashed = time.time()
        cluster.crash(node)
        try:
            plan, events = wait_until("the relaunched rank running again", bench.plan,
                                      lambda pe: "running" in pe[1], 300, interval=0.05)
            assert plan is not None
            entries = bench.ranks()
            restored, running = events.get("restored"), events["running"]
            return {
                "state_bytes": state, "rank": rank, "crashed_node": node,
                "target": plan.target, "detection_interval_sec":
                    cfg.detection.kernel_heartbeat_interval_sec,
                "detect_s": round((plan.detected_at or crashed) - crashed, 3),
                "plan_s": round((plan.started_at or plan.created_at)
                                - (plan.detected_at or crashed), 3),
                "restore_s": round((restored.at if restored else running.at)
                                   - (plan.started_at or plan.created_at), 3),
                "launch_s": round(events["launched"].at - (plan.started_at or plan.created_at),
                                  3) if "launched" in events else None,
                "replay_s": round(running.at - (restored.at if restored else running.at), 3),
                "total_s": round(running.at - crashed, 3),
                "bytes_pulled": int(restored.detail.get("bytes_pulled", 0)) if restored else 0,
                "generation": restored.detail.get("generation") if restored else None,
                "agent_pull_s": restored.detail.get("pull_s") if restored else None,
                "agent_decode_s": restored.detail.get("local_s") if restored else None,
                "rank_start_s": round(float(restored.detail["asked_at"])
                                      - (plan.started_at or plan.created_at), 3)
                if restored and "asked_at" in restored.detail else None,
                "replayed_messages": int(running.detail.get("replayed", 0)),
                "healthy_ranks_restarted": sum(1 for r, (_, epoch) in entries.items()
                                               if r != rank and epoch > 1),
            }
        finally:
            bench.cancel()
            restart_node(cluster, node)
    finally:
        bench.cancel()
        store.close()


def measure_run(cluster: LocalCluster, name: str, sbatch: list[str], steps: int,
                step_sec: float) -> dict[str, Any]:
    """Run heat_ring with one node crash after two committed checkpoints of the last rank;
    wall time from the job's start to its end, and the useful-work fraction."""
    cfg = load_file(cluster.config_path)
    store, keys = open_store(cfg.store)
    heat = ["--steps", str(steps), "--every", "20", "--step-sec", str(step_sec)]
    bench = JobBench(cluster, store, keys, name, sbatch, heat)
    node = ""
    try:
        wait_until(f"job {bench.job} running", bench.state, lambda s: s == "RUNNING", 120,
                   interval=0.05)
        started = time.time()
        rank, node = bench.victim()
        wait_until(f"rank {rank} committed twice", lambda: bench.committed(rank),
                   lambda n: n >= 2, 300, interval=0.05)
        crashed = time.time()
        cluster.crash(node)
        final = bench.wait_final(600)
        ended = time.time()
        text = bench.out.read_text() if bench.out.exists() else ""
        useful = steps * step_sec
        return {"state": final, "wall_s": round(ended - started, 2),
                "crash_after_s": round(crashed - started, 2), "useful_s": round(useful, 2),
                "useful_fraction": round(useful / (ended - started), 3),
                "ranks_restarted": text.count(" started on ") - 4,
                "result": next((x for x in text.splitlines() if x.startswith("final ")), None)}
    finally:
        bench.cancel()
        if node:
            restart_node(cluster, node)
        store.close()


@click.command("recovery")
@click.option("--state", "state_text", default="1GiB", show_default=True,
              help="Extra state of the crashed rank (e.g. 256MiB, 1GiB).")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.05, 10),
              help="Kernel heartbeat interval (seconds); 3 misses + 0.5 s make a DEAD verdict.")
@click.option("--port", default=19200, show_default=True, type=click.IntRange(1024, 60000),
              help="Base port of the benchmark cluster.")
@click.option("--json", "as_json", is_flag=True, help="JSON only (the default prints it too).")
def bench_recovery(state_text: str, interval: float, port: int, as_json: bool) -> None:
    """Crash the node of a rank holding --state bytes; time each phase of its recovery."""
    from raps_slurm.cli.bench import _private_cluster

    try:
        state = parse_size(state_text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--state") from None
    with _private_cluster("raps-bench-rec-", port, interval) as cluster:
        coordinator = cluster.coordinator("bench").start()
        try:
            result = measure_recovery(cluster, state, steps=100000)
        finally:
            coordinator.stop()
    click.echo(json.dumps(result))


@click.command("efficiency")
@click.option("--steps", default=400, show_default=True, type=click.IntRange(100, 100000),
              help="Steps of the application (each --step-sec of work).")
@click.option("--step-sec", default=0.05, show_default=True, type=click.FloatRange(0.001, 10))
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.05, 10),
              help="Kernel heartbeat interval (seconds).")
@click.option("--port", default=19300, show_default=True, type=click.IntRange(1024, 60000),
              help="Base port of the benchmark cluster.")
@click.option("--json", "as_json", is_flag=True, help="JSON only (the default prints it too).")
def bench_efficiency(steps: int, step_sec: float, interval: float, port: int,
                     as_json: bool) -> None:
    """The same failure, recovered by raps-slurm and by a whole-job restart: useful work."""
    from raps_slurm.cli.bench import _private_cluster

    with _private_cluster("raps-bench-eff-", port, interval) as cluster:
        coordinator = cluster.coordinator("bench").start()
        try:
            raps = measure_run(cluster, "raps", ["--raps-spares=2", "-N6"], steps, step_sec)
            whole = measure_run(cluster, "restart", ["--raps-spares=0", "-N4"], steps, step_sec)
        finally:
            coordinator.stop()
    click.echo(json.dumps({"steps": steps, "step_sec": step_sec, "raps": raps,
                           "whole_job_restart": whole,
                           "same_result": raps["result"] == whole["result"] is not None}))
