"""``raps-coordinator``: the daemon's thin loop around ``Coordinator.run_cycle``.

SIGTERM/SIGINT set a flag; the loop finishes its cycle, resigns leadership (standbys
take over at once instead of after the lease) and exits 0. Under systemd
(``Type=notify``) it sends READY=1 once running and WATCHDOG=1 every cycle.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType

import click
import sdnotify

from raps_slurm import munge
from raps_slurm.config import load_config, parse_address
from raps_slurm.coordinator.cycle import Coordinator
from raps_slurm.coordinator.deadnodes import DeadNodes
from raps_slurm.coordinator.detection import Detection
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.heartbeats import HeartbeatServer
from raps_slurm.coordinator.hygiene import Hygiene
from raps_slurm.coordinator.metrics import Metrics
from raps_slurm.coordinator.receivers import ReceiverPool
from raps_slurm.coordinator.recovery import Recovery
from raps_slurm.coordinator.userdoor import UserDoor
from raps_slurm.coordinator.weights import Weights
from raps_slurm.errors import RapsError, StoreError
from raps_slurm.slurm import SlurmClient
from raps_slurm.slurm.runner import CommandRunner
from raps_slurm.store import StateStore, Watch, open_store
from raps_slurm.wire.heartbeat import accepted_key, load_key

log = logging.getLogger("raps.coordinator")


class _Wakeup:
    """Waits for the next cycle: returns early when something under the jobs, plans or
    reports prefix changes (a new job, a checkpoint commit, a phase a node reports, an
    admin's cancel)."""

    def __init__(self, store: StateStore, prefixes: tuple[str, ...]) -> None:
        self._store, self._prefixes = store, prefixes
        self._watches: list[Watch] = []
        self._changed = threading.Event()

    def wait(self, timeout: float) -> bool:
        """True when something changed (the caller runs a cycle at once)."""
        try:
            if not self._watches:
                self._watches = [self._store.watch_prefix(p) for p in self._prefixes]
            deadline = time.monotonic() + timeout
            while True:
                for w in self._watches:
                    if w.next(0) is not None:
                        for x in self._watches:  # drain: one cycle reads it all
                            while x.next(0) is not None:
                                pass
                        return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # the first watch blocks; the others are polled at least every 50 ms
                if self._watches[0].next(min(left, 0.05)) is not None:
                    for x in self._watches:
                        while x.next(0) is not None:
                            pass
                    return True
        except StoreError:
            self.close()
            stop.wait(timeout)
        return False

    def close(self) -> None:
        for w in self._watches:
            w.cancel()
        self._watches = []


stop = threading.Event()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    stop.set()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="FILE",
              help="Config file (default: $RAPS_CONFIG, then /etc/raps/raps.yaml).")
@click.option("--name", default=None, metavar="NAME",
              help="Name in the leader key and logs (default: HOST:PID).")
@click.option("--metrics-address", default=None, metavar="HOST:PORT",
              help="Override coordinator.metrics_address ('' = no endpoint).")
@click.option("--heartbeat-address", default=None, metavar="HOST:PORT",
              help="Override coordinator.heartbeat_address (UDP, heartbeats from agents).")
@click.option("--heartbeat-receivers", type=click.IntRange(1, 64), default=None, metavar="N",
              help="Override coordinator.heartbeat_receivers (processes on the UDP port).")
@click.option("--user-address", default=None, metavar="HOST:PORT",
              help="Override coordinator.user_address (TCP, rapsctl of users; '' = off).")
