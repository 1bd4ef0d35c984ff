"""``rapsctl bench``: measurements on a real local cluster, printed as one JSON object.

``bench detect`` brings up its own 6-node cluster (scripts/cluster.sh, ports from
``--port``, run dir in /tmp), a coordinator and an agent per node, then crashes a node
(cgroup kill: its slurmd, step daemons and agent at once) ``--runs`` times. For each
crash it measures, from the same instant, the time until raps-slurm's DEAD verdict is
in etcd and until Slurm itself shows the node DOWN (the test cluster's
``SlurmdTimeout=10``; Slurm's default is 300 s). Detection runs with the production
defaults (1 s heartbeats, 3 strikes, 0.5 s fence margin) unless ``--interval`` says
otherwise. The cluster is taken down at the end.

``bench loss`` runs the same kind of cluster with every agent dropping a share of its
heartbeats (``--heartbeat-loss``) and delaying the rest (``--heartbeat-jitter``), and
one fake rank per node; for ``--minutes`` nothing is crashed, so every DEAD verdict and
every rank that stops by itself is false. ``bench heartbeats`` (bench_load.py) loads one
coordinator with N synthetic nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import yaml

from raps_slurm.cli.bench_churn import bench_churn
from raps_slurm.cli.bench_ckpt import bench_checkpoint
from raps_slurm.cli.bench_load import VerdictWatch, bench_heartbeats
from raps_slurm.cli.bench_msg import bench_messaging
from raps_slurm.cli.bench_recovery import bench_efficiency, bench_recovery
from raps_slurm.cli.bench_sim import bench_simulate
from raps_slurm.config import load_file, node_dir
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until

REPO = Path(__file__).resolve().parents[2]


@click.group()
def bench() -> None:
    """Benchmarks that print one JSON object (they are commands, not tests)."""


bench.add_command(bench_heartbeats)
bench.add_command(bench_checkpoint)
bench.add_command(bench_messaging)
bench.add_command(bench_recovery)
bench.add_command(bench_efficiency)
bench.add_command(bench_simulate)
bench.add_command(bench_churn)


def _profile(directory: Path, interval: float) -> Path:
    """configs/test.yaml with detection at ``interval`` and the default strikes and margin."""
    data = yaml.safe_load((REPO / "configs" / "test.yaml").read_text())
    data["detection"] = {"kernel_heartbeat_interval_sec": interval, "miss_threshold": 3,
                         "fence_margin_sec": 0.5,
                         "lease_duration_sec": max(15.0, 5 * interval)}
    path = directory / "bench-profile.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@contextmanager
def _private_cluster(prefix: str, port: int, interval: float,
                     extra_env: dict[str, str] | None = None) -> Iterator[LocalCluster]:
    """A 6-node cluster in a fresh run dir, detection at ``interval``; always taken down."""
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    run_dir.chmod(0o755)  # slurmctld runs as SlurmUser
    cluster = LocalCluster(run_dir, port_base=port, profile=_profile(run_dir, interval))
    try:
        cluster.up(extra_env=extra_env)
        yield cluster
    finally:
        cluster.down()
        shutil.rmtree(run_dir, ignore_errors=True)


@bench.command("detect")
@click.option("--runs", default=5, show_default=True, type=click.IntRange(1, 100),
              help="Node crashes to measure.")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.05, 10),
              help="Kernel heartbeat interval (seconds).")
@click.option("--port", default=19000, show_default=True, type=click.IntRange(1024, 60000),
              help="Base port of the benchmark cluster.")
@click.option("--json", "as_json", is_flag=True, help="JSON only (the default prints it too).")
def bench_detect(runs: int, interval: float, port: int, as_json: bool) -> None:
    """Crash nodes; time raps-slurm's DEAD verdict and Slurm's DOWN side by side."""
    with _private_cluster("raps-bench-", port, interval) as cluster:
        result = _measure(cluster, runs, interval, as_json)
    click.echo(json.dumps(result))


class _Crasher:
    """Crashes one node and times the DEAD verdict and Slurm's DOWN from the same instant."""

    def __init__(self, cluster: LocalCluster, store: StateStore, keys: Keys, bound: float) -> None:
        self.cluster, self.store, self.keys, self.bound = cluster, store, keys, bound
        self.slurm = cluster.slurm()
        self.run = CommandRunner(timeout=30, env=cluster.env)

    def verdict(self, node: str) -> tuple[int, str, float]:
        kv = self.store.get(self.keys.node_verdict(node))
        if kv is None:
            return 0, "", 0.0
        value = json.loads(kv.value)
        return kv.mod_revision, str(value["kind"]), float(value["at"])

    def crash(self, node: str) -> tuple[float, float]:
        before = self.verdict(node)[0]
        crashed = time.time()
        self.cluster.crash(node)
        _, _, at = wait_until(f"DEAD verdict for {node}", lambda: self.verdict(node),
                              lambda v: v[0] > before and v[1] == "DEAD",
                              timeout=self.bound + 30, interval=0.02)
        wait_until(f"Slurm to mark {node} DOWN", lambda: self.slurm.node(node).state_text,
                   lambda st: "DOWN" in st, timeout=400, interval=0.2)
        down = time.time() - crashed
        self.cluster.restart(node)
        self.run.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        wait_until(f"{node} back", lambda: self.verdict(node), lambda v: v[1] == "ALIVE",
                   timeout=60)
        return at - crashed, down


