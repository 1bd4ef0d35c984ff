"""``raps-agent --node NAME``: one per compute node (one per fake node in the test cluster).

Today it keeps the node's membership lease in etcd, sends signed kernel heartbeats to
the coordinator leader (with one resend when an acknowledgement is missing), answers
the leader's probes, stores its ranks' checkpoints and replicates them to their backup
groups (chunk transfer server on ``agent.transfer_address``, published in etcd), writes
a health sample to ``nodes/<node>/health`` every ``detection.telemetry_interval_sec``,
and deletes the local checkpoint data of purged jobs.
SIGTERM/SIGINT stop it; the membership lease is left to expire, so a restart within
the miss window goes unnoticed. Under systemd (``Type=notify``,
slurm/systemd/raps-agent.service) it sends READY=1 once its socket and transfer server
listen, and WATCHDOG=1 from its loop every ``WATCHDOG_EVERY_SEC``.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import click
import sdnotify

from raps_slurm.agent import uid_limits
from raps_slurm.agent.ckpt_api import CheckpointOps
from raps_slurm.agent.health import HealthReporter
from raps_slurm.agent.key_api import RankKeyOps
from raps_slurm.agent.local_api import LocalApiServer, RankTable
from raps_slurm.agent.msg_api import MessagingOps
from raps_slurm.agent.node import NodeAgent
from raps_slurm.agent.plan_watch import PlanWatcher
from raps_slurm.agent.quota import JobQuotas, PauseBook, job_size
from raps_slurm.agent.ranks import RankSupervisor
from raps_slurm.agent.recovery_api import RecoveryOps
from raps_slurm.agent.sweep import sweep_purged, sweep_reports
from raps_slurm.agent.transfer_access import JobNodes
from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.peer_keys import PeerKeys
from raps_slurm.checkpoint.service import CheckpointService
from raps_slurm.checkpoint.transfer import TransferServer
from raps_slurm.config import Config, load_config, node_dir
from raps_slurm.core.jobs import JobRecord
from raps_slurm.errors import RapsError, StoreError
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.wire.heartbeat import accepted_key, agent_keys, load_key

log = logging.getLogger("raps.agent")
stop = threading.Event()

# WATCHDOG=1 this often: well inside the unit's WatchdogSec (60 s), rare enough to cost
# nothing (the loop itself turns every 0.1 s).
WATCHDOG_EVERY_SEC = 5.0


class Watchdog:
    """sd_notify from the agent's loop: READY=1 once, then WATCHDOG=1 at most every
    ``every`` seconds. Without $NOTIFY_SOCKET (not under systemd) the messages go nowhere."""

    def __init__(self, notifier: sdnotify.SystemdNotifier | None = None,
                 every: float = WATCHDOG_EVERY_SEC,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._notifier = notifier or sdnotify.SystemdNotifier()
        self._every, self._mono = every, monotonic
        self._next = 0.0

    def ready(self, status: str) -> None:
        """The agent serves: its socket and transfer server listen."""
        self._notifier.notify(f"READY=1\nSTATUS={status[:200]}")
        self._next = self._mono() + self._every

    def tick(self) -> None:
        """Called every loop turn: a loop that stops turning stops the pings."""
        now = self._mono()
        if now >= self._next:
            self._notifier.notify("WATCHDOG=1")
            self._next = now + self._every


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
@click.option("--transfer-address", default=None, metavar="HOST:PORT",
              help="Override agent.transfer_address (chunk transfer between agents).")
@click.option("--incarnation-offset", default=0.0, type=click.FloatRange(0, 10 ** 8),
              metavar="SEC", help="Test knob: take an incarnation SEC seconds older than "
                                  "the clock says (an agent restarted after its clock stepped "
                                  "back).")
def cli(node: str, config_path: str | None, probe_root: str | None, heartbeat_loss: float,
        heartbeat_jitter: float, transfer_address: str | None,
        incarnation_offset: float) -> None:
    """Run the raps-slurm agent of one node."""
    try:
        cfg = load_config(config_path)
        mine, mine_also, peer_keys = _node_keys(cfg, node)
        store, keys = open_store(cfg.store, node)
    except RapsError as exc:
        raise click.ClickException(str(exc)) from None
    logging.basicConfig(level=cfg.logging.level, stream=sys.stderr,
                        format=f"%(asctime)s raps-agent[{node}] %(levelname)s %(message)s")
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    if not cfg.detection.transfer_tickets_file:
        log.warning("this agent holds the cluster key (no detection.transfer_tickets_file): "
                    "root on this node can sign heartbeats and transfers as any node; give it "
                    "its node key and tickets instead (docs/install.md)")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    agent = NodeAgent(cfg, store, keys, node, mine, loss=heartbeat_loss,
                      jitter=heartbeat_jitter, accepted_key=mine_also,
                      incarnation_offset=incarnation_offset)
    root = Path(node_dir(cfg.checkpoint.local_dir, node))
    chunks = ChunkStore(root)
    checkpoints = CheckpointService(cfg, store, keys, node, peer_keys, chunks)
    ranks = RankTable()
    # one set, shared by every op
    quotas = JobQuotas.from_config(cfg.agent, root, PauseBook(store, keys))

    def owner_of(job: str) -> int | None:
        return _owner_of(store, keys, job)

    # a restore started when a plan moves a rank here is the job owner's, as the rank's own
    checkpoints.early.charge_for = uid_limits.early_charges(
        uid_limits.shared(checkpoints, cfg.agent), owner_of)

    api = LocalApiServer(node_dir(cfg.agent.socket_path, node), node,
                         owner_of=owner_of,
                         valid_for=agent.valid_for,
                         idle_timeout=max(60.0, 3 * cfg.detection.app_heartbeat_interval_sec),
                         table=ranks,
                         extensions={**CheckpointOps(checkpoints, ranks, quotas).extensions(),
                                     **MessagingOps(checkpoints, ranks, owner_of,
                                                    quotas).extensions(),
                                     **RecoveryOps(store, keys, node, ranks, owner_of,
                                                   quotas).extensions(),
                                     **RankKeyOps(store, keys, ranks, owner_of,
                                                peer_keys).extensions()},
                         size_of=lambda job: job_size(store, keys, job, node),
                         quotas=quotas)
    supervisor = RankSupervisor(agent, api.ranks, store, keys, mine)
    try:
        host, port = parse_address(transfer_address or cfg.agent.transfer_address)
        transfer = TransferServer(chunks, peer_keys, node, (host, port),
                                  digest_algo=cfg.checkpoint.digest,
                                  limiter=checkpoints.limiter,
                                  max_generations=cfg.checkpoint.max_generations,
                                  allowed=JobNodes(store, keys).allowed)
        transfer.start()
        api.start()
    except (RapsError, OSError, ValueError) as exc:
        raise click.ClickException(f"cannot start: {exc}") from None
    bound_host, bound_port = transfer.address
    agent.transfer = f"{socket.gethostname() if bound_host == '0.0.0.0' else bound_host}:" \
                     f"{bound_port}"
    checkpoints.start()
    plans = PlanWatcher(store, keys, node, checkpoints.restore_early)
    plans.start()
    agent.start()
    log.info("agent of %s started (etcd %s)", node, ", ".join(cfg.store.endpoints))
    watchdog = Watchdog()
    watchdog.ready(f"agent of {node}: socket {api.path}")
    next_sweep = next_probe = next_report = next_epochs = next_repair = 0.0
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
                    sweep_reports(store, keys, node)
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
            if now >= next_repair:
                next_repair = now + max(1.0, cfg.detection.lease_duration_sec / 3)
                try:
                    checkpoints.repair()
                except (RapsError, OSError) as exc:
                    log.warning("checkpoint repair pass failed: %s", exc)
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + cfg.detection.telemetry_interval_sec
                probes.report(agent.lease, {
                    "transfer": transfer.rejections(), "local_api": api.error_counts(),
                    "heartbeat": {"bad_datagram": agent.counters["bad_datagrams"]}})
            watchdog.tick()
            stop.wait(0.1)
    finally:
        plans.stop()
        api.stop()
        transfer.stop()
        checkpoints.stop()
        agent.stop()
        store.close()
    log.info("agent of %s stopped", node)


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' -> (host, port); ValueError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"address {text!r}: expected HOST:PORT with a port 0-65535")
    return host, int(port)


def _node_keys(cfg: Config, node: str) -> tuple[bytes, bytes | None, PeerKeys]:
    """(heartbeat key, a rollover's other heartbeat key or None, chunk transfer keys).

    With ``detection.transfer_tickets_file`` the agent reads no cluster key: its node key
    and its tickets are all it holds. Without it, both derive from the cluster key."""
    d = cfg.detection
    if d.transfer_tickets_file:
        mine = load_key(node_dir(d.node_key_file, node), node=node)
        return mine, None, PeerKeys.from_files(node, mine,
                                               node_dir(d.transfer_tickets_file, node))
    key = load_key(d.cluster_key_file)
    also = accepted_key(d.accepted_key_file)
    mine, mine_also = agent_keys(node, node_dir(d.node_key_file, node), key, also)
    return mine, mine_also, PeerKeys.from_cluster(key, node, also)


def _owner_of(store: StateStore, keys: Keys, job: str) -> int | None:
    """The uid that owns ``job`` (from its registration), None if not registered."""
    kv = store.get(keys.job(job))
    return None if kv is None else JobRecord.from_json(kv.key, kv.value).owner_uid


def main() -> None:
    """Entry point of ``raps-agent``."""
    cli(prog_name="raps-agent")
