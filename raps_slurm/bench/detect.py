"""``rapsctl bench detect``: node crashes on a private 6-node cluster (``bench.cluster``),
a coordinator and an agent per node; each crash (cgroup kill: its slurmd, step daemons
and agent at once) is timed, from the same instant, until raps-slurm's DEAD verdict is
in etcd and until Slurm itself shows the node DOWN (after the cluster's
``SlurmdTimeout``, read from ``scontrol show config``: 10 s on the test cluster; Slurm's
default is 300 s)."""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from typing import Any

from raps_slurm.bench.cluster import private_cluster
from raps_slurm.config import load_file
from raps_slurm.errors import BenchError
from raps_slurm.slurm import CommandRunner, commands, parsers
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until


def slurmd_timeout_s(config: dict[str, str]) -> int:
    """``SlurmdTimeout`` in seconds from ``scontrol show config``'s pairs
    (``SlurmdTimeout = 10 sec``); BenchError in one line if it is missing or not that."""
    value = config.get("SlurmdTimeout")
    m = re.fullmatch(r"(\d+)(?: sec)?", value or "")
    if m is None:
        raise BenchError(f"bench detect: scontrol show config gives SlurmdTimeout {value!r}, "
                         f"not seconds")
    return int(m.group(1))


class Crasher:
    """Crashes one node and times the DEAD verdict and Slurm's DOWN from the same instant."""

    def __init__(self, cluster: LocalCluster, store: StateStore, keys: Keys, bound: float) -> None:
        self.cluster, self.store, self.keys, self.bound = cluster, store, keys, bound
        self.slurm = cluster.slurm()
        self.run = CommandRunner(timeout=30, env=cluster.env)

    def verdict(self, node: str) -> tuple[int, str, float]:
        """(mod revision, kind, at) of the node's verdict; zeros when there is none."""
        kv = self.store.get(self.keys.node_verdict(node))
        if kv is None:
            return 0, "", 0.0
        value = json.loads(kv.value)
        return kv.mod_revision, str(value["kind"]), float(value["at"])

    def crash(self, node: str) -> tuple[float, float]:
        """Crash ``node``; seconds to its DEAD verdict and to Slurm's DOWN; bring it back."""
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
        self.run.run(commands.resume([node]))
        wait_until(f"{node} back", lambda: self.verdict(node), lambda v: v[1] == "ALIVE",
                   timeout=60)
        return at - crashed, down


def run_detect(runs: int, interval: float, port: int, quiet: bool) -> dict[str, Any]:
    """Bring up the cluster, crash ``runs`` nodes in turn, take it down; the JSON object."""
    with private_cluster("raps-bench-", port, interval) as cluster:
        return measure(cluster, runs, interval, quiet)


def measure(cluster: LocalCluster, runs: int, interval: float, quiet: bool) -> dict[str, Any]:
    """The crashes on a running cluster (progress lines on stderr unless ``quiet``)."""
    cfg = load_file(cluster.config_path)
    d = cfg.detection
    window = d.kernel_heartbeat_interval_sec * d.miss_threshold + d.fence_margin_sec
    bound = window + d.kernel_heartbeat_interval_sec
    timeout = slurmd_timeout_s(parsers.parse_show_config(
        CommandRunner(timeout=30, env=cluster.env).run(commands.scontrol_show_config())))
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
        crasher = Crasher(cluster, store, keys, bound)
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
            "slurmd_timeout_s": timeout, "slurm_default_slurmd_timeout_s": 300,
            "detect_s": [round(x, 3) for x in detect]}
