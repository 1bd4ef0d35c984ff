"""One coordinator cycle: read one snapshot, decide with ``core``, apply with guarded writes.

``run_cycle()`` returns a status string (logged, and asserted by the tests), in the
manner of patroni's HA loop. Decisions live in ``raps_slurm.core.jobs``; this module
only reads etcd and Slurm and writes what was decided.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from raps_slurm.config import Config
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.metrics import Metrics
from raps_slurm.coordinator.snapshot import JobView, Snapshot, job_nodes, members, read_snapshot
from raps_slurm.core.jobs import (
    FINAL_STATES,
    JobRecord,
    MapPlan,
    build_map,
    group_to_json,
    purge_due,
)
from raps_slurm.core.placement import BackupLoads, replace_dead_backups
from raps_slurm.core.planner import Plan
from raps_slurm.core.planner import summarize as planner_summarize
from raps_slurm.errors import (
    NotLeader,
    PlacementError,
    RecordError,
    SlurmCommandError,
    StoreError,
    StoreUnavailable,
)
from raps_slurm.model import BackupGroup, Topology
from raps_slurm.store import MAX_TXN_OPS, Delete, Guard, Keys, KeyValue, Put, StateStore, TxnOp

log = logging.getLogger("raps.coordinator")

_RANKS_PER_TXN = (MAX_TXN_OPS - 2) // 2  # a rank entry and a group each, room for deletes


def placed_nodes(records: dict[str, JobView]) -> set[str]:
    """The nodes that hold ranks of running jobs: each rank's entry, else its mapping."""
    nodes: set[str] = set()
    for view in records.values():
        if view.record is None or view.record.state != "running":
            continue
        m = view.rank_map
        mapped = m.nodes if m is not None and not m.error else ()
        nodes.update(node for rank, node in enumerate(mapped) if rank not in view.entries)
        nodes.update(entry.node for entry, _ in view.entries.values())
    return nodes


