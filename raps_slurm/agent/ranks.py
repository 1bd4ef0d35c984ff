"""The agent's duties towards its local ranks: relay their progress, fence them.

- **Relay**: every ``detection.app_heartbeat_interval_sec`` the ranks that sent an app
  heartbeat since the last report go to the leader in signed ``AppReport`` datagrams
  (16 ranks each), with each rank's run delay. A rank that stopped heartbeating is absent,
  so the leader's detector sees its silence (HUNG) while the node itself stays ALIVE,
  unless its process still runs or waits for a CPU: starved, not hung, it is reported
  (:mod:`raps_slurm.agent.sched`).
- **Fencing** (defence in depth; epochs are the guarantee, docs/detection.md): once the
  node's validity has run out (no acknowledgement for the miss window *and* etcd out
  of reach), every local rank is killed at once; and a rank whose epoch in etcd is
  newer than its own (relaunched elsewhere) is killed whenever etcd can be read.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from raps_slurm.agent.local_api import RankInfo, RankTable, process_start
from raps_slurm.agent.node import NodeAgent
from raps_slurm.agent.sched import RankLiveness
from raps_slurm.core.jobs import RankEntry
from raps_slurm.errors import RecordError, StoreError
from raps_slurm.store import Keys, StateStore
from raps_slurm.wire.heartbeat import MAX_APP_ENTRIES, AppReport, encode, new_incarnation

log = logging.getLogger("raps.agent")


class RankSupervisor:
    """Relays progress of and fences the ranks in ``table``; call the methods from the loop."""

    def __init__(self, node: NodeAgent, table: RankTable, store: StateStore, keys: Keys,
                 key: bytes) -> None:
        self.node, self.table, self.store, self.keys, self._key = node, table, store, keys, key
        self._incarnation = new_incarnation()
        self._counter = 0
        self._reported_at = time.monotonic()
        self._fenced = False
        self.liveness = RankLiveness()
        self.killed: list[tuple[str, int, str]] = []  # (job, rank, why), for logs and tests

    def report(self) -> int:
        """Send the progress of ranks heard from since the last report, or silent but
        running or waiting for a CPU; returns how many."""
        now = time.monotonic()
        fresh = self.liveness.entries(self.table.snapshot(), self._reported_at)
        self._reported_at = now
        leader = self.node.hb.leader
        if leader is None or not fresh:
            return 0
        for i in range(0, len(fresh), MAX_APP_ENTRIES):
            self._counter += 1
            entries = tuple(fresh[i:i + MAX_APP_ENTRIES])
            report = AppReport(self.node.node, self._incarnation, self._counter, time.time(),
                               entries)
            self.node.send(encode(report, self._key), leader)
        return len(fresh)

    def fence_if_invalid(self) -> bool:
        """Kill every local rank once the node's validity ran out; True if it did."""
        if self.node.valid_for() > 0:
            self._fenced = False
            return False
        ranks = self.table.snapshot()
        if ranks and not self._fenced:
            log.error("fencing: no acknowledgement and no etcd for the miss window: "
                      "killing %d local ranks", len(ranks))
        for r in ranks:
            self._kill(r, "node fenced itself (no ack, no etcd)")
        self._fenced = True
        return bool(ranks)

    def kill_superseded(self) -> int:
        """Kill local ranks whose epoch in etcd is newer than theirs; returns how many."""
        killed = 0
        for r in self.table.snapshot():
            try:
                kv = self.store.get(self.keys.job_rank(r.job, r.rank))
            except StoreError:
                return killed  # etcd away: fence_if_invalid covers it
            if kv is None:
                continue
            try:
                epoch = RankEntry.from_json(kv.key, kv.value).epoch
            except RecordError as exc:
                log.warning("%s", exc)
                continue
            if epoch > r.epoch:
                self._kill(r, f"superseded by epoch {epoch}")
                killed += 1
        return killed

    def _kill(self, r: RankInfo, why: str) -> None:
        if r.start_time is not None and process_start(r.pid) != r.start_time:
            self.table.remove(r.job, r.rank)  # that process is gone; its pid may be reused
            return
        try:
            os.kill(r.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except OSError as exc:
            log.error("cannot kill rank %s.%d (pid %d): %s", r.job, r.rank, r.pid, exc)
            return
        self.table.remove(r.job, r.rank)
        self.killed.append((r.job, r.rank, why))
        log.warning("killed rank %d of job %s (pid %d, epoch %d): %s", r.rank, r.job, r.pid,
                    r.epoch, why)
