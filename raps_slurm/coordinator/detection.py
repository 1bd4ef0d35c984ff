"""The leader's detection loop: heartbeats in, probes out, verdicts to etcd and Slurm.

Runs every quarter heartbeat interval in the coordinator's main thread. The decisions
are ``core.detector``'s and ``core.health``'s (probe samples the agents write to
``nodes/<node>/health``; a DRAIN level drains the node with the policy's reason); this
module feeds them and applies their verdicts:
- every verdict is written to ``nodes/<node>/verdict`` with its evidence (a
  leader-guarded write: a deposed leader's verdict is refused by etcd);
- a DEAD node is drained in Slurm at once (``Reason="raps: dead: ..."``), after
  checking the leader lease by the local clock, in a worker thread so that a slow
  ``scontrol`` never delays the next tick. A node an admin drained is left alone.
The heartbeat server's replay guard forgets a node when its registration goes (the
membership lease expired), when it registers a new incarnation and when it is declared
DEAD, so no sequence number, not even a wrong one, keeps a node out for ever. A node's
address is the source of its last heartbeat verified with its own key (the registration's
address serves only until then).
A coordinator that stops leading drops its detector: the next leader starts a fresh
one, which gives no DEAD verdict before a miss window + fence margin has passed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from raps_slurm.config import Config
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.heartbeats import HeartbeatServer, ReceivedApp
from raps_slurm.coordinator.metrics import Metrics
from raps_slurm.core.detector import Detector, DetectorSettings, Verdict
from raps_slurm.core.health import (
    HealthLevel,
    HealthPolicy,
    HealthSettings,
    door_rejections,
)
from raps_slurm.core.history import FailureEvent
from raps_slurm.errors import NotLeader, SlurmCommandError, StoreError
from raps_slurm.model import NodeInfo
from raps_slurm.store import Keys, Put, StateStore
from raps_slurm.store.follow import PrefixFollower

log = logging.getLogger("raps.coordinator")

RAPS_REASON = "raps:"


class Detection:
    """Feeds the detector while this coordinator leads; call ``tick()`` often."""

    def __init__(self, cfg: Config, store: StateStore, keys: Keys, leadership: Leadership,
                 server: HeartbeatServer, node_info: Callable[[str], NodeInfo],
                 drain: Callable[[str, str], None], clock: Callable[[], float] = time.time,
                 registry_every: float | None = None, metrics: Metrics | None = None) -> None:
        self.cfg, self.store, self.keys, self.leadership = cfg, store, keys, leadership
        self.server, self._node_info, self._drain = server, node_info, drain
        self._clock = clock
        self.settings = DetectorSettings.from_config(cfg.detection)
        self.detector: Detector | None = None
        self._addresses: dict[str, tuple[str, int]] = {}
        self._incarnations: dict[str, object] = {}  # node -> incarnation it registered
        self._outstanding: dict[str, list[float]] = {}  # node -> send times of open probes
        self._nonce = 0
        # Node registrations and health samples are read together, at most as often as
        # agents write samples (and at least every 2 s, to watch new nodes soon).
        self._registry_every = registry_every if registry_every is not None else min(
            2.0, cfg.detection.telemetry_interval_sec)
        self.health: HealthPolicy | None = None
        self._nodes: PrefixFollower | None = None
        self._slurm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurm-side-effects")
        self.verdicts: list[Verdict] = []  # every verdict applied (metrics, tests)
        self._outages = 0  # leadership.outages when the detector last (re)started
        self._unrecorded = False  # a verdict failed to reach etcd
        self.metrics = metrics
        self._finished: frozenset[tuple[str, int]] = frozenset()
        self._placed: frozenset[str] = frozenset()
        self._placed_watched: tuple[Detector | None, frozenset[str]] = (None, frozenset())

    def finished_ranks(self, ranks: frozenset[tuple[str, int]]) -> None:
        """The ranks (job, rank) that finished their program in their current epoch (from
        the coordinator's cycle thread): not watched for hangs. A rank relaunched with a
        new epoch leaves the set and is watched again from its next heartbeat."""
        self._finished = ranks

    def placed_nodes(self, nodes: frozenset[str]) -> None:
        """The nodes that hold ranks of running jobs (from the coordinator's cycle thread):
        watched even if they never registered with this leader. An agent that stopped or
        crashed before this leader was elected, its registration gone with its lease,
        still gets its DEAD verdict, so its ranks move."""
        if nodes != self._placed:  # the same set kept: the next tick need not watch again
            self._placed = nodes

    def step_of(self, job: str, rank: int) -> int | None:
        """The last step a rank reported to this leader's detector (None: none, or not
        the leader): what a recovery plan records as the rank's pre-fault progress."""
        det = self.detector
        return None if det is None else det.step_of(job, rank)

    def close(self) -> None:
        """Stop following nodes/ and wait for pending Slurm side effects."""
        if self._nodes is not None:
            self._nodes.cancel()
        self._slurm.shutdown(wait=True)

    def tick(self) -> list[str]:
        """One detection step; returns one line per verdict."""
        now = self._clock()
        received = self.server.drain()
        if not self.leadership.is_leader():
            if self.detector is not None:
                log.info("detector dropped: not the leader")
            self.detector = self.health = None
            if self._nodes is not None:
                self._nodes.cancel()
                self._nodes = None
            return []
        if self.detector is not None and (self._outages != self.leadership.outages
                                          or self._unrecorded):
            # An agent that proved etcd had no quorum kept its ranks for a miss window
            # past that proof; a verdict not written would never reach recovery. A fresh
            # detector waits the miss window + margin again, then finds what is dead.
            log.warning("detector restarted after an etcd outage: no DEAD verdict before "
                        "%.1fs", self.settings.miss_window + self.settings.fence_margin)
            self.detector = None
        self._outages, self._unrecorded = self.leadership.outages, False
        if self.detector is None:
            self.detector = Detector(self.settings, now)
            self.health = HealthPolicy(HealthSettings.from_config(self.cfg.detection))
            if self._nodes is not None:  # a new detector knows no node: read them all
                self._nodes.cancel()
                self._nodes = None
            log.info("detector started: no DEAD verdict before %.1fs", self.settings.miss_window
                     + self.settings.fence_margin)
        det = self.detector
        self._watch_registered(det, now)
        placed = self._placed
        if self._placed_watched[0] is not det or self._placed_watched[1] is not placed:
            for node in placed:
                det.watch(node, now)  # idempotent: silence counts from the first watch
            self._placed_watched = (det, placed)
        for r in received:
            if isinstance(r, ReceivedApp):
                for p in r.ranks:
                    det.app_heartbeat(str(p.job), p.rank, r.node, p.step, p.blocked_on, now,
                                      waited_ms=p.waited_ms)
                continue
            self._addresses[r.node] = r.address
            # The fence deadline counts from the receive time, on this clock: it is after
            # the send in real time, so no offset between host clocks can make it early.
            det.heartbeat(r.node, r.received_at, now, acked=r.acked)
            if r.probe_reply:
                self._outstanding.pop(r.node, None)  # one answer settles every open probe
                det.probe_result(r.node, True, now)
        det.ranks_finished(self._finished)  # a finished rank heartbeats until it closes
        timeout = self.settings.probe_timeout
        for node, sent in list(self._outstanding.items()):
            while sent and now - sent[0] >= timeout:
                det.probe_result(node, False, now, sent_at=sent.pop(0))
            if not sent:
                del self._outstanding[node]
        for node in det.probes_due(now):
            address = self._addresses.get(node)
            if address is None:
                # Neither registered nor heard from since this leader started: its agent
                # holds no membership lease, which is the second channel's answer.
                det.probe_result(node, False, now)
            else:
                self._nonce += 1
                self.server.send_probe(node, address, self._nonce)
                self._outstanding.setdefault(node, []).append(now)
        return [self._apply(v) for v in det.tick(now)]

    def next_wakeup(self, now: float) -> float:
        """Seconds until the detector needs the next tick (probes, deadlines)."""
        if self.detector is None:
            return self.settings.interval / 4
        at = self.detector.next_wakeup()
        pending = [sent[0] + self.settings.probe_timeout for sent in self._outstanding.values()]
        soonest = min([t for t in (at, *pending) if t is not None], default=now + 1.0)
        return max(0.0, min(self.settings.interval / 4, soonest - now))

    def _watch_registered(self, det: Detector, now: float) -> None:
        """Follow ``nodes/`` (registrations and health samples): one full read, then a
        watch; on a store error the next tick reads it all again."""
        if self._nodes is None:
            self._nodes = PrefixFollower(self.store, self.keys.nodes_prefix(),
                                         self._registry_every)
        changes = self._nodes.poll()
        for event in changes.events if changes is not None else ():
            if event.kind == "put":
                self._node_key(det, event.key, event.value, now)
            else:
                parts = self.keys.split(event.key)
                if len(parts) == 2 and self._incarnations.pop(parts[1], None) is not None:
                    self.server.forget(parts[1])  # its membership lease expired

    def _node_key(self, det: Detector, key: str, value: bytes, now: float) -> None:
        """A registration (watch the node, learn its address) or a health sample."""
        parts = self.keys.split(key)
        if len(parts) == 3 and parts[2] == "health":
            self._observe_health(parts[1], value, now)
        if len(parts) != 2:
            return
        node = parts[1]
        try:
            registration = json.loads(value)
            incarnation = registration.get("incarnation", 0)
            if self._incarnations.get(node) != incarnation:
                # A new agent (or its first sight): what the guard knew was another life's.
                self._incarnations[node] = incarnation
                self.server.forget(node)
            host, _, port = str(registration["udp"]).rpartition(":")
            # Only until a heartbeat verified with the node's key gives its real source.
            self._addresses.setdefault(node, (host, int(port)))
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("node registration %s has no usable udp address", key)
        det.watch(node, now)

    def _observe_health(self, node: str, raw: bytes, now: float) -> None:
        if self.health is None:
            return
        try:
            sample = json.loads(raw)
            if not isinstance(sample, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            log.warning("nodes/%s/health: malformed sample (%s)", node, exc)
            return
        counts, problems = door_rejections(sample)
        for problem in problems:
            log.warning("nodes/%s/health: %s", node, problem)
        if self.metrics is not None:
            self.metrics.set_agent_rejections(node, counts)
        verdict = self.health.observe(node, sample, now)
        if verdict is None:
            return
        record = json.dumps({"level": verdict.level, "previous": verdict.previous,
                             "score": verdict.score, "reason": verdict.reason,
                             "at": verdict.at, "conditions": list(verdict.conditions)}).encode()
        ops = [Put(self.keys.node_health_verdict(node), record)]
        if verdict.level == HealthLevel.DRAIN:
            event = FailureEvent("DRAIN", node, verdict.at, verdict.reason)
            ops.append(Put(self.keys.history_event(node, event.event_id()), event.to_json()))
        try:
            self.leadership.commit([], ops)
        except (NotLeader, StoreError) as exc:
            log.warning("health verdict for %s not recorded: %s", node, exc)
        log.warning("health: %s %s -> %s (score %d): %s", node, verdict.previous,
                    verdict.level, verdict.score, verdict.reason)
        if verdict.level == HealthLevel.DRAIN:
            self._slurm.submit(self._drain_node, node, verdict.reason)

    def _apply(self, v: Verdict) -> str:
        where = f"{v.job}.{v.rank}" if v.job is not None else v.node
        line = f"{v.kind} {where}"
        record = json.dumps({"kind": v.kind, "node": v.node, "job": v.job, "rank": v.rank,
                             "at": v.at, "evidence": dict(v.evidence)}, default=str).encode()
        key = (self.keys.node_verdict(v.node) if v.job is None or v.rank is None
               else self.keys.job_hung_verdict(v.job, v.rank))
        ops = [Put(key, record)]
        if v.kind in ("DEAD", "HUNG"):  # the failure history the weights come from
            event = FailureEvent(v.kind, v.node, v.at, where)
            ops.append(Put(self.keys.history_event(v.node, event.event_id()), event.to_json()))
        try:
            self.leadership.commit([], ops)
        except NotLeader as exc:
            log.warning("verdict %s not recorded: %s", line, exc)
        except StoreError as exc:
            log.warning("verdict %s not recorded: %s", line, exc)
            self._unrecorded = True
        log.warning("verdict: %s %s", line, json.dumps(dict(v.evidence), default=str))
        self.verdicts.append(v)
        if self.metrics is not None:
            self.metrics.verdicts.labels(v.kind).inc()
            last = v.evidence.get("last_heartbeat_received_at")
            if v.kind == "DEAD" and isinstance(last, (int, float)):
                self.metrics.detect_latency.observe(v.at - last)
        if v.kind == "DEAD":
            self.server.forget(v.node)  # whatever it sends next starts afresh
            last = v.evidence.get("last_heartbeat_received_at")
            since = time.strftime("%H:%M:%S", time.localtime(
                last if isinstance(last, (int, float)) else v.at))
            self._slurm.submit(self._drain_node, v.node, f"{RAPS_REASON} dead: no heartbeat "
                               f"since {since}")
        return line

    def _drain_node(self, node: str, reason: str) -> None:
        """Drain ``node`` in Slurm unless it is drained already (an admin's drain stays)."""
        try:
            self.leadership.ensure()  # no Slurm side effect from a leader that may be deposed
            info = self._node_info(node)
            if "DRAIN" in info.state_text.upper():
                if not info.reason.startswith(RAPS_REASON):
                    log.info("%s was drained by an admin (%s): left alone", node, info.reason)
                    return
                if info.reason == reason:
                    return
                # Drained by RAPS for another reason: say the newest one.
            self._drain(node, reason)
            log.warning("drained %s in Slurm: %s", node, reason)
        except NotLeader as exc:
            log.warning("not draining %s: %s", node, exc)
        except SlurmCommandError as exc:
            log.error("draining %s failed: %s", node, exc)