class Coordinator:
    """The coordinator's state between cycles and the cycle itself."""

    def __init__(self, cfg: Config, store: StateStore, keys: Keys, leadership: Leadership,
                 topology: Callable[[], Topology], job_states: Callable[[], dict[str, str]],
                 metrics: Metrics | None = None, name: str = "",
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 background: bool = False,
                 dead_nodes: Callable[[], set[str]] | None = None,
                 recovery: Any = None,
                 finished_ranks: Callable[[frozenset[tuple[str, int]]], None] | None = None,
                 placed_nodes: Callable[[frozenset[str]], None] | None = None
                 ) -> None:
        self.cfg, self.store, self.keys, self.leadership = cfg, store, keys, leadership
        # told each cycle which ranks finished their program in their current epoch: the
        # detector stops watching them (their silence is the end of the job, not a hang)
        self._finished_ranks = finished_ranks
        # told each cycle which nodes hold ranks of running jobs: the detector watches them
        # even when they never registered with this leader (an agent gone before it led)
        self._placed_nodes = placed_nodes
        self._read_topology, self._read_job_states = topology, job_states
        self.metrics = metrics or Metrics(None)
        self.name = name
        self._clock, self._mono = clock, monotonic
        self._topology: Topology | None = None
        self._topology_at = -1e18
        self._topology_error = ""
        self._states: dict[str, str] | None = None
        self._states_at = -1e18  # when the states in hand were asked for
        self._asked_at = -1e18
        self._states_future: Future[dict[str, str]] | None = None
        self._topology_future: Future[Topology] | None = None
        self._pool = (ThreadPoolExecutor(max_workers=2, thread_name_prefix="slurm-reads")
                      if background else None)
        self._final_since: dict[str, float] = {}
        self._tombstones_at = -1e18
        self._first_seen: dict[str, float] = {}  # monotonic, first snapshot naming the job
        self._reported_bad: set[str] = set()
        self._dead_nodes = dead_nodes or (lambda: set())
        self.recovery = recovery  # coordinator.recovery.Recovery (it imports this module)
        self._escalations_seen: set[tuple[str, int]] | None = None  # (job, run), last snapshot

    @property
    def topology(self) -> Topology | None:
        """The switch tree as last read from Slurm (None before the first read)."""
        return self._topology

    def run_cycle(self) -> str:
        """One cycle; returns what it did as one line."""
        self.metrics.cycles.inc()
        try:
            leading = self.leadership.step()
        except StoreError as exc:
            self.metrics.leader.set(0)
            return f"etcd unavailable: {exc}"
        self.metrics.leader.set(1 if leading else 0)
        if not leading:
            lost = self.leadership.lost_reason
            who = self.leadership.leader_name or "none"
            return f"standby: leader is {who}" + (f" ({lost})" if lost else "")
        try:
            return self._lead()
        except NotLeader as exc:
            self.metrics.leader.set(0)
            return f"stepped down: {exc}"
        except StoreError as exc:
            if isinstance(exc, StoreUnavailable):
                self.leadership.note_outage()
            return f"leader: etcd error: {exc}"

    def _lead(self) -> str:
        self._topology_now()  # read ahead: a job arriving later is mapped without waiting
        snap = read_snapshot(self.store, self.keys)
        for line in snap.bad:
            if line not in self._reported_bad:
                log.error("skipping malformed value: %s", line)
                self._reported_bad.add(line)
                self.metrics.malformed.inc()
        for line in snap.refused:
            if line not in self._reported_bad:
                log.warning("ignoring a report: %s", line)
                self._reported_bad.add(line)
                self.metrics.reports_refused.inc()
        records = {j: v for j, v in snap.jobs.items() if v.record is not None}
        now = self._mono()
        for job_id in records:
            self._first_seen.setdefault(job_id, now)
        for job_id in set(self._first_seen) - set(records):
            del self._first_seen[job_id]
        self.metrics.jobs.set(len(records))
        if self._finished_ranks is not None:
            self._finished_ranks(frozenset(
                (job_id, rank) for job_id, view in records.items()
                for rank, epoch in view.done.items() if view.epochs.get(rank) == epoch))
        if self._placed_nodes is not None:
            self._placed_nodes(frozenset(placed_nodes(records)))
        done: list[str] = []
        for job_id in sorted(records, key=int):
            view = records[job_id]
            assert view.record is not None
            m = view.rank_map
            if view.record.state == "running" and (
                    m is None or m.restart_count != view.record.restart_count):
                done.append(self._map(view))
        done.extend(self._repair_groups(records))
        if self.recovery is not None:
            dead = self._dead_nodes()
            done.extend(self.recovery.step(records, dead,
                                           set(getattr(self._dead_nodes, "unhealthy", ())),
                                           dict(getattr(self._dead_nodes, "dead_at", {})),
                                           self._topology,
                                           getattr(self._dead_nodes, "registered", None),
                                           dict(getattr(self._dead_nodes, "draining", {}))))
        self._gauge_alerts(snap)
        done.extend(self._purge(snap))
        return f"leader: {len(records)} jobs" + "".join(f"; {d}" for d in done if d)

    def _gauge_alerts(self, snap: Snapshot) -> None:
        """What the alerting rules (slurm/prometheus/raps.rules.yml) watch, from this
        cycle's snapshot: dead nodes, running jobs' ranks whose newest checkpoint is
        under-replicated, and escalations (one per job run) that appeared since this
        leader's first snapshot (those already there when it began are not counted)."""
        self.metrics.nodes_dead.set(len(self._dead_nodes()))
        under = 0
        escalations: set[tuple[str, int]] = set()
        for job, view in snap.jobs.items():
            if view.record is not None and view.record.state == "running":
                under += sum(max(recs, key=lambda r: r.generation).state == "under_replicated"
                             for recs in view.ckpts.values() if recs)
            if view.escalation is not None:
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    escalations.add((job, int(json.loads(view.escalation.value)["run"])))
        self.metrics.ckpt_under_replicated.set(under)
        if self._escalations_seen is not None:
            self.metrics.escalations.inc(len(escalations - self._escalations_seen))
        self._escalations_seen = escalations

    # -- backup groups after a node death ------------------------------------

    def _repair_groups(self, jobs: dict[str, JobView]) -> list[str]:
        """Replace dead backups in the groups of running jobs (agents then re-replicate)."""
        dead = self._dead_nodes()
        if not dead:
            return []
        topology = self._topology
        done = []
        for job_id, view in sorted(jobs.items()):
            m = view.rank_map
            if m is None or view.record is None or view.record.state != "running" or \
                    topology is None:
                continue
            loads: dict[str, int] = {}
            for g, _ in view.groups.values():
                for b in (g.log_backup, *g.ckpt_mirrors):
                    if b:
                        loads[b] = loads.get(b, 0) + 1
            pool = [*m.nodes, *m.spares]
            index = BackupLoads.of(topology, pool, loads)  # updated by each replacement
            ops: list[TxnOp] = []
            guards: list[Guard] = []
            # Ranks of one node share one group: the replacement is chosen once per group
            # (its members) and given to every rank holding it.
            replaced: dict[tuple[str, str | None, tuple[str, ...]], BackupGroup | None] = {}
            for rank, (g, kv) in sorted(view.groups.items()):
                shape = (g.primary, g.log_backup, g.ckpt_mirrors)
                if shape not in replaced:
                    try:
                        replaced[shape] = replace_dead_backups(topology, g, dead, pool, index)
                    except PlacementError as exc:
                        log.warning("job %s rank %d: cannot replace dead backups: %s",
                                    job_id, rank, exc)
                        replaced[shape] = None
                chosen = replaced[shape]
                if chosen is None:
                    continue
                new = dataclasses.replace(chosen, rank=rank)
                guards.append(Guard(kv.key, kv.mod_revision))
                ops.append(Put(kv.key, group_to_json(new)))
                log.warning("job %s rank %d: backup group %s -> %s (dead: %s)", job_id, rank,
                            members(g), members(new), ", ".join(sorted(dead & set(members(g)))))
                if len(ops) >= _RANKS_PER_TXN:
                    break  # the rest next cycle
            if ops:
                self.leadership.commit(guards, ops)
                done.append(f"job {job_id}: {len(ops)} group(s) off dead nodes")
        return done

    # -- rank maps ------------------------------------------------------------

    def _topology_now(self) -> Topology | None:
        """The cached topology, re-read every ``topology_refresh_sec`` (in the background
        with ``background``: a slow scontrol must not stop the loop that keeps the lease)."""
        now = self._mono()
        pending = self._topology_future
        if pending is not None and pending.done():
            self._topology_future = None
            try:
                self._topology, self._topology_error = pending.result(), ""
                self._topology_at = now
            except SlurmCommandError as exc:
                self._topology_error = str(exc)  # keep the cached one; retry next cycle
        refresh = self.cfg.coordinator.topology_refresh_sec
        due = self._topology is None or now - self._topology_at >= refresh
        if due and self._topology_future is None:
            if self._pool is not None:
                self._topology_future = self._pool.submit(self._read_topology)
            else:
                try:
                    self._topology, self._topology_error = self._read_topology(), ""
                    self._topology_at = now
                except SlurmCommandError as exc:
                    self._topology_error = str(exc)
        return self._topology

    def _map(self, view: JobView) -> str:
        record, kv = view.record, view.record_kv
        assert record is not None and kv is not None
        topo = self._topology_now()
        if topo is None:
            why = self._topology_error or "being read"
            return f"job {record.job_id} waits for the topology ({why})"
        # Never a rank on a node whose agent is dead, gone or draining, even if Slurm
        # allocated it (an admin resumed it while its agent is silent): its ranks could
        # not reach their agent. The run uses a spare fewer instead.
        dead = self._dead_nodes()
        fitness = getattr(self._dead_nodes, "fitness", None)
        unfit, doubtful = fitness(record.nodes, record.registered_at) if fitness is not None \
            else ({}, {})
        plan = build_map(record, topo, default_replicas=self.cfg.checkpoint.replica_count,
                         now=self._clock(), previous_epochs=view.epochs,
                         previous_placed={r: ((e.epoch, e.node), *e.placed)
                                          for r, (e, _) in view.entries.items()},
                         prefer_original_rack=self.cfg.recovery.prefer_original_rack,
                         dead=dead, unfit=unfit, doubtful=doubtful)
        plan = dataclasses.replace(
            plan, rank_map=dataclasses.replace(plan.rank_map, built_by=self.name))
        if not self._write_map(record, kv, plan, view.ranks):
            return f"job {record.job_id} changed while mapping; retry next cycle"
        m = plan.rank_map
        if m.error:
            log.error("job %s run %d cannot be mapped: %s", m.job_id, m.restart_count, m.error)
            return f"job {m.job_id}: map error"
        self.metrics.groups.inc(len(plan.groups))
        degraded = sum(g.degraded for g in plan.groups)
        unused = sorted(set(record.nodes) - set(m.nodes) - set(m.spares))
        kept = [f"{n} ({why})" for n, why in sorted({**doubtful, **unfit}.items())
                if n not in m.nodes]
        log.info("job %s run %d: %d ranks on %d nodes, spares %s, %d degraded groups%s%s",
                 m.job_id, m.restart_count, len(m.nodes), len(set(m.nodes)),
                 ",".join(m.spares) or "-", degraded,
                 f"; unused (DEAD): {','.join(unused)}" if unused else "",
                 f"; no ranks on {', '.join(kept)}" if kept else "")
        return f"mapped job {m.job_id} ({len(m.nodes)} ranks, {len(m.spares)} spares)"

    def _write_map(self, record: JobRecord, kv: KeyValue, plan: MapPlan, old_ranks: int) -> bool:
        """Ranks and groups in chunks, the map last (readers trust a job with a map)."""
        guard = Guard(kv.key, kv.mod_revision)  # the run we map is still the registered one
        job = record.job_id
        chunks: list[list[TxnOp]] = []
        pairs = list(zip(plan.entries, plan.groups, strict=True))
        for i in range(0, len(pairs), _RANKS_PER_TXN):
            ops: list[TxnOp] = []
            for entry, group in pairs[i:i + _RANKS_PER_TXN]:
                ops.append(Put(self.keys.job_rank(job, entry.rank), entry.to_json()))
                ops.append(Put(self.keys.job_group(job, entry.rank), group_to_json(group)))
            chunks.append(ops)
        stale = [r for r in range(len(pairs), old_ranks)]  # a previous run had more ranks
        for i in range(0, len(stale), MAX_TXN_OPS // 2):
            chunks.append([op for r in stale[i:i + MAX_TXN_OPS // 2]
                           for op in (Delete(self.keys.job_rank(job, r)),
                                      Delete(self.keys.job_group(job, r)))])
        chunks.append([Put(self.keys.job_map(job), plan.rank_map.to_json())])
        return all(self.leadership.commit([guard], ops) for ops in chunks)

    # -- clean-up of finished jobs --------------------------------------------

    def _job_states(self) -> dict[str, str] | None:
        """Slurm's job states as last read; ``_states_at`` is when that read was asked for.

        With ``background`` the read runs in a worker thread: a slow or hanging squeue
        (up to the runner's timeout) must not stop the loop that keeps the leader lease.
        """
        now = self._mono()
        pending = self._states_future
        if pending is not None and pending.done():
            self._states_future = None
            self._states_at = self._asked_at
            try:
                self._states = pending.result()
            except SlurmCommandError as exc:
                log.warning("cannot read job states from Slurm: %s", exc)
                self._states = None  # no purge decision without Slurm's word
        if self._states_future is None and now - self._asked_at >= \
                self.cfg.coordinator.slurm_poll_sec:
            self._asked_at = now
            if self._pool is not None:
                self._states_future = self._pool.submit(self._read_job_states)
            else:
                self._states_at = now
                try:
                    self._states = self._read_job_states()
                except SlurmCommandError as exc:
                    log.warning("cannot read job states from Slurm: %s", exc)
                    self._states = None
        return self._states

    def _purge(self, snap: Snapshot) -> list[str]:
        states = self._job_states()
        if states is None:
            return []
        now, grace = self._clock(), self.cfg.coordinator.purge_grace_sec
        out = []
        for job_id, view in snap.jobs.items():
            if view.record is None or view.record_kv is None:
                continue
            state = states.get(job_id)
            if state is None and self._states_at <= self._first_seen.get(job_id, 0.0):
                continue  # registered after Slurm was last asked: its absence means nothing
            if state is None or state in FINAL_STATES:
                self._final_since.setdefault(job_id, now)
            else:
                self._final_since.pop(job_id, None)
            if not purge_due(view.record, state, self._final_since.get(job_id), now, grace):
                continue
            guard = Guard(view.record_kv.key, view.record_kv.mod_revision)
            tombstone = json.dumps({"job_id": job_id, "nodes": list(view.record.nodes),
                                    "purged_at": now,
                                    "recoveries": self._plan_summary(job_id)}).encode()
            k = self.keys
            if self.leadership.commit([guard], [Delete(k.job_prefix(job_id), prefix=True),
                                                Delete(k.job(job_id)),
                                                Delete(k.job_reports_prefix(job_id), prefix=True),
                                                Delete(k.job_plans_prefix(job_id), prefix=True),
                                                Delete(k.job_cancels_prefix(job_id),
                                                       prefix=True),
                                                Put(k.purged(job_id), tombstone)]):
                self._final_since.pop(job_id, None)
                self._purge_node_reports(job_id, job_nodes(view))
                log.info("job %s finished for good (%s): keys deleted after %gs grace",
                         job_id, state or "gone from Slurm", grace)
                out.append(f"purged job {job_id}")
        out.extend(self._expire_tombstones(now))
        return out

    def _purge_node_reports(self, job_id: str, nodes: set[str]) -> None:
        """Delete what the job's nodes reported about it (one range each, after the purge:
        too many for one transaction). A node missed here (down, or no longer of the job
        after a requeue) deletes its own when its agent sees the tombstone."""
        for node in sorted(nodes):
            try:
                self.store.delete_prefix(self.keys.node_job_reports_prefix(node, job_id))
                self.store.delete_prefix(self.keys.job_plan_events_prefix(node, job_id))
            except (StoreError, ValueError) as exc:
                log.warning("job %s: reports of %s not deleted (its agent will): %s",
                            job_id, node, exc)

    def _plan_summary(self, job_id: str) -> dict[str, Any]:
        """The job's plans summed up for its tombstone (malformed ones skipped)."""
        plans = []
        for kv in self.store.get_prefix(self.keys.job_plans_prefix(job_id)):
            with contextlib.suppress(RecordError):
                plans.append(Plan.from_json(kv.key, kv.value))
        return planner_summarize(plans)

    def _expire_tombstones(self, now: float) -> list[str]:
        """Tombstones live ``purge_record_sec``: long enough for a node that was down."""
        if self._mono() - self._tombstones_at < self.cfg.coordinator.slurm_poll_sec:
            return []
        self._tombstones_at = self._mono()
        keep = self.cfg.coordinator.purge_record_sec
        old: list[TxnOp] = []
        for kv in self.store.get_prefix(self.keys.purged_prefix()):
            try:
                purged_at = float(json.loads(kv.value)["purged_at"])
            except (ValueError, KeyError, TypeError):
                purged_at = 0.0  # malformed: nothing can use it, let it go
            if now - purged_at >= keep:
                old.append(Delete(kv.key))
        for i in range(0, len(old), MAX_TXN_OPS):
            self.leadership.commit([], old[i:i + MAX_TXN_OPS])
        return [f"expired {len(old)} tombstones"] if old else []
