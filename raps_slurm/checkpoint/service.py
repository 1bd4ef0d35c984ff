"""The agent's checkpoint service: commit with the epoch check, replication, repair, restore.

A rank saves through its agent (see :mod:`raps_slurm.agent.ckpt_api`): the agent stores
the packs, then :meth:`CheckpointService.commit` numbers the generation, writes the
manifest durably and records it in etcd in one transaction guarded by the revision of
the rank's entry (``jobs/<id>/ranks/<rank>``) after checking that the entry's epoch is
the saver's: a fenced copy of a rank cannot commit, and two commits cannot take the same
generation. Replication to the rank's backup group then runs in the background, and the
record's holders and state (``committed`` / ``under_replicated``) follow the
acknowledgements. :meth:`repair` re-replicates a rank's newest generation whenever its
targets and its live holders differ: a partner that was down, or a new holder the
coordinator chose after a node died.

:meth:`restore` (:mod:`raps_slurm.checkpoint.restore`) brings a generation back on any
node.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from raps_slurm.checkpoint import cold
from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.checkpoint.early import EarlyRestores
from raps_slurm.checkpoint.local import LocalCheckpoints, SaveError, Session
from raps_slurm.checkpoint.logcopy import LogCopier
from raps_slurm.checkpoint.logstore import LogStore
from raps_slurm.checkpoint.manifest import Manifest, check_total, manifest_digest
from raps_slurm.checkpoint.peer_keys import PeerKeys
from raps_slurm.checkpoint.restore import RESTORES_AT_ONCE, Restorer
from raps_slurm.checkpoint.transfer import (
    TokenBucket,
    TransferClient,
    TransferError,
)
from raps_slurm.config import Config
from raps_slurm.core import checkpoints as decide
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import JobRecord, RankEntry, RankMap, group_from_json
from raps_slurm.core.membership import dead_nodes
from raps_slurm.errors import RapsError, RecordError, StoreError
from raps_slurm.model import BackupGroup
from raps_slurm.store import Keys, StateStore
from raps_slurm.store.base import Guard, Put

log = logging.getLogger("raps.checkpoint")


def read_commits(store: StateStore, keys: Keys, job: str, rank: int, nodes: Iterable[str],
                 malformed: Callable[[RecordError], None]) -> dict[tuple[str, int], CkptRecord]:
    """The generations of ``rank`` that each of ``nodes`` committed under its own keys
    (``(node, generation)`` -> record); each malformed one goes to ``malformed``."""
    out: dict[tuple[str, int], CkptRecord] = {}
    for node in sorted(nodes):
        for kv in store.get_prefix(keys.ckpt_commits_prefix(node, job, rank)):
            gen = keys.split(kv.key)[-1]
            try:
                if not (gen.isascii() and gen.isdigit()):
                    raise RecordError(f"{kv.key}: not a generation number")
                out[(node, int(gen))] = CkptRecord.from_json(kv.key, kv.value)
            except RecordError as exc:
                malformed(exc)
    return out

PUSHERS = 4  # copies of one generation sent beside the first (more targets queue for one)


class Fenced(RapsError):
    """A commit from an epoch that is no longer the rank's (a stale copy)."""


class LogUnbacked(RapsError):
    """A generation not committed: its log has not reached the rank's log backup."""



def peers_from_store(store: StateStore, keys: Keys) -> Callable[[], dict[str, tuple[str, int]]]:
    """A function returning the transfer address of every registered (live) node.

    A node with a DEAD verdict newer than its registration is left out: a frozen or
    crashed node's registration lingers until its lease runs out, and a restore must not
    wait on its silent socket meanwhile."""

    def read() -> dict[str, tuple[str, int]]:
        out: dict[str, tuple[str, int]] = {}
        created: dict[str, int] = {}
        dead: dict[str, int] = {}
        for kv in store.get_prefix(keys.nodes_prefix()):
            rest = kv.key[len(keys.nodes_prefix()):]
            try:
                value = json.loads(kv.value)
                if rest.endswith("/verdict"):
                    if value.get("kind") == "DEAD":
                        dead[rest[:-len("/verdict")]] = kv.mod_revision
                    continue
                if "/" in rest:
                    continue
                host, port = str(value["transfer"]).rsplit(":", 1)
                out[rest] = (host, int(port))
                created[rest] = kv.create_revision
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # an agent without a transfer server (or a malformed key)
        gone = dead_nodes(created, dead)
        return {n: a for n, a in out.items() if n not in gone}

    return read


