"""One typed, frozen configuration, loaded from YAML and checked strictly.

Every key lives in a dataclass below with its default, allowed range and a one-line
description (field metadata). ``configs/raps.yaml`` mirrors these defaults and a test
keeps the two equal. A file only needs the keys it changes.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from ClusterShell.NodeSet import NodeSet, NodeSetParseError

from raps_slurm.errors import ConfigError

SYSTEM_CONFIG = Path("/etc/raps/raps.yaml")
ENV_VAR = "RAPS_CONFIG"


def _f(default: Any, doc: str, lo: float | None = None, hi: float | None = None,
       choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its default, description and allowed range."""
    meta = {"doc": doc, "min": lo, "max": hi, "choices": choices}
    if isinstance(default, (list, dict)):
        if isinstance(default, list):
            return field(default_factory=lambda: tuple(default), metadata=meta)
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class CheckpointConfig:
    """Per-rank local incremental checkpoints."""

    interval_sec: int = _f(600, "seconds between checkpoints of a rank", 1, 7 * 86400)
    replica_count: int = _f(2, "copies besides the primary, placed in other fault domains", 0, 8)
    max_generations: int = _f(5, "generations kept per rank; older ones are collected", 1, 1000)
    large_message_threshold_kb: int = _f(
        4096, "messages above this are logged as metadata, body kept in sender memory",
        1, 1024 * 1024)
    local_dir: str = _f("/var/lib/raps/ckpt",
                        "node-local checkpoint dir; %n is replaced by the node name")
    cold_dir: str = _f("", "shared-storage cold copy, last fallback of a restore ('' = none)")
    cold_every: int = _f(10, "every Nth generation of a rank is also copied to cold_dir",
                         1, 100_000)
    avg_chunk_kb: int = _f(256, "average content-defined chunk size", 1, 4096)
    digest: str = _f("blake3", "chunk digest", choices=("blake3", "sha256"))
    zstd_level: int = _f(1, "zstd level of chunks (incompressible chunks are stored raw)",
                         1, 19)
    shuffle: bool = _f(True, "byte-shuffle numeric arrays before zstd (as HDF5/Blosc do)")
    use_delta_transfer: bool = _f(True, "replicas receive only the chunks they lack")
    replication_mbps: float = _f(1000.0,
                                 "cap on an agent's outgoing checkpoint copies, MB/s "
                                 "(restores are not capped)", 0.1, 1_000_000)


@dataclass(frozen=True)
class MessageLogConfig:
    """Sender-based message logging."""

    batch_flush_ms: int = _f(100, "log flush period to the local store and log backup",
                             1, 60_000)
    backup_max_lag_ms: int = _f(300, "a log flush waits at most this for its log backup "
                                "copy", 1, 600_000)
    buffer_size_mb: int = _f(256, "in-memory log buffer per rank, faulted in whole at the "
                             "rank's first message of 64 KiB or more", 1, 1024 * 1024)
    buffer_high_watermark_mb: int = _f(192, "above this the log spills to local disk",
                                       1, 1024 * 1024)
    recv_timeout_sec: float = _f(600.0, "a receive whose source makes no progress this long "
                                 "(re-sent messages of a relaunched source are progress) is an "
                                 "error, escalated", 0.1, 7 * 86400)
    listen_address: str = _f("", "address ranks listen on for peers ('' = the node's name)")
    stats_interval_sec: float = _f(10.0, "ranks report their message-log figures this often",
                                   0.1, 3600)
    spin_us: int = _f(200, "a receive polls this long before it sleeps (0: never polls; "
                      "set 0 where ranks share cores)", 0, 100_000)
    frame_mac: str = _f("control", "which rank-to-rank frames carry a MAC: control (replay "
                        "and collection frames; data is authenticated by its connection) or "
                        "all (also every message: for a fabric an attacker can write to)",
                        choices=("control", "all"))
    same_node: str = _f("unix", "how ranks on one host reach each other: unix (a Unix "
                        "socket, the peer's uid checked) or tcp (loopback, as between hosts)",
                        choices=("unix", "tcp"))