@click.option("--once", is_flag=True, help="Run one cycle, print its status, exit.")
def cli(config_path: str | None, name: str | None, metrics_address: str | None,
        heartbeat_address: str | None, heartbeat_receivers: int | None,
        user_address: str | None, once: bool) -> None:
    """Run the raps-slurm coordinator (leader or standby)."""
    try:
        cfg = load_config(config_path)
    except RapsError as exc:
        raise click.ClickException(str(exc)) from None
    logging.basicConfig(level=cfg.logging.level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("urllib3").setLevel(logging.WARNING)  # one line per etcd request
    name = name or f"{socket.gethostname()}:{os.getpid()}"
    address = cfg.coordinator.metrics_address if metrics_address is None else metrics_address
    # Port 0: any free port (tests run several coordinators; the leader key says which).
    listen = parse_address(heartbeat_address or cfg.coordinator.heartbeat_address, any_port=True)
    if listen is None:
        raise click.ClickException(f"--heartbeat-address {heartbeat_address!r} is not host:port")
    try:
        metrics = Metrics(address or None)
        key = load_key(cfg.detection.cluster_key_file)
        also = accepted_key(cfg.detection.accepted_key_file)
        store, keys = open_store(cfg.store)
    except RapsError as exc:
        raise click.ClickException(str(exc)) from None
    slurm = SlurmClient(CommandRunner(timeout=30))
    leadership_box: list[Leadership] = []
    receivers = heartbeat_receivers or cfg.coordinator.heartbeat_receivers
    server = HeartbeatServer(listen, key, cfg.detection.max_clock_skew_sec,
                             lambda: leadership_box[0].revision
                             if leadership_box and leadership_box[0].is_leader() else 0,
                             on_result=metrics.count_heartbeat, accepted_key=also,
                             reuse_port=receivers > 1,
                             members_from=lambda: [n.name for n in slurm.nodes()],
                             source_rate=cfg.coordinator.heartbeat_source_rate,
                             source_burst=cfg.coordinator.heartbeat_source_burst)
    try:
        server.start()
    except OSError as exc:
        raise click.ClickException(f"heartbeat address {listen[0]}:{listen[1]}: "
                                   f"{exc.strerror or exc}") from None
    pool: ReceiverPool | None = None
    if receivers > 1:
        pool = ReceiverPool(server, receivers, key, also, cfg.detection.max_clock_skew_sec)
        try:
            pool.start()
        except OSError as exc:
            server.stop()
            raise click.ClickException(str(exc)) from None
    door_at = cfg.coordinator.user_address if user_address is None else user_address
    door: UserDoor | None = None
    if door_at:
        bind = parse_address(door_at, any_port=True)
        if bind is None:
            raise click.ClickException(f"--user-address {door_at!r} is not host:port or ''")
        try:
            door = UserDoor(store, keys, bind, munge.decode, on_result=metrics.count_user)
        except OSError as exc:
            if pool is not None:
                pool.stop()
            server.stop()
            raise click.ClickException(f"user address {door_at}: {exc.strerror or exc}") from None
        door.start()
    advertised = listen[0] if listen[0] not in ("0.0.0.0", "") else socket.getfqdn()
    identity = {"name": name, "host": socket.gethostname(), "pid": os.getpid(),
                "metrics": address or "", "heartbeat": f"{advertised}:{server.address[1]}"}
    leadership = Leadership(store, keys.leader(), cfg.coordinator.leader_lease_sec, identity)
    leadership_box.append(leadership)
    detection = Detection(cfg, store, keys, leadership, server, node_info=slurm.node,
                          drain=lambda node, reason: slurm.drain([node], reason),
                          metrics=metrics)
    # Follows nodes/ (verdicts a previous leader gave too); waits for the watch to bring a
    # verdict this leader's detector just gave.
    dead_nodes = DeadNodes(store, keys, every=max(0.5, cfg.detection.kernel_heartbeat_interval_sec))
    coordinator = Coordinator(
        cfg, store, keys, leadership, topology=slurm.topology,
        job_states=lambda: {str(j.job_id): j.state for j in slurm.jobs()},
        metrics=metrics, name=name, background=True,
        dead_nodes=dead_nodes, finished_ranks=detection.finished_ranks,
        placed_nodes=detection.placed_nodes)
    coordinator.recovery = Recovery(cfg, store, keys, leadership,
                                    job_info=lambda job: slurm.job(int(job)),
                                    requeue=lambda job: slurm.requeue(int(job)),
                                    start_now=lambda job: slurm.start_now(int(job)),
                                    update_pending=lambda job, exclude, count:
                                    slurm.update_pending(int(job), exclude, count),
                                    cancel=lambda job: slurm.cancel(int(job)),
                                    step_of=detection.step_of)
    weights = Weights(cfg, store, keys, leadership, nodes=slurm.nodes,
                      topology=lambda: coordinator.topology,
                      set_weight=lambda node, w: slurm.set_weight([node], w), background=True,
                      dead=dead_nodes)
    hygiene = Hygiene(cfg, store, leadership, metrics)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    notify = sdnotify.SystemdNotifier()
    wakeup = _Wakeup(store, (keys.jobs_prefix(), keys.plans_prefix(), keys.reports_prefix(),
                             keys.cancels_prefix()))
    log.info("coordinator %s started (etcd %s)", name, ", ".join(cfg.store.endpoints))
    notify.notify("READY=1")
    last = ""
    # Detection ticks at least four times per heartbeat interval, more often while it
    # probes; the registry cycle runs every cycle_interval_sec, or at once when something
    # changes under the jobs prefix.
    next_cycle = 0.0
    changed = True
    try:
        while not stop.is_set():
            if changed or time.monotonic() >= next_cycle:
                status = coordinator.run_cycle()
                next_cycle = time.monotonic() + cfg.coordinator.cycle_interval_sec
                if status != last:  # a steady state is logged once, not every cycle
                    log.info("cycle: %s", status)
                    last = status
                notify.notify(f"WATCHDOG=1\nSTATUS={status[:200]}")
                if once:
                    click.echo(status)
                    break
            if pool is not None:  # the receivers ack only while this says it leads
                pool.publish(leadership.revision if leadership.is_leader() else 0,
                             leadership.valid_until)
            for line in (*weights.step(), *hygiene.step()):
                log.info("system: %s", line)
            if any(line.startswith("DEAD ") for line in detection.tick()):
                dead_nodes.refresh()  # plan for the dead node's ranks now, not next read
                changed = True
                continue
            changed = wakeup.wait(max(0.0, min(detection.next_wakeup(time.time()),
                                               next_cycle - time.monotonic())))
    finally:
        wakeup.close()
        weights.close()
        if pool is not None:  # no receiver may ack once the lease is revoked
            pool.publish(0, 0.0)
            pool.stop()
        leadership.resign()
        server.stop()
        if door is not None:
            door.stop()
        detection.close()
        dead_nodes.close()
        store.close()
    log.info("coordinator %s stopped", name)


def main() -> None:
    """Entry point of ``raps-coordinator``."""
    cli(prog_name="raps-coordinator")
