"""``rapsctl bench loss``: a private 6-node cluster (``bench.cluster``) whose agents all
drop a share of their heartbeats (``--heartbeat-loss``) and delay the rest
(``--heartbeat-jitter``), with one fake rank per node; for the whole run nothing is
crashed, so every DEAD verdict and every rank that stops by itself is false."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from raps_slurm.bench.cluster import private_cluster
from raps_slurm.bench.heartbeats import VerdictWatch
from raps_slurm.config import load_file, node_dir
from raps_slurm.errors import BenchError
from raps_slurm.store import open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until


def run_loss(minutes: float, loss: float, jitter: float, port: int,
             quiet: bool) -> dict[str, Any]:
    """Bring up the lossy cluster, watch it for ``minutes``, take it down; the JSON object."""
    knobs = {"RAPS_AGENT_ARGS": f"--heartbeat-loss {loss} --heartbeat-jitter {jitter}"}
    with private_cluster("raps-bench-loss-", port, 1.0, knobs) as cluster:
        return measure(cluster, minutes, loss, jitter, quiet)


def agent_args(cluster: LocalCluster) -> list[str]:
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
        raise BenchError(f"{log.stem} did not start: {text.strip()}")


def measure(cluster: LocalCluster, minutes: float, loss: float, jitter: float,
            quiet: bool) -> dict[str, Any]:
    """Fake ranks on every node, then ``minutes`` of watching (progress on stderr unless
    ``quiet``): false DEAD verdicts, ranks that stopped, the coordinator's HUNG lines."""
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
        knobs = agent_args(cluster)
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
            "agent_knobs": knobs,  # as the agents run: proof the knobs are on
            "knob_drops": "heartbeats and their resends only (not probe answers, acks, probes)"}