class CheckpointService(Restorer):
    """One node's checkpoint service (the agent owns one)."""

    def __init__(self, cfg: Config, store: StateStore, keys: Keys, node: str, key: bytes | PeerKeys,
                 chunks: ChunkStore, *,
                 peers: Callable[[], dict[str, tuple[str, int]]] | None = None,
                 clock: Callable[[], float] = time.time,
                 restores_at_once: int = RESTORES_AT_ONCE) -> None:
        self.cfg, self.store, self.keys, self.node = cfg, store, keys, node
        self.local = LocalCheckpoints(chunks)
        self.chunks = chunks
        self._key = key
        self._peers = peers or peers_from_store(store, keys)
        self._clock = clock
        c = cfg.checkpoint
        self.params = CodecParams(c.avg_chunk_kb, c.digest, c.zstd_level, c.shuffle)
        self.limiter = TokenBucket(c.replication_mbps * 1e6)
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        # Two lanes: a rank's log flushes (many, small, every few ms) must not hold up the
        # copies of its checkpoints, nor the other way round.
        self._queue: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self._log_queue: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self._pending: set[tuple[str, int, int]] = set()  # generations queued for copying
        # The newest generation queued per (job, rank): an older one still queued when a
        # newer one arrives is skipped, so replication never falls behind a rank that
        # checkpoints faster than its copies go (the newer generation is the one restored).
        self._newest: dict[tuple[str, int], int] = {}
        self.skipped_copies = 0
        self.logs = LogStore(chunks.root)
        self.logcopy = LogCopier(node, key, self.logs, self.group, self._peers, self.limiter,
                                 cfg.messagelog.backup_max_lag_ms / 1000)
        self._log_queue = self.logcopy.queue
        self._workers: list[threading.Thread] = []
        self.pushed_bytes = 0
        # A restore reserves a generation's total size in memory before reading a chunk:
        # one generation is at most what the job may keep on a node.
        self.quota = cfg.agent.job_disk_quota_mb << 20
        # Per service, not per process: two services in one process (tests, benchmarks)
        # must not hold up each other's restores.
        self._restores = threading.BoundedSemaphore(restores_at_once)
        self._restoring = threading.Condition()
        self._waiting_restores = 0
        self._keeps = {}
        # Ranks this node is primary for, as its commits and repair passes found them; the
        # first pass reads every rank held here (an agent restart forgets them).
        self._primaries: set[tuple[str, int]] = set()
        self._primaries_read = False
        self._pushers: ThreadPoolExecutor | None = None
        self.early = EarlyRestores(self.restore_queued, self._newest_generation)

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the background workers (checkpoint copies, log copies)."""
        if not self._workers:
            self._workers = [
                threading.Thread(target=self._work, args=(q,), name=name, daemon=True)
                for q, name in ((self._queue, "raps-replicate"), (self._log_queue, "raps-logcopy"))]
            for t in self._workers:
                t.start()

    def stop(self) -> None:
        """Stop the workers (queued replications are left to the next repair pass)."""
        if self._workers:
            self._queue.put(None)
            self._log_queue.put(None)
            for t in self._workers:
                t.join(timeout=10)
            self._workers = []
        self.logcopy.close()
        self.early.close()
        with self._lock:
            pushers, self._pushers = self._pushers, None
        if pushers is not None:
            pushers.shutdown(wait=True)

    @staticmethod
    def _work(q: queue.Queue[Callable[[], object] | None]) -> None:
        while (item := q.get()) is not None:
            try:
                item()
            except (RapsError, OSError) as exc:
                log.warning("background copy failed: %s", exc)
            finally:
                q.task_done()

    def _later(self, job: str, rank: int, gen: int) -> None:
        key = (job, rank, gen)
        with self._lock:
            if key in self._pending:
                return  # already queued (a repair pass found it short again)
            self._pending.add(key)
            if gen > self._newest.get((job, rank), -1):
                self._newest[(job, rank)] = gen

        def copy() -> None:
            # The rank's first queued copy takes its newest generation, and the later ones
            # find nothing left to do. (Skipping a copy because a newer one is queued
            # behind it starved a rank whose next checkpoint always came before the lane
            # reached the newer one: eight 128 MiB ranks on a node had generations stay
            # under-replicated for minutes.)
            with self._lock:
                self._pending.discard(key)
                newest = self._newest.pop((job, rank), None)
                if newest is None:
                    self.skipped_copies += 1
            if newest is None:
                log.info("job %s rank %d generation %d: copy skipped, a newer generation "
                         "was copied", job, rank, gen)
                return
            self.replicate(job, rank, newest)
        self._queue.put(copy)

    def wait_idle(self) -> None:
        """Block until queued replications and log copies are done (tests, shutdown)."""
        self._queue.join()
        self._log_queue.join()

    # --- saves ---------------------------------------------------------------------------

    def begin(self, job: str, rank: int, epoch: int, base: int | None) -> tuple[str, bool]:
        """Open a save; (session id, whether ``base`` is held here)."""
        self.keep_now(job, rank)  # a restored rank's pulled chunks first: its base
        session, ok = self.local.begin(job, rank, epoch, base)
        sid = uuid.uuid4().hex
        with self._lock:
            self._sessions[sid] = session
        return sid, ok

    def session(self, sid: str) -> Session:
        """An open session; SaveError if unknown."""
        with self._lock:
            s = self._sessions.get(sid)
        if s is None:
            raise SaveError(f"no open checkpoint session {sid[:40]!r}")
        return s

    def put(self, sid: str, fd: int) -> tuple[int, int]:
        """Store one pack of the session."""
        return self.local.ingest(self.session(sid), fd)

    def abort(self, sid: str) -> None:
        """Drop a session (its chunks go at the next collection)."""
        with self._lock:
            s = self._sessions.pop(sid, None)
        if s is not None:
            self.local.end(s)

    def commit(self, sid: str, manifest_raw: bytes) -> CkptRecord:
        """Number, store and record the session's generation; Fenced for a stale epoch."""
        s = self.session(sid)
        try:
            m = Manifest.from_json("manifest from the rank", manifest_raw)
            # a generation that could never be restored here is refused at once
            check_total("manifest from the rank", m.total_size, len(m.chunks), self.quota)
            self._log_backed(s.job, s.rank)
            record = self._commit(s, m)
        finally:
            self.abort(sid)
        self._later(s.job, s.rank, record.generation)
        return record

    def _log_backed(self, job: str, rank: int) -> None:
        """The commit rule: the rank flushed its log before saving, so every segment
        stored here now must be on its log backup before the generation may commit; else
        a crash of this node with a peer's could lose messages the peer must replay."""
        held, upto = self.logcopy.backed(job, rank)
        timeout = self.cfg.detection.lease_duration_sec
        if held < upto:
            self.logcopy.kick(job, rank)  # the backup may be back since the last pass
        if not self.logcopy.wait_backed(job, rank, upto, timeout):
            held, _ = self.logcopy.backed(job, rank)
            raise LogUnbacked(f"rank {rank} of job {job}: its log backup holds segments up to "
                              f"{held} of {upto} after {timeout:g}s; generation not committed "
                              "(it commits only once its log is on the log backup)")

    def _commit(self, s: Session, m: Manifest) -> CkptRecord:
        rank_key = self.keys.job_rank(s.job, s.rank)
        kv = self.store.get(rank_key)
        if kv is None:
            raise Fenced(f"rank {s.rank} of job {s.job} has no entry in the rank map")
        entry = RankEntry.from_json(kv.key, kv.value)
        if entry.epoch != s.epoch:
            raise Fenced(f"rank {s.rank} of job {s.job} is at epoch {entry.epoch}; "
                         f"this copy is epoch {s.epoch} and may not commit")
        if entry.node != self.node:
            raise Fenced(f"rank {s.rank} of job {s.job} runs on {entry.node}, not on "
                         f"{self.node}: only its node commits its generations")
        # Numbered after the generations a restore would take: a shared record any agent
        # can write must not decide the number (one at 2**63 would end the rank's saves).
        records = self.trusted_records(s.job, s.rank, entry)
        gen = decide.next_generation([r.generation for r in records])
        raw = self.local.finish(s, m, gen)
        wanted = self.wanted_replicas(s.job)
        record = CkptRecord(s.rank, gen, s.epoch, manifest_digest(raw), m.total_size,
                            self.chunks.stored_bytes(s.job, m.digests()), len(m.chunks),
                            m.whole_digest, self.node, (self.node,), wanted,
                            decide.commit_state(0, wanted), self._clock())
        ckpt_key = self.keys.ckpt(s.job, s.rank, gen)
        mine = self.keys.ckpt_commit(self.node, s.job, s.rank, gen)
        # The shared record is overwritten: one there that no commit backs is a forgery.
        ok = self.store.transaction([Guard(rank_key, kv.mod_revision), Guard(mine, 0)],
                                    [Put(ckpt_key, record.to_json()),
                                     Put(mine, record.to_json())])
        if not ok:
            self.chunks.delete_manifest(s.job, s.rank, gen)
            raise Fenced(f"commit of rank {s.rank} generation {gen} refused: the rank's "
                         f"entry changed (a newer epoch?) or the generation was taken")
        with self._lock:
            self._primaries.add((s.job, s.rank))
        self._collect(s.job, s.rank, [*records, record])
        log.info("job %s rank %d: generation %d committed (%d bytes, %d chunks)", s.job,
                 s.rank, gen, m.total_size, len(m.chunks))
        return record

    def _collect(self, job: str, rank: int, records: list[CkptRecord]) -> None:
        """Collect the job's chunks here; delete the rank's expired ``records`` (as the
        commit read them, with the new one: a read less per commit, and a record's state
        read a moment earlier, as a fresh read is by the time its delete lands)."""
        keep = self.cfg.checkpoint.max_generations
        result = self.chunks.collect(job, keep)
        if result.unreadable:
            log.warning("job %s: manifests %s unreadable; their chunks are kept", job,
                        result.unreadable)
        # Records of generations no holder keeps any more: only the primary deletes them.
        for gen in decide.expired_records(records, keep, self.node):
            self.store.delete(self.keys.ckpt(job, rank, gen))
            self.store.delete(self.keys.ckpt_commit(self.node, job, rank, gen))

    # --- records and groups --------------------------------------------------------------

    def records(self, job: str, rank: int) -> list[CkptRecord]:
        """The rank's generation records in etcd (malformed ones logged and skipped)."""
        out = []
        for kv in self.store.get_prefix(self.keys.ckpt_prefix(job, rank)):
            try:
                out.append(CkptRecord.from_json(kv.key, kv.value))
            except RecordError as exc:
                log.warning("%s", exc)
        return out

    def commits(self, job: str, rank: int, nodes: Iterable[str]
                ) -> dict[tuple[str, int], CkptRecord]:
        """The generations of the rank that each of ``nodes`` committed, from each node's
        own keys (malformed ones logged and skipped)."""
        return read_commits(self.store, self.keys, job, rank, nodes,
                            lambda exc: log.warning("%s", exc))

    def adopt(self, job: str, rank: int, generation: int) -> None:
        """Once a rank relaunched here restored ``generation`` (committed at an earlier
        epoch by another node), commit it again as this node's at the rank's epoch.
        Generations are tried by epoch first, so a node that ran the rank before can no
        longer publish a newer one at its old epoch that a later restore would take: the
        relaunched rank continues from this one. Nothing is done for a rank that runs
        elsewhere or a generation already of its epoch."""
        rank_key = self.keys.job_rank(job, rank)
        kv = self.store.get(rank_key)
        if kv is None:
            return
        entry = RankEntry.from_json(kv.key, kv.value)
        if entry.node != self.node:
            return
        found = [r for r in self.trusted_records(job, rank, entry)
                 if r.generation == generation]
        if not found or max(r.epoch for r in found) >= entry.epoch:
            return
        rec = max(found, key=lambda r: r.epoch)
        mine = replace(rec, epoch=entry.epoch, primary=self.node, committed_at=self._clock(),
                       holders=decide.ordered_holders(self.node, {self.node, *rec.holders}))
        key = self.keys.ckpt_commit(self.node, job, rank, generation)
        if self.store.transaction([Guard(rank_key, kv.mod_revision), Guard(key, 0)],
                                  [Put(self.keys.ckpt(job, rank, generation), mine.to_json()),
                                   Put(key, mine.to_json())]):
            with self._lock:
                self._primaries.add((job, rank))
            log.info("job %s rank %d: generation %d restored here is this node's at epoch %d",
                     job, rank, generation, entry.epoch)

    def rank_entry(self, job: str, rank: int) -> RankEntry | None:
        """The rank's entry in the rank map, None if it has none or it is malformed."""
        kv = self.store.get(self.keys.job_rank(job, rank))
        if kv is None:
            return None
        try:
            return RankEntry.from_json(kv.key, kv.value)
        except RecordError as exc:
            log.warning("%s", exc)
            return None

    def job_nodes(self, job: str) -> frozenset[str] | None:
        """Every node of every run of the job (its registration), None if unregistered."""
        kv = self.store.get(self.keys.job(job))
        if kv is None:
            return None
        try:
            return JobRecord.from_json(kv.key, kv.value).all_nodes
        except RecordError as exc:
            log.warning("%s", exc)
            return None

    def wanted_replicas(self, job: str) -> int:
        """Copies besides the primary the job asked for (rank map), else the config's."""
        kv = self.store.get(self.keys.job_map(job))
        if kv is not None:
            with contextlib.suppress(RecordError):
                return RankMap.from_json(kv.key, kv.value).replicas
        return self.cfg.checkpoint.replica_count

    def group(self, job: str, rank: int) -> BackupGroup | None:
        """The rank's backup group, None if none is recorded."""
        kv = self.store.get(self.keys.job_group(job, rank))
        if kv is None:
            return None
        try:
            return group_from_json(kv.key, kv.value, rank)
        except RecordError as exc:
            log.warning("%s", exc)
            return None

    def _update_holders(self, job: str, rank: int, gen: int,
                        change: Callable[[CkptRecord], CkptRecord]) -> CkptRecord | None:
        key = self.keys.ckpt(job, rank, gen)
        for _ in range(5):
            kv = self.store.get(key)
            if kv is None:
                return None
            old = CkptRecord.from_json(kv.key, kv.value)
            new = change(old)
            if new == old or self.store.compare_and_swap(key, new.to_json(), kv.mod_revision):
                return new
        raise StoreError(f"{key}: changed five times while updating its holders")

    # --- replication ---------------------------------------------------------------------

    def replicate(self, job: str, rank: int, gen: int) -> CkptRecord | None:
        """Copy a generation held here to the targets of its group that lack it."""
        kv = self.store.get(self.keys.ckpt(job, rank, gen))
        if kv is None:
            return None
        record = CkptRecord.from_json(kv.key, kv.value)
        peers = self._peers()
        targets = decide.replica_targets(self.group(job, rank), self.node, record.replicas)
        live_holders = {h for h in record.holders if h == self.node or h in peers}
        todo = [t for t in targets if t not in live_holders and t in peers]
        added: set[str] = set()
        with self.chunks.pinned(job, gens=[(rank, gen)]):
            m = self.chunks.manifest(job, rank, gen)
            if m is None:
                return record
            def push(target: str) -> None:
                try:
                    with TransferClient(self._key, self.node, peers[target],
                                        peer=target, limiter=self.limiter) as client:
                        res = client.push(self.chunks, m,
                                          delta=self.cfg.checkpoint.use_delta_transfer)
                    with self._lock:
                        self.pushed_bytes += res.sent_bytes
                        added.add(target)
                    log.info("job %s rank %d generation %d copied to %s (%d of %d chunks, "
                             "%d bytes)", job, rank, gen, target, res.sent_chunks, res.offered,
                             res.sent_bytes)
                except TransferError as exc:
                    log.warning("job %s rank %d generation %d: copy to %s failed: %s", job,
                                rank, gen, target, exc)
            # The targets at once: a copy is mostly waiting for the target (its checks,
            # its disk syncs), and one after the other kept the lane so busy that a node's
            # ranks went two or three generations between copies (0.3 s a copy of 27 KB
            # on the test machine, two targets, eight ranks checkpointing every 1-2 s).
            extra = [self._pusher().submit(push, t) for t in todo[1:]]
            if todo:
                push(todo[0])
            for f in extra:
                f.result()
            self._cold_copy(m)
        def change(r: CkptRecord) -> CkptRecord:
            # The primary drops holders that are gone (their node's registration lapsed):
            # a copy nobody can reach must not count towards the replicas.
            if r.primary == self.node:
                return r.with_holders({h for h in r.holders if h == self.node or h in peers}
                                      | added)
            return r.with_holders(set(r.holders) | added)

        return self._update_holders(job, rank, gen, change)

    def _newest_generation(self, job: str, rank: int) -> int | None:
        return max((r.generation for r in self.records(job, rank)), default=None)

    def _pusher(self) -> ThreadPoolExecutor:
        """The threads that copy a generation to its second and later targets (made on
        first use, kept: a copy goes out at every checkpoint)."""
        with self._lock:
            if self._pushers is None:
                self._pushers = ThreadPoolExecutor(PUSHERS, thread_name_prefix="raps-push")
            return self._pushers

    def repair(self) -> int:
        """Re-replicate the newest generation of every rank this node is primary for whose
        live holders fall short of its targets; returns how many were started.

        The first pass reads the records of every rank held here; later ones only those of
        the ranks it found primary here and of those committed here since: a node holds
        the copies of two or three times as many ranks as it runs."""
        self.early.expire()
        started = self.logcopy.retry_lagging()
        if not self.chunks.root.is_dir():
            return started
        peers = self._peers()
        with self._lock:
            known = set(self._primaries) if self._primaries_read else None
        found: set[tuple[str, int]] = set()
        for job_dir in self.chunks.root.glob("job-*"):
            job = job_dir.name[4:]
            if not (job.isdigit() and len(job) <= 20):
                continue
            for rank in self.chunks.ranks(job):
                if known is not None and (job, rank) not in known:
                    continue
                records = decide.restore_order(self.records(job, rank))
                if not records or records[0].primary != self.node:
                    continue
                found.add((job, rank))
                rec = records[0]
                targets = decide.replica_targets(self.group(job, rank), self.node, rec.replicas)
                live = {h for h in rec.holders if h in peers or h == self.node}
                if any(t not in live and t in peers for t in targets) or \
                        live != set(rec.holders):
                    self._later(job, rank, rec.generation)
                    started += 1
        with self._lock:
            # Ranks committed here during the pass stay; ranks moved away, or whose data
            # left this node, are dropped.
            self._primaries = found | (self._primaries - (known or set()))
            self._primaries_read = True
        return started

    # --- message-log segments ------------------------------------------------------------

    def append_log(self, job: str, rank: int, data: bytes, epoch: int = 0) -> int:
        """Store a rank's log segment here and have it copied to the rank's log backup
        (waiting at most ``messagelog.backup_max_lag_ms`` for the copy); its number."""
        return self.logcopy.append(job, rank, data, epoch)

    def read_log(self, job: str, rank: int) -> bytes:
        """A rank's log segments: this node's, else pulled from its group."""
        return self.logcopy.read(job, rank)

    def trim_log(self, job: str, rank: int, floors: dict[int, int]) -> int:
        """Drop segments the floors cover, here and on the log backup."""
        return self.logcopy.trim(job, rank, floors)

    def _cold_copy(self, m: Manifest) -> None:
        c = self.cfg.checkpoint
        if not c.cold_dir or m.generation % c.cold_every:
            return
        directory = cold.cold_path(c.cold_dir, m.job, m.rank)
        if cold.write_copy(self.chunks, m, directory):
            self._update_holders(m.job, m.rank, m.generation, lambda r: _with_cold(r))
            log.info("job %s rank %d generation %d copied to %s", m.job, m.rank,
                     m.generation, directory)


def _with_cold(r: CkptRecord) -> CkptRecord:
    return replace(r, cold=True)