def _measure(cluster: LocalCluster, runs: int, interval: float, quiet: bool) -> dict[str, Any]:
    cfg = load_file(cluster.config_path)
    d = cfg.detection
    window = d.kernel_heartbeat_interval_sec * d.miss_threshold + d.fence_margin_sec
    bound = window + d.kernel_heartbeat_interval_sec
    store, keys = open_store(cfg.store)
    coordinator = cluster.coordinator("bench").start()
    detect: list[float] = []
    slurm_down: list[float] = []
    try:
        wait_until("the coordinator to lead", lambda: store.get(keys.leader()),
                   lambda kv: kv is not None, timeout=30)
        started = time.monotonic()  # a new leader gives no verdict within its grace
        wait_until("the leader's grace", time.monotonic, lambda t: t - started > window + 2,
                   timeout=window + 10)
        crasher = _Crasher(cluster, store, keys, bound)
        for i in range(runs):
            node = cluster.node_names[i % len(cluster.node_names)]
            dead, down = crasher.crash(node)
            detect.append(dead)
            slurm_down.append(down)
            if not quiet:
                print(f"run {i + 1}: {node} DEAD after {dead:.2f}s, Slurm DOWN after "
                      f"{down:.1f}s", file=sys.stderr)
    finally:
        coordinator.stop()
        store.close()
    return {"benchmark": "detect", "runs": runs, "interval_s": interval,
            "miss_threshold": d.miss_threshold, "fence_margin_s": d.fence_margin_sec,
            "detect_p50_s": round(statistics.median(detect), 3),
            "detect_max_s": round(max(detect), 3), "bound_s": round(bound, 3),
            "slurm_down_p50_s": round(statistics.median(slurm_down), 2),
            "slurmd_timeout_s": 10, "slurm_default_slurmd_timeout_s": 300,
            "detect_s": [round(x, 3) for x in detect]}


@bench.command("loss")
@click.option("--minutes", default=10.0, show_default=True, type=click.FloatRange(0.5, 1440),
              help="How long to watch for false verdicts and fences.")
@click.option("--loss", default=0.3, show_default=True, type=click.FloatRange(0, 0.95),
              help="Share of heartbeats every agent drops (--heartbeat-loss).")
@click.option("--jitter", default=0.3, show_default=True, type=click.FloatRange(0, 5),
              help="Each heartbeat delayed by up to this many seconds (--heartbeat-jitter).")
@click.option("--port", default=19700, show_default=True, type=click.IntRange(1024, 60000),
              help="Base port of the benchmark cluster.")
