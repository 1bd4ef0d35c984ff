"""Prometheus metrics of the coordinator (``coordinator.metrics_address``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from raps_slurm.config import parse_address
from raps_slurm.errors import ConfigError


class Metrics:
    """The coordinator's metrics in their own registry (several coordinators per test process)."""

    def __init__(self, address: str | None) -> None:
        self.registry = CollectorRegistry()
        self.leader = Gauge("raps_coordinator_leader", "1 while this coordinator leads",
                            registry=self.registry)
        self.jobs = Gauge("raps_coordinator_jobs_registered",
                          "RAPS job runs registered in etcd (leader's last snapshot)",
                          registry=self.registry)
        self.groups = Counter("raps_coordinator_groups_built",
                              "backup groups built for rank maps", registry=self.registry)
        self.cycles = Counter("raps_coordinator_cycles", "cycles run", registry=self.registry)
        self.heartbeats = Counter("raps_coordinator_heartbeats",
                                  "heartbeat datagrams by result (accepted or why dropped)",
                                  ["result"], registry=self.registry)
        self.verdicts = Counter("raps_coordinator_verdicts", "detector verdicts by kind",
                                ["kind"], registry=self.registry)
        self.detect_latency = Histogram(
            "raps_coordinator_detect_latency_seconds",
            "DEAD verdict time minus the node's last heartbeat received",
            buckets=(0.5, 1, 2, 3, 3.5, 4, 4.5, 5, 7.5, 10, 20, 60), registry=self.registry)
        self.etcd_db = Gauge("raps_etcd_db_bytes", "etcd database size (dbSize) as the leader "
                             "last read it", registry=self.registry)
        self.etcd_db_in_use = Gauge("raps_etcd_db_in_use_bytes", "etcd database bytes in use",
                                    registry=self.registry)
        self.etcd_quota = Gauge("raps_etcd_quota_bytes", "store.space_quota_bytes, etcd's "
                                "--quota-backend-bytes (0 = unknown)", registry=self.registry)
        self.reports_paused = Gauge("raps_coordinator_reports_paused", "jobs whose reports "
                                    "the leader paused (etcd above "
                                    "store.report_watermark_share)", registry=self.registry)
        self.report_pauses = Counter("raps_coordinator_report_pauses", "times the leader "
                                     "paused a job's reports", registry=self.registry)
        # What the leader's cycle sees (slurm/prometheus/raps.rules.yml alerts on these).
        self.nodes_dead = Gauge("raps_coordinator_nodes_dead",
                                "nodes under a DEAD verdict and not registered since",
                                registry=self.registry)
        self.ckpt_under_replicated = Gauge(
            "raps_coordinator_ckpt_under_replicated", "ranks of running jobs whose newest "
            "checkpoint has fewer copies than wanted", registry=self.registry)
        self.escalations = Counter("raps_coordinator_escalations", "recoveries escalated to a "
                                   "whole-job requeue (one per job run)", registry=self.registry)
        self.malformed = Counter("raps_coordinator_malformed_values", "job values the leader "
                                 "skipped as malformed (each counted once)",
                                 registry=self.registry)
        self.reports_refused = Counter(
            "raps_coordinator_reports_refused", "reports about a job from a node not of the "
            "job, ignored (each counted once)", registry=self.registry)
        self.agent_rejected = Gauge(
            "raps_agent_rejected", "what an agent's door (transfer, local_api, heartbeat) "
            "refused since the agent started, by kind, from its last health sample",
            ["node", "door", "kind"], registry=self.registry)
        self.user_requests = Counter("raps_coordinator_user_requests",
                                     "requests at the user door by result (served or why "
                                     "refused)", ["result"], registry=self.registry)
        self._heartbeat_children: dict[str, Counter] = {}
        if address:
            parsed = parse_address(address)
            if parsed is None:
                raise ConfigError([f"metrics address {address!r} is not host:port"])
            try:
                start_http_server(parsed[1], parsed[0], registry=self.registry)
            except OSError as exc:
                raise ConfigError([f"metrics address {address}: {exc.strerror or exc}"]) from None

    def set_agent_rejections(self, node: str, counts: dict[tuple[str, str], int]) -> None:
        """The counts of one node's last health sample (cumulative in the agent)."""
        for (door, kind), count in counts.items():
            self.agent_rejected.labels(node, door, kind).set(count)

    def count_user(self, result: str) -> None:
        """Count one user door request by result."""
        self.user_requests.labels(result).inc()

    def count_heartbeat(self, result: str, count: int = 1) -> None:
        """Count datagrams by result; the label child is cached (called per batch)."""
        child = self._heartbeat_children.get(result)
        if child is None:
            child = self._heartbeat_children.setdefault(result, self.heartbeats.labels(result))
        child.inc(count)