@dataclass(frozen=True)
class DetectionConfig:
    """Heartbeats, leases and health probes."""

    kernel_heartbeat_interval_sec: float = _f(1.0, "agent -> coordinator UDP heartbeat period",
                                              0.01, 60)
    app_heartbeat_interval_sec: float = _f(10.0, "rank -> agent heartbeat period, with progress",
                                           0.1, 3600)
    telemetry_interval_sec: float = _f(30.0, "health probes and telemetry period", 0.1, 3600)
    miss_threshold: int = _f(3, "missed kernel heartbeats before a node is DEAD (strikes)",
                             1, 100)
    app_miss_threshold: int = _f(5, "missed app heartbeats before a rank is HUNG", 1, 100)
    app_progress_timeout_sec: float = _f(0.0, "a rank whose step (ctx.heartbeat) has not "
                                         "changed this long, and that is not waiting for a "
                                         "peer, is HUNG (0 = 5 x app_heartbeat_interval_sec)",
                                         0, 86400)
    lease_duration_sec: float = _f(15.0, "node membership lease TTL in etcd", 1, 3600)
    fence_margin_sec: float = _f(0.5, "extra wait, after the miss window, before a DEAD verdict",
                                 0, 600)
    cluster_key_file: str = _f("/etc/raps/raps.key",
                               "cluster key (mode 0600): node keys and transfer tickets derive "
                               "from it; an agent reads it only to derive its own")
    accepted_key_file: str = _f("", "during a key rollover, a second key whose signatures "
                                "are accepted, never used to sign ('' = none)")
    node_key_file: str = _f("", "the agent's own node key signing its heartbeats, %n = node "
                            "(mode 0600, rapsctl config node-key; '' = derive it from "
                            "cluster_key_file)")
    transfer_tickets_file: str = _f("", "the agent's keys for chunk transfer to each other "
                                    "node, %n = node (mode 0600, rapsctl config "
                                    "transfer-tickets; '' = derive them from cluster_key_file)")
    max_clock_skew_sec: float = _f(5.0, "heartbeats timestamped further from the receiver's "
                                   "clock are dropped", 0.1, 3600)
    smart_temperature_c: float = _f(70.0, "NVMe temperature that marks a node DEGRADED", 20, 150)
    retransmit_ratio_threshold: float = _f(0.05, "TCP retransmit ratio that marks a node DEGRADED",
                                           0, 1)


@dataclass(frozen=True)
class RecoveryConfig:
    """Relaunch of affected ranks on spares."""

    prefer_original_rack: bool = _f(True, "try spares in the failed node's rack first if healthy")
    max_concurrent_recoveries: int = _f(4, "recoveries run at once; the rest queue", 1, 1024)
    recovery_timeout_sec: int = _f(300, "a relaunched rank not running again by then "
                                   "escalates (its re-execution is judged by its progress)",
                                   10, 86400)
    use_delta_transfer: bool = _f(True, "send only the chunks a spare lacks")
    max_requeues: int = _f(3, "whole-job requeues within requeue_window_sec before RAPS "
                           "gives up and the job fails", 0, 1000)
    requeue_window_sec: int = _f(3600, "the window max_requeues counts in", 60, 31_536_000)


