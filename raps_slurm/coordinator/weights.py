"""The leader's system-level pass: failure history upkeep and Slurm node weights.

Every ``system.weight_reconcile_sec`` the leader reads the history (``history/``) and the
weights it set (``weights/``), deletes events older than the window, asks Slurm for every
node's weight and applies what :func:`raps_slurm.core.history.reconcile` decides, one
``scontrol update NodeName=... Weight=...`` per node through the runner. Records are
written after the Slurm call succeeded, so a failed call is retried next pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from raps_slurm.config import Config
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.snapshot import read_snapshot
from raps_slurm.core.boost import boost
from raps_slurm.core.history import (
    FailureEvent,
    WeightRecord,
    domain_health,
    expired,
    node_scores,
    reconcile,
)
from raps_slurm.core.jobs import group_to_json
from raps_slurm.errors import NotLeader, RecordError, SlurmCommandError, StoreError
from raps_slurm.model import NodeInfo, Topology
from raps_slurm.store import Keys, StateStore
from raps_slurm.store.base import Delete, Guard, Put, TxnOp

log = logging.getLogger("raps.coordinator.weights")
_OPS_PER_TXN = 64


def record_event(leadership: Leadership, keys: Keys, event: FailureEvent) -> None:
    """Add one verdict to the node's history (a write refused or failed is logged)."""
    try:
        leadership.commit([], [Put(keys.history_event(event.node, event.event_id()),
                                   event.to_json())])
    except (NotLeader, StoreError) as exc:
        log.warning("history event %s %s not recorded: %s", event.kind, event.node, exc)


def read_history(store: StateStore, keys: Keys) -> tuple[list[FailureEvent], list[str]]:
    """Every event in the store, and one line per malformed value (left in place)."""
    events, bad = [], []
    for kv in store.get_prefix(keys.history_prefix()):
        try:
            events.append(FailureEvent.from_json(kv.key, kv.value))
        except RecordError as exc:
            bad.append(str(exc))
    return events, bad


def read_weights(store: StateStore, keys: Keys) -> tuple[dict[str, WeightRecord], list[str]]:
    """The weights this installation set, by node, and malformed values."""
    out, bad = {}, []
    for kv in store.get_prefix(keys.weights_prefix()):
        try:
            rec = WeightRecord.from_json(kv.key, kv.value)
        except RecordError as exc:
            bad.append(str(exc))
            continue
        out[rec.node] = rec
    return out, bad


