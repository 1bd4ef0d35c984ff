"""``raps-agent --node NAME``: one per compute node (one per fake node in the test cluster).

Today it keeps the node's membership lease in etcd, sends signed kernel heartbeats to
the coordinator leader (with one resend when an acknowledgement is missing), answers
the leader's probes, writes a health sample to ``nodes/<node>/health`` every
``detection.telemetry_interval_sec``, and deletes the local checkpoint data of purged jobs.
SIGTERM/SIGINT stop it; the membership lease is left to expire, so a restart within
the miss window goes unnoticed.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import click

from raps_slurm.agent.health import HealthReporter
from raps_slurm.agent.local_api import LocalApiServer
from raps_slurm.agent.node import NodeAgent
from raps_slurm.agent.ranks import RankSupervisor
from raps_slurm.agent.sweep import sweep_purged
from raps_slurm.config import load_config, node_dir
from raps_slurm.core.jobs import JobRecord
from raps_slurm.errors import RapsError, StoreError
from raps_slurm.heartbeat import load_key
from raps_slurm.store import Keys, StateStore, open_store

log = logging.getLogger("raps.agent")
stop = threading.Event()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    stop.set()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--node", required=True, metavar="NAME", help="Slurm node name this agent serves.")
@click.option("--config", "config_path", metavar="FILE",
              help="Config file (default: $RAPS_CONFIG, then /etc/raps/raps.yaml).")
@click.option("--probe-root", default=None, metavar="PATH",
              help="Override agent.probe_root (root of /sys and /proc for health probes).")
@click.option("--heartbeat-loss", default=0.0, type=click.FloatRange(0, 1), metavar="P",
              help="Test knob: drop this share of outgoing heartbeats.")
@click.option("--heartbeat-jitter", default=0.0, type=click.FloatRange(0, 10), metavar="SEC",
              help="Test knob: delay each heartbeat by up to SEC seconds.")
def cli(node: str, config_path: str | None, probe_root: str | None, heartbeat_loss: float,
        heartbeat_jitter: float) -> None:
    """Run the raps-slurm agent of one node."""
    try:
        cfg = load_config(config_path)
        key = load_key(cfg.detection.cluster_key_file)
        store, keys = open_store(cfg.store)
    except RapsError as exc:
        raise click.ClickException(str(exc)) from None
    logging.basicConfig(level=cfg.logging.level, stream=sys.stderr,
                        format=f"%(asctime)s raps-agent[{node}] %(levelname)s %(message)s")
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    agent = NodeAgent(cfg, store, keys, node, key, loss=heartbeat_loss, jitter=heartbeat_jitter)
    root = Path(node_dir(cfg.checkpoint.local_dir, node))
    api = LocalApiServer(node_dir(cfg.agent.socket_path, node), node,
                         owner_of=lambda job: _owner_of(store, keys, job),
                         valid_for=agent.valid_for,
                         idle_timeout=max(60.0, 3 * cfg.detection.app_heartbeat_interval_sec))
    supervisor = RankSupervisor(agent, api.ranks, store, keys, key)
    try:
        api.start()
    except RapsError as exc:
        raise click.ClickException(str(exc)) from None
    agent.start()
    log.info("agent of %s started (etcd %s)", node, ", ".join(cfg.store.endpoints))
    next_sweep = next_probe = next_report = next_epochs = 0.0
    probes = HealthReporter(store, keys, node, Path(probe_root or cfg.agent.probe_root), root)
    try:
        while not stop.is_set():
            # Fencing first: after a freeze the lease refresh below would make the node
            # look valid again before its ranks were stopped.
            supervisor.fence_if_invalid()
            status = agent.step()
            if status:
                log.info("%s", status)
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + cfg.agent.sweep_interval_sec
                try:
                    sweep_purged(store, keys, root)
                except StoreError as exc:
                    log.debug("sweep skipped: %s", exc)
                except OSError as exc:
                    log.warning("sweep of %s failed: %s", root, exc)
            now = time.monotonic()
            if now >= next_report:
                next_report = now + cfg.detection.app_heartbeat_interval_sec
                supervisor.report()
            if now >= next_epochs:
                next_epochs = now + max(0.5, cfg.detection.lease_duration_sec / 3)
                supervisor.kill_superseded()
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + cfg.detection.telemetry_interval_sec
                probes.report(agent.lease)
            stop.wait(0.1)
    finally:
        api.stop()
        agent.stop()
        store.close()
    log.info("agent of %s stopped", node)


def _owner_of(store: StateStore, keys: Keys, job: str) -> int | None:
    """The uid that owns ``job`` (from its registration), None if not registered."""
    kv = store.get(keys.job(job))
    return None if kv is None else JobRecord.from_json(kv.key, kv.value).owner_uid


def main() -> None:
    """Entry point of ``raps-agent``."""
    cli(prog_name="raps-agent")