@dataclass(frozen=True)
class SystemConfig:
    """Failure history, fault-domain scores and the Slurm node weights drawn from them."""

    history_window_h: float = _f(168.0, "keep DEAD/HUNG/DRAIN verdicts this long per node",
                                 0.01, 24 * 365)
    score_half_life_h: float = _f(24.0, "a failure's weight in a score halves this often",
                                  0.001, 24 * 365)
    weight_step: int = _f(100, "weight added per tenth of score lost (0 = never touch weights)",
                          0, 100_000_000)
    weight_levels: int = _f(10, "steps the score is cut into for weights", 1, 1000)
    weight_reconcile_sec: float = _f(30.0, "compare Slurm's node weights with the scores "
                                     "this often (reconfigure resets them)", 0.2, 86400)
    boost_extra_replicas: int = _f(1, "extra checkpoint mirrors for ranks in a rack scoring "
                                   "below boost_below_score (0 = no boost)", 0, 4)
    boost_below_score: float = _f(0.5, "a rack scoring below this boosts its ranks' copies",
                                  0.0, 1.0)
    boost_recover_score: float = _f(0.8, "the extra copies go when the rack scores this again",
                                    0.0, 1.0)


@dataclass(frozen=True)
class StoreConfig:
    """etcd access (RAPS daemons and controller hooks only)."""

    endpoints: tuple[str, ...] = _f(["http://127.0.0.1:2379"],
                                    "etcd client URLs, tried in order")
    prefix: str = _f("/raps/v1/", "every RAPS key lives under this prefix")
    timeout_sec: float = _f(5.0, "per-request timeout", 0.1, 120)
    ca_cert: str = _f("", "CA bundle for TLS ('' = system default / plain http)")
    cert_file: str = _f("", "client certificate for TLS client auth ('' = none; %n = node)")
    key_file: str = _f("", "client key for TLS client auth ('' = none; %n = node)")
    space_quota_bytes: int = _f(2 * 1024**3, "etcd's --quota-backend-bytes (show status "
                                "and the leader's warning compare the database with it; "
                                "0 = unknown)", 0, 64 * 1024**3)
    compaction_retention_sec: float = _f(600.0, "the leader compacts etcd history older "
                                         "than this (0 = leave it to etcd's "
                                         "--auto-compaction-*)", 0, 30 * 86400)
    compaction_interval_sec: float = _f(300.0, "how often the leader looks at etcd's size "
                                        "and compacts", 0.1, 86400)
    cluster_nodes: int = _f(64, "compute nodes running raps-agent: the etcd budget "
                            "(rapsctl config check) is sized for this many", 1, 1_000_000)
    etcd_budget_share: float = _f(0.5, "share of space_quota_bytes the agents' writes for "
                                  "ranks may hold, history included (rapsctl config check)",
                                  0.01, 1.0)
    report_watermark_share: float = _f(0.7, "etcd in use above this share of "
                                       "space_quota_bytes: the leader pauses the reports of "
                                       "the job that wrote most", 0.05, 0.99)
    report_resume_share: float = _f(0.5, "paused jobs' reports resume once etcd in use is "
                                    "below this share of space_quota_bytes", 0.01, 0.98)
    user: str = _f("", "etcd user for password auth ('' = none; %n = node: an agent's user "
                   "is raps-agent-%n)")
    password_file: str = _f("", "file holding the etcd password (mode 0600; %n = node)")


