"""``rapsctl bench``: measurements on a real local cluster, printed as one JSON object.

``bench detect`` brings up its own 6-node cluster (scripts/cluster.sh, ports from
``--port``, run dir in /tmp), a coordinator and an agent per node, then crashes a node
(cgroup kill: its slurmd, step daemons and agent at once) ``--runs`` times. For each
crash it measures, from the same instant, the time until raps-slurm's DEAD verdict is
in etcd and until Slurm itself shows the node DOWN (the test cluster's
``SlurmdTimeout=10``; Slurm's default is 300 s). Detection runs with the production
defaults (1 s heartbeats, 3 strikes, 0.5 s fence margin) unless ``--interval`` says
otherwise. The cluster is taken down at the end.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import yaml

from raps_slurm.cli.bench_load import bench_heartbeats
from raps_slurm.config import load_file
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until

REPO = Path(__file__).resolve().parents[2]


@click.group()
def bench() -> None:
    """Benchmarks that print one JSON object (they are commands, not tests)."""


bench.add_command(bench_heartbeats)


def _profile(directory: Path, interval: float) -> Path:
    """configs/test.yaml with detection at ``interval`` and the default strikes and margin."""
    data = yaml.safe_load((REPO / "configs" / "test.yaml").read_text())
    data["detection"] = {"kernel_heartbeat_interval_sec": interval, "miss_threshold": 3,
                         "fence_margin_sec": 0.5,
                         "lease_duration_sec": max(15.0, 5 * interval)}
    path = directory / "bench-profile.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


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
    run_dir = Path(tempfile.mkdtemp(prefix="raps-bench-"))
    run_dir.chmod(0o755)
    cluster = LocalCluster(run_dir, port_base=port, profile=_profile(run_dir, interval))
    try:
        cluster.up()
        result = _measure(cluster, runs, interval, as_json)
    finally:
        cluster.down()
        shutil.rmtree(run_dir, ignore_errors=True)
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