class Weights:
    """History upkeep and weight reconciliation; call :meth:`step` every loop."""

    def __init__(self, cfg: Config, store: StateStore, keys: Keys, leadership: Leadership,
                 nodes: Callable[[], list[NodeInfo]], topology: Callable[[], Topology | None],
                 set_weight: Callable[[str, int], None],
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 background: bool = False,
                 dead: Callable[[], set[str]] = set) -> None:
        self.cfg, self.store, self.keys, self.leadership = cfg, store, keys, leadership
        self._nodes, self._topology, self._set_weight = nodes, topology, set_weight
        self._clock, self._mono = clock, monotonic
        self._dead = dead
        self._next = 0.0
        self._reported: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights") \
            if background else None
        self._future: Future[list[str]] | None = None

    def step(self) -> list[str]:
        """Start a pass when due and leading (in a thread: Slurm calls take time the
        detector's loop does not have); return what the last finished pass did."""
        out: list[str] = []
        if self._future is not None and self._future.done():
            out = self._future.result()
            self._future = None
        if self._future is None and self._mono() >= self._next and \
                self.leadership.is_leader():
            self._next = self._mono() + self.cfg.system.weight_reconcile_sec
            if self._pool is None:
                return out + self.run_pass()
            self._future = self._pool.submit(self.run_pass)
        return out

    def close(self) -> None:
        """Wait for a pass in flight."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def run_pass(self) -> list[str]:
        """One pass now, whatever the interval; what it did."""
        try:
            return self._pass()
        except NotLeader as exc:
            return [f"weights: stepped down: {exc}"]
        except StoreError as exc:
            return [f"weights: etcd error: {exc}"]

    def _boost(self, events: list[FailureEvent], topo: Topology, now: float) -> list[str]:
        """Extra checkpoint mirrors for the ranks of low-scoring racks (``core.boost``)."""
        sy = self.cfg.system
        racks = topo.racks()
        rack_of = {n: r for r, nodes in sorted(racks.items()) for n in nodes}
        scores = {d: h.score for d, h in domain_health(
            events, racks, now, sy.history_window_h * 3600.0,
            sy.score_half_life_h * 3600.0).items()}
        dead = self._dead()
        done = []
        for job_id, view in sorted(read_snapshot(self.store, self.keys).jobs.items()):
            m = view.rank_map
            if view.record is None or view.record.state != "running" or m is None:
                continue
            groups = {r: g for r, (g, _) in view.groups.items()}
            changes = boost(groups, m.replicas, rack_of, scores, [*m.nodes, *m.spares], dead,
                            sy.boost_below_score, sy.boost_recover_score,
                            sy.boost_extra_replicas)
            items = sorted(changes.items())
            for i in range(0, len(items), _OPS_PER_TXN // 2):
                chunk = items[i:i + _OPS_PER_TXN // 2]
                guards = [Guard(view.groups[r][1].key, view.groups[r][1].mod_revision)
                          for r, _ in chunk]
                ops: list[TxnOp] = [Put(view.groups[r][1].key, group_to_json(g))
                                    for r, g in chunk]
                if self.leadership.commit(guards, ops):
                    for r, g in chunk:
                        old = groups[r]
                        what = ("extra mirror " + g.ckpt_mirrors[-1]
                                if len(g.ckpt_mirrors) > len(old.ckpt_mirrors)
                                else "extra mirror dropped")
                        line = (f"job {job_id} rank {r}: {what} (rack "
                                f"{rack_of.get(g.primary)} score "
                                f"{scores.get(rack_of.get(g.primary, ''), 1.0):.2f})")
                        log.warning("boost: %s", line)
                        done.append(line)
        return done

    def _pass(self) -> list[str]:
        sys_cfg = self.cfg.system
        now = self._clock()
        window = sys_cfg.history_window_h * 3600.0
        events, bad = read_history(self.store, self.keys)
        owned, bad_w = read_weights(self.store, self.keys)
        for line in bad + bad_w:
            if line not in self._reported:
                log.error("skipping malformed value: %s", line)
                self._reported.add(line)
        done = []
        old = expired(events, now, window)
        for i in range(0, len(old), _OPS_PER_TXN):
            chunk = old[i:i + _OPS_PER_TXN]
            self.leadership.commit([], [Delete(self.keys.history_event(e.node, e.event_id()))
                                        for e in chunk])
        if old:
            done.append(f"history: {len(old)} event(s) older than "
                        f"{sys_cfg.history_window_h:g} h deleted")
        topo = self._topology()
        if topo is None:
            return done
        if sys_cfg.boost_extra_replicas:
            done.extend(self._boost(events, topo, now))
        if sys_cfg.weight_step == 0:
            return done
        try:
            infos = self._nodes()
        except SlurmCommandError as exc:
            return [*done, f"weights: cannot read Slurm nodes: {exc}"]
        current = {n.name: n.weight for n in infos}
        scores = node_scores(events, topo.racks(), now, window,
                             sys_cfg.score_half_life_h * 3600.0)
        pinned = {kv.key.rsplit("/", 1)[-1]
                  for kv in self.store.get_prefix(self.keys.weight_pins_prefix())}
        for a in reconcile(current, owned, scores, sys_cfg.weight_step, sys_cfg.weight_levels,
                           now, pinned):
            if a.weight is not None:
                self.leadership.ensure()  # no Slurm side effect from a deposed leader
                try:
                    self._set_weight(a.node, a.weight)
                except SlurmCommandError as exc:
                    log.error("weight of %s not set: %s", a.node, exc)
                    continue
            key = self.keys.weight(a.node)
            op = Put(key, a.record.to_json()) if a.record is not None else Delete(key)
            self.leadership.commit([], [op])
            log.warning("weights: %s: %s", a.node, a.why)
            done.append(f"{a.node}: {a.why}")
        return done