@dataclass(frozen=True)
class CoordinatorConfig:
    """Coordinator leadership; the leader is found through etcd."""

    addresses: tuple[str, ...] = _f(["127.0.0.1:7470"],
                                    "host:port of every coordinator's user door (TCP): "
                                    "rapsctl of a non-root user asks them in order")
    leader_lease_sec: float = _f(10.0, "TTL of the coordinator leader key", 1, 600)
    cycle_interval_sec: float = _f(1.0, "longest wait between cycles (a job change wakes it)",
                                   0.05, 60)
    topology_refresh_sec: float = _f(60.0, "re-read the Slurm topology this often", 1, 86400)
    slurm_poll_sec: float = _f(10.0, "ask Slurm for the state of registered jobs this often",
                               0.5, 3600)
    purge_grace_sec: float = _f(3600.0, "keep a finished job's keys and data this long",
                                0, 30 * 86400)
    purge_record_sec: float = _f(7 * 86400.0, "keep the tombstone of a purged job this long "
                                 "(agents delete its local data meanwhile)", 60, 365 * 86400)
    metrics_address: str = _f("127.0.0.1:9470", "Prometheus endpoint host:port ('' = off)")
    heartbeat_address: str = _f("0.0.0.0:7470", "UDP host:port the coordinator receives "
                                "heartbeats on")
    heartbeat_receivers: int = _f(1, "processes receiving heartbeats on heartbeat_address "
                                  "(SO_REUSEPORT): about one per 50,000 nodes", 1, 64)
    heartbeat_source_rate: float = _f(20.0, "refused heartbeat datagrams a second one source "
                                      "address may cost (each receiver) before ...", 0.1, 1e6)
    heartbeat_source_burst: int = _f(400, "... beyond this many at once, its datagrams are "
                                     "dropped unread (but those of nodes heard from it)",
                                     1, 10_000_000)
    user_address: str = _f("0.0.0.0:7470", "TCP host:port of the user door: rapsctl of "
                           "users (login nodes) with a MUNGE credential ('' = off)")


@dataclass(frozen=True)
class AgentConfig:
    """The per-node agent."""

    socket_path: str = _f("/run/raps/%n/agent.sock",
                          "unix socket for ranks, raps-run and rapsctl; %n = node name")
    sweep_interval_sec: float = _f(60.0, "look for purged jobs' local data this often",
                                   0.5, 86400)
    probe_root: str = _f("/", "root of /sys and /proc for health probes (tests: a fixture tree)")
    transfer_address: str = _f("0.0.0.0:7821",
                               "TCP host:port for chunk transfer between agents (port 0: any)")
    job_etcd_writes_per_sec: float = _f(
        50.0, "etcd writes the agent makes for one job's ranks, per second, sustained",
        0.01, 100_000)
    job_etcd_write_burst: int = _f(1000, "etcd writes one job may make at once above that rate",
                                   1, 1_000_000)
    max_value_kb: int = _f(64, "largest etcd value the agent writes for a rank", 1, 1024)
    node_etcd_kb_per_sec: float = _f(16.0, "KiB per second the agent writes to etcd for "
                                     "the ranks of every job on the node together, sustained",
                                     0.01, 1_000_000)
    node_etcd_burst_kb: int = _f(1024, "KiB the agent may write to etcd for ranks at once "
                                 "above that rate", 1, 1 << 30)
    job_disk_quota_mb: int = _f(102_400, "checkpoint chunks plus log segments one job may "
                                "keep on one node", 1, 1 << 30)
    uid_restores_at_once: int = _f(1, "checkpoint restores one uid may have the agent run at "
                                   "once", 1, 64)
    uid_log_ops_at_once: int = _f(4, "log_read and log_append calls one uid may have the "
                                  "agent run at once", 1, 256)
    uid_memory_percent: float = _f(50.0, "share of the node's memory the agent may hold at "
                                   "once for one uid's restores and log reads and appends",
                                   1, 90)


@dataclass(frozen=True)
class HooksConfig:
    """Prolog/epilog hooks: fast, no Slurm calls, never a reason to block the cluster."""

    fail_open: bool = _f(True, "etcd unreachable: PrologSlurmctld lets the job run unregistered")
    time_budget_sec: float = _f(2.0, "hard limit on one hook run", 0.1, 60)
    log_dir: str = _f("/var/log/raps", "hook log files (<hook>.log); unwritable = stderr")


@dataclass(frozen=True)
class TopologyConfig:
    """Fault domains beyond racks."""

    power_domains: dict[str, str] = _f({}, "power domain -> hostlist, e.g. pdu1: n[1-8]")
    power_feature_prefix: str = _f("power_",
                                   "node feature naming a power domain, e.g. power_pdu1")