@click.option("--json", "as_json", is_flag=True, help="JSON only (the default prints it too).")
def bench_loss(minutes: float, loss: float, jitter: float, port: int, as_json: bool) -> None:
    """Lossy, jittery heartbeats and no crash: count false DEAD verdicts and false fences."""
    knobs = {"RAPS_AGENT_ARGS": f"--heartbeat-loss {loss} --heartbeat-jitter {jitter}"}
    with _private_cluster("raps-bench-loss-", port, 1.0, knobs) as cluster:
        result = _measure_loss(cluster, minutes, loss, jitter, as_json)
    click.echo(json.dumps(result))


def _agent_args(cluster: LocalCluster) -> list[str]:
    """The knob options of the first node's running agent (from its command line)."""
    pid = (cluster.run_dir / "pids" / f"agent-{cluster.node_names[0]}.pid").read_text().strip()
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return [a for i, a in enumerate(argv) if a.startswith("--heartbeat-")
            or (i > 0 and argv[i - 1].startswith("--heartbeat-"))]


def _registered(log: Path, proc: subprocess.Popen[bytes]) -> None:
    """Wait until a fake rank says it registered with its agent."""
    text = wait_until(f"{log.stem} to register", lambda: log.read_text(errors="replace"),
                      lambda t: "registered" in t or proc.poll() is not None, timeout=20)
    if proc.poll() is not None:
        raise click.ClickException(f"{log.stem} did not start: {text.strip()}")


def _measure_loss(cluster: LocalCluster, minutes: float, loss: float, jitter: float,
                  quiet: bool) -> dict[str, Any]:
    cfg = load_file(cluster.config_path)
    d = cfg.detection
    window = d.kernel_heartbeat_interval_sec * d.miss_threshold + d.fence_margin_sec
    store, keys = open_store(cfg.store)
    watch = VerdictWatch(store, keys)
    coordinator = cluster.coordinator("bench").start()
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        wait_until("the coordinator to lead", lambda: store.get(keys.leader()),
                   lambda kv: kv is not None, timeout=30)
        time.sleep(window + 2)  # the agents have found the leader; its grace is over
        job = "700001"
        for rank, node in enumerate(cluster.node_names):
            with open(cluster.run_dir / "log" / f"rank-{rank}.log", "wb") as out:
                ranks.append(subprocess.Popen(
                    [sys.executable, "-m", "raps_slurm.runtime.agent_client", "--socket",
                     node_dir(cfg.agent.socket_path, node), "--job", job, "--rank", str(rank),
                     "--interval", "1"], stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL))
        for rank in range(len(ranks)):
            _registered(cluster.run_dir / "log" / f"rank-{rank}.log", ranks[rank])
        started = time.time()
        agent_args = _agent_args(cluster)
        end = started + minutes * 60
        while time.time() < end:
            time.sleep(min(30.0, max(0.0, end - time.time())))
            if not quiet:
                gone = sum(r.poll() is not None for r in ranks)
                print(f"{(time.time() - started) / 60:.1f} min: {len(watch.dead(started))} "
                      f"DEAD verdicts, {gone} ranks stopped", file=sys.stderr, flush=True)
        wall = time.time() - started
        codes = [r.poll() for r in ranks]
        log = coordinator.log()
    finally:
        for r in ranks:
            if r.poll() is None:
                os.kill(r.pid, signal.SIGKILL)
            r.wait(10)
        coordinator.stop()
        watch.close()
        store.close()
    nodes = len(cluster.node_names)
    fenced = [c for c in codes if c is not None]
    return {"benchmark": "loss", "minutes": round(wall / 60, 2), "loss": loss,
            "jitter_s": jitter, "nodes": nodes, "interval_s": d.kernel_heartbeat_interval_sec,
            "miss_threshold": d.miss_threshold, "fence_margin_s": d.fence_margin_sec,
            "node_minutes": round(nodes * wall / 60, 1),
            "false_verdicts": len(watch.dead(started)),
            "alive_verdicts": watch.count("ALIVE", started),
            "hung_verdict_lines": log.count("verdict: HUNG"),
            "ranks": len(ranks), "false_fences": len(fenced),
            "fence_exit_codes": sorted(fenced),  # 75: fenced itself; -9: killed by its agent
            "agent_knobs": agent_args,  # as the agents run: proof the knobs are on
            "knob_drops": "heartbeats and their resends only (not probe answers, acks, probes)"}