@dataclass(frozen=True)
class LoggingConfig:
    """Daemon logging."""

    level: str = _f("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass(frozen=True)
class Config:
    """The whole raps-slurm configuration."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    messagelog: MessageLogConfig = field(default_factory=MessageLogConfig)
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin is tuple:
        return "a list of numbers" if typing.get_args(tp)[0] is float else "a list of strings"
    if origin is dict:
        return "a mapping of strings to strings"
    return str(tp)


def _convert(path: str, tp: Any, value: Any, meta: Mapping[str, Any],
             errors: list[str]) -> Any:
    """Check one leaf value against its type and range; append an error line if bad."""
    bad = f"{path}: expected {_type_name(tp)}, got {value!r}"
    if tp is bool:
        if not isinstance(value, bool):
            errors.append(bad)
        return value
    if tp in (int, float):
        ok = isinstance(value, int) or (tp is float and isinstance(value, float))
        if isinstance(value, bool) or not ok:
            errors.append(bad)
            return value
        lo, hi = meta.get("min"), meta.get("max")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            errors.append(f"{path}: {value!r} is out of range, allowed {lo} to {hi}")
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            errors.append(bad)
            return value
        choices = meta.get("choices")
        if choices and value not in choices:
            errors.append(f"{path}: {value!r} is not allowed, expected one of {', '.join(choices)}")
        return value
    origin = typing.get_origin(tp)
    if origin is tuple and typing.get_args(tp)[0] is float:
        if not isinstance(value, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            errors.append(bad)
            return value
        lo, hi = meta.get("min"), meta.get("max")
        if any((lo is not None and v < lo) or (hi is not None and v > hi) for v in value):
            errors.append(f"{path}: {value!r} has a value out of range, allowed {lo} to {hi}")
        return tuple(float(v) for v in value)
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            errors.append(bad)
            return value
        return tuple(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            errors.append(bad)
            return value
        return dict(value)
    raise TypeError(f"unsupported config type {tp} at {path}")


def _build(cls: type, data: Any, path: str, errors: list[str],
           failed: set[str] | None = None) -> Any:
    """Build dataclass ``cls`` from a mapping, collecting every error with its key path.

    A key whose value is wrong keeps its default in the result and its path goes into
    ``failed`` (a whole section's path when the section is not a mapping), so that the
    cross-key rules can run on the keys that parsed and skip those that did not.
    """
    where = path or "config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errors.append(f"{where}: expected a mapping of keys, got {data!r}")
        if failed is not None:
            failed.add(path)
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            errors.append(f"{sub}: unknown key{hint} (allowed: {', '.join(fields)})")
            continue
        tp = hints[key]
        before = len(errors)
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, sub, errors, failed)  # type: ignore[arg-type]
            continue
        kwargs[key] = _convert(sub, tp, value, fields[key].metadata, errors)
        f = fields[key]
        if len(errors) > before and (f.default is not dataclasses.MISSING
                                     or f.default_factory is not dataclasses.MISSING):
            del kwargs[key]  # the default stands in; the rules below skip this key
            if failed is not None:
                failed.add(sub)
    return cls(**kwargs)


def _check_pairs(cfg: Config, errors: list[str], failed: frozenset[str] = frozenset()) -> None:
    """Cross-key rules that a single range cannot express; a rule whose keys (or their
    section) are in ``failed`` is skipped: those keys already have their error."""
    def ok(*paths: str) -> bool:
        return not any(p in failed or p.partition(".")[0] in failed for p in paths)

    sy = cfg.system
    if (ok("system.boost_recover_score", "system.boost_below_score")
            and sy.boost_recover_score < sy.boost_below_score):
        errors.append(f"system.boost_recover_score: {sy.boost_recover_score:g} must be at least "
                      f"system.boost_below_score = {sy.boost_below_score:g}")
    d = cfg.detection
    window = d.miss_threshold * d.kernel_heartbeat_interval_sec
    if (ok("detection.lease_duration_sec", "detection.miss_threshold",
           "detection.kernel_heartbeat_interval_sec") and d.lease_duration_sec <= window):
        errors.append(
            f"detection.lease_duration_sec: {d.lease_duration_sec:g} must exceed miss_threshold x "
            f"kernel_heartbeat_interval_sec = {window:g}")
    if (ok("detection.transfer_tickets_file", "detection.node_key_file")
            and d.transfer_tickets_file and not d.node_key_file):
        errors.append("detection.transfer_tickets_file: set, but detection.node_key_file is '' "
                      "(an agent with tickets reads no cluster key to derive its node key from)")
    m = cfg.messagelog
    if (ok("messagelog.buffer_high_watermark_mb", "messagelog.buffer_size_mb")
            and m.buffer_high_watermark_mb >= m.buffer_size_mb):
        errors.append(
            f"messagelog.buffer_high_watermark_mb: {m.buffer_high_watermark_mb} must be below "
            f"messagelog.buffer_size_mb = {m.buffer_size_mb}")
    window = d.app_progress_timeout_sec or 5 * d.app_heartbeat_interval_sec
    need = cfg.recovery.recovery_timeout_sec + window
    if (ok("messagelog.recv_timeout_sec", "recovery.recovery_timeout_sec",
           "detection.app_progress_timeout_sec", "detection.app_heartbeat_interval_sec")
            and m.recv_timeout_sec <= need):
        # A peer's waiters must outlast its loss: a hang found (the progress window), then
        # its relaunch running again (recovery_timeout_sec), before its re-sent messages
        # show progress. Shorter, a healthy waiter requeues the job a recovery would save.
        errors.append(
            f"messagelog.recv_timeout_sec: {m.recv_timeout_sec:g} must exceed "
            f"recovery.recovery_timeout_sec + the hang window (detection.app_progress_timeout"
            f"_sec, or 5 x app_heartbeat_interval_sec) = {need:g}: a rank waiting for a lost "
            "peer would give up before the peer's relaunch runs")
    st, lease = cfg.store, cfg.coordinator.leader_lease_sec
    if (ok("store.timeout_sec", "store.endpoints", "coordinator.leader_lease_sec")
            and len(st.endpoints) > 1 and st.timeout_sec >= lease * 2 / 3):
        # A request to a member cut off fails over to the next endpoint only after
        # timeout_sec; the leader refreshes its lease a third of the way in, so the
        # refresh that fails over must still land before the lease runs out.
        errors.append(
            f"store.timeout_sec: {st.timeout_sec:g} must be under 2/3 of "
            f"coordinator.leader_lease_sec = {lease:g} (so under {lease * 2 / 3:.3g}) with "
            f"{len(st.endpoints)} etcd endpoints: a request fails over only after timeout_sec")
    if ok("store.endpoints") and not cfg.store.endpoints:
        errors.append("store.endpoints: expected at least one etcd URL, got []")
    for url in cfg.store.endpoints if ok("store.endpoints") else ():
        if not url.startswith(("http://", "https://")):
            errors.append(f"store.endpoints: {url!r} is not an http:// or https:// URL")
    p = cfg.store.prefix
    if ok("store.prefix") and not (p.startswith("/") and p.endswith("/") and len(p) > 1):
        errors.append(f"store.prefix: {p!r} must start and end with '/', e.g. /raps/v1/")
    if (ok("store.cert_file", "store.key_file")
            and bool(cfg.store.cert_file) != bool(cfg.store.key_file)):
        errors.append("store.cert_file: cert_file and key_file must be set together")
    if (ok("store.user", "store.password_file")
            and bool(cfg.store.user) != bool(cfg.store.password_file)):
        errors.append("store.user: user and password_file must be set together")
    domains = cfg.topology.power_domains if ok("topology.power_domains") else {}
    for domain, hostlist in domains.items():
        try:
            NodeSet(hostlist)
        except NodeSetParseError:
            errors.append(f"topology.power_domains.{domain}: {hostlist!r} is not a hostlist "
                          "such as n[1-8]")
    for addr in cfg.coordinator.addresses if ok("coordinator.addresses") else ():
        if parse_address(addr) is None:
            errors.append(f"coordinator.addresses: {addr!r} is not host:port")
    metrics = cfg.coordinator.metrics_address
    if ok("coordinator.metrics_address") and metrics and parse_address(metrics) is None:
        errors.append(f"coordinator.metrics_address: {metrics!r} is not host:port or ''")
    door = cfg.coordinator.user_address
    if ok("coordinator.user_address") and door and parse_address(door, any_port=True) is None:
        errors.append(f"coordinator.user_address: {door!r} is not host:port or ''")
    if (ok("coordinator.heartbeat_address")
            and parse_address(cfg.coordinator.heartbeat_address) is None):
        errors.append(f"coordinator.heartbeat_address: {cfg.coordinator.heartbeat_address!r} "
                      "is not host:port")


def parse_address(addr: str, *, any_port: bool = False) -> tuple[str, int] | None:
    """``host:port`` as (host, port), or None when it is not one (port 0 only if ``any_port``)."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isascii() or not port.isdigit():
        return None
    if not (0 if any_port else 1) <= int(port) < 65536:
        return None
    return host, int(port)


def node_dir(template: str, node: str) -> str:
    """A per-node path: ``%n`` in ``template`` becomes the node name (as in slurm.conf)."""
    return template.replace("%n", node)


def parse_config(data: Any, source: str = "config") -> Config:
    """Build a Config from parsed YAML; raise ConfigError listing every problem: the
    keys' own errors and the cross-key rules among the keys that parsed, in one go."""
    errors: list[str] = []
    failed: set[str] = set()
    cfg = _build(Config, data, "", errors, failed)
    if "" not in failed:  # the file is a mapping: the rules can look at its keys
        _check_pairs(cfg, errors, frozenset(failed))
    if errors:
        raise ConfigError([f"{source}: {e}" for e in errors])
    return typing.cast(Config, cfg)


def read_yaml(path: str | os.PathLike[str],
              error: type[ConfigError] = ConfigError) -> Any:
    """One YAML file's data; ``error`` with one line naming the file (and line) if it cannot
    be read or parsed."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise error([f"{p}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise error([f"{p}: not UTF-8 text (byte {exc.start}): expected a YAML file"]) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error([f"{p}:{where} invalid YAML: {problem}"]) from None


def load_file(path: str | os.PathLike[str]) -> Config:
    """Load and check one YAML file."""
    return parse_config(read_yaml(path), str(Path(path)))


def find_config_path(explicit: str | None = None) -> Path | None:
    """Lookup order: explicit --config, $RAPS_CONFIG, /etc/raps/raps.yaml, else None."""
    if explicit:
        return Path(explicit)
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    if SYSTEM_CONFIG.exists():
        return SYSTEM_CONFIG
    return None


def load_config(explicit: str | None = None) -> Config:
    """Load the effective config following the lookup order; built-in defaults last."""
    path = find_config_path(explicit)
    return load_file(path) if path is not None else Config()


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain YAML/JSON-friendly data (tuples become lists)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_dict(v)
        elif isinstance(v, tuple):
            out[f.name] = list(v)
        elif isinstance(v, dict):
            out[f.name] = dict(v)
        else:
            out[f.name] = v
    return out


def describe() -> list[tuple[str, Any, str]]:
    """Every key path with its default and description, for docs and the reference file."""
    rows: list[tuple[str, Any, str]] = []
    defaults = to_dict(Config())
    for sec in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[sec.name]
        for f in dataclasses.fields(cls):
            rows.append((f"{sec.name}.{f.name}", defaults[sec.name][f.name], f.metadata["doc"]))
    return rows

