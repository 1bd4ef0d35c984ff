"""Restore of a rank's checkpoint on any node, as a part of the agent's checkpoint service.

:meth:`Restorer.restore` tries generations newest first: the manifest from this node or
a holder (checked against the digest in etcd), the chunks this node lacks pulled from
live holders and each checked, then every chunk decoded and checked. A bad or missing
chunk is fetched from another holder; when no holder has a good copy, the restore falls
back to the previous generation, then to the cold copy. Every fallback is logged,
returned to the caller and noted in the generation's record (``bad`` holders).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Container, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

from raps_slurm.checkpoint import cold
from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.codec import Decoder
from raps_slurm.checkpoint.local import LocalCheckpoints, Restored
from raps_slurm.checkpoint.manifest import Manifest, check_total, manifest_digest
from raps_slurm.checkpoint.peer_keys import PeerKeys
from raps_slurm.checkpoint.reader import BadChunk, read_into
from raps_slurm.checkpoint.restore_parts import (
    Charge,
    Fallback,
    Once,
    Peak,
    RestoreError,
    RestoreResult,
    prefetch,
)
from raps_slurm.checkpoint.sparse import Layout, layout, memory_file
from raps_slurm.checkpoint.transfer import TokenBucket, TransferClient, TransferError, verify_chunk
from raps_slurm.config import Config
from raps_slurm.core import checkpoints as decide
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import RankEntry
from raps_slurm.errors import RapsError, RecordError, StoreError
from raps_slurm.model import BackupGroup

if TYPE_CHECKING:
    from raps_slurm.checkpoint.early import EarlyRestores

log = logging.getLogger("raps.checkpoint")

RESTORES_AT_ONCE = 2  # per checkpoint service; each restore pulls from two holders at once
# Storing pulled chunks waits this long at most for the node's other restores to end.
KEEP_DEFER_S = 60.0



def _free(_: int) -> None:
    """The charge of a restore made for no caller (an early restore, root's work)."""


def _close(fd: int, buf: mmap.mmap | None) -> None:
    if buf is not None:
        buf.close()
    os.close(fd)


def _held_or_stored(held: dict[str, tuple[int, bytes | memoryview]], chunks: ChunkStore,
                    job: str, digest: str) -> bytes | memoryview:
    """A chunk's stored bytes: pulled and held in memory, else from the store."""
    got = held.get(digest)
    return got[1] if got is not None else chunks.read(job, digest)


class Restorer:
    """The restore half of :class:`~raps_slurm.checkpoint.service.CheckpointService`
    (which sets these attributes and provides ``records`` and ``_update_holders``)."""

    cfg: Config
    node: str
    chunks: ChunkStore
    local: LocalCheckpoints
    limiter: TokenBucket
    quota: int
    _key: bytes | PeerKeys
    _peers: Callable[[], dict[str, tuple[str, int]]]
    _queue: queue.Queue[Callable[[], object] | None]
    _restores: threading.BoundedSemaphore
    _restoring: threading.Condition  # notified when ``_waiting_restores`` drops
    _waiting_restores: int
    _keeps: dict[tuple[str, int], Once]  # pulled chunks of a rank not stored yet
    early: EarlyRestores

    def records(self, job: str, rank: int) -> list[CkptRecord]:
        """The rank's shared generation records in etcd."""
        raise NotImplementedError

    def commits(self, job: str, rank: int, nodes: Iterable[str]
                ) -> dict[tuple[str, int], CkptRecord]:
        """The generations of the rank that each of ``nodes`` committed (its own keys)."""
        raise NotImplementedError

    def rank_entry(self, job: str, rank: int) -> RankEntry | None:
        """The rank's entry in the rank map, None if it has none."""
        raise NotImplementedError

    def group(self, job: str, rank: int) -> BackupGroup | None:
        """The rank's backup group, None if none is recorded."""
        raise NotImplementedError

    def job_nodes(self, job: str) -> frozenset[str] | None:
        """Every node of every run of the job (its registration), None if unregistered."""
        raise NotImplementedError

    def trusted_records(self, job: str, rank: int, entry: RankEntry | None = None
                        ) -> list[CkptRecord]:
        """The rank's generations a restore may take: each committed by the node that ran
        the rank at its epoch (``decide.attested``), holders outside the job dropped
        (``of_job_nodes``); the others are logged and left alone. RestoreError if the
        job or the rank is not registered: its generations cannot be checked. ``entry``:
        the rank's entry when the caller has just read it."""
        if entry is None:
            entry = self.rank_entry(job, rank)
        records = self.records(job, rank)
        commits = {} if entry is None else \
            self.commits(job, rank, {entry.node, *(n for _, n in entry.placed)})
        if not records and not commits:
            return []
        nodes = self.job_nodes(job)
        if nodes is None or entry is None:
            what = f"job {job} has no registration" if nodes is None else \
                f"rank {rank} of job {job} has no rank entry"
            raise RestoreError(f"{what} in etcd: the generations of rank {rank} cannot be "
                               "checked against the nodes that ran it")
        group = self.group(job, rank)
        backups = [b for b in (group.log_backup, *group.ckpt_mirrors) if b] if group else []
        found, refused = decide.attested(rank, records, commits, entry.node_at, backups)
        for why in refused:
            log.warning("job %s rank %d: %s; never restored from", job, rank, why)
        kept, foreign = decide.of_job_nodes(found, nodes)
        for r in foreign:
            log.warning("job %s rank %d: generation %d ignored: its primary %s is not a node "
                        "of the job", job, rank, r.generation, r.primary)
        return kept

    def _update_holders(self, job: str, rank: int, gen: int,
                        change: Callable[[CkptRecord], CkptRecord]) -> CkptRecord | None:
        raise NotImplementedError

    def restore(self, job: str, rank: int, charge: Charge = _free,
                generation: int | None = None) -> RestoreResult | None:
        """The newest restorable generation, verified; None if the rank never committed.
        RestoreError if generations exist but none (nor the cold copy) is whole.
        ``generation``: that one only (its cold copy as the one fallback), as a restart
        of every rank from their common generation needs; None if it has no record.

        ``charge`` is called, before they are allocated, with the bytes of memory the
        restore is about to hold beyond the most it held so far (the state's non-zero
        part, the chunks it pulls; a generation given up frees its own); what it raises
        ends the restore. The memory file is allocated only where the state is
        not zero (:mod:`raps_slurm.checkpoint.sparse`).

        At most RESTORES_AT_ONCE (the service's ``restores_at_once``) run at a time: a
        dead node's ranks all restore on one spare, and eight threads decoding at once
        starve the agent's other threads (the ranks' heartbeats) of the GIL for seconds
        while finishing no sooner. A restore started when the plan came
        (:meth:`restore_early`) is taken if it is of the rank's newest generation.

        The generation restored is then this node's at the rank's epoch (:meth:`adopt`)."""
        early = self.early.take(job, rank)
        if early is not None and generation not in (None, early.generation):
            early.restored.close()  # of the newest generation; another one is wanted
            early = None
        result = early if early is not None else \
            self.restore_queued(job, rank, charge, generation)
        if result is not None and isinstance(result.generation, int):
            try:
                self.adopt(job, rank, result.generation)
            except (StoreError, RecordError) as exc:  # the restore stands; a later one adopts
                log.warning("job %s rank %d: generation %d not adopted: %s", job, rank,
                            result.generation, exc)
        return result

    def adopt(self, job: str, rank: int, generation: int) -> None:
        """Commit a restored generation again as this node's, at the rank's epoch."""
        raise NotImplementedError

    def manifest(self, job: str, rank: int, rec: CkptRecord) -> Manifest | None:
        """A generation's manifest, from this node or a holder, checked against its record;
        None if none could be read."""
        peers = self._peers()
        sources = [h for h in rec.holders if h != self.node and h in peers]
        with self.chunks.pinned(job, gens=[(rank, rec.generation)]):
            return self._manifest(job, rank, rec, peers, sources, set())[0]

    def restore_early(self, job: str, rank: int) -> bool:
        """Start restoring a rank relaunched here before it asks; False if not started."""
        return self.early.start(job, rank)

    def restore_queued(self, job: str, rank: int, charge: Charge = _free,
                       generation: int | None = None) -> RestoreResult | None:
        """A restore, in turn with the node's others (at most RESTORES_AT_ONCE at once)."""
        with self._restoring:
            self._waiting_restores += 1
        try:
            with self._restores:
                return self._restore(job, rank, charge, generation)
        finally:
            with self._restoring:
                self._waiting_restores -= 1
                self._restoring.notify_all()

    def _keep_later(self, job: str, rank: int, keep: Once) -> None:
        """Queue ``keep`` on the replication lane, to run once the node's other restores
        are done (or sooner, by :meth:`keep_now`)."""
        with self._restoring:
            self._keeps[(job, rank)] = keep

        def queued() -> None:
            self._after_restores()
            with self._restoring:
                if self._keeps.get((job, rank)) is keep:
                    del self._keeps[(job, rank)]
            keep()
        self._queue.put(queued)

    def keep_now(self, job: str, rank: int) -> None:
        """Store now the chunks a restore of the rank pulled, if they wait on the lane: the
        rank is about to checkpoint, and without them here its first save would send its
        whole state again (1.5-2 s for 128 MiB on the test machine, against 0.3 s to
        store what was pulled)."""
        with self._restoring:
            keep = self._keeps.pop((job, rank), None)
        if keep is not None:
            try:
                keep()
            except (RapsError, OSError) as exc:  # the save goes on, sending what is missing
                log.warning("job %s rank %d: pulled chunks not stored before its save: %s",
                            job, rank, exc)

    def _after_restores(self, most: float = KEEP_DEFER_S) -> None:
        """Wait (at most ``most`` seconds) until no restore is running or queued: storing
        a restore's pulled chunks is CPU the ranks still waiting for theirs would lose."""
        with self._restoring:
            self._restoring.wait_for(lambda: self._waiting_restores == 0, most)

    def _restore(self, job: str, rank: int, charge: Charge = _free,
                 generation: int | None = None) -> RestoreResult | None:
        records = decide.restore_order(self.trusted_records(job, rank))
        if generation is not None:
            records = [r for r in records if r.generation == generation]
            if not records:
                return None
        fallbacks: list[Fallback] = []
        unreached: set[str] = set()  # holders down, or a transfer from them failed
        peak = Peak(charge)
        for rec in records:
            result, failure = self._restore_one(job, rank, rec, unreached, peak.need)
            if result is not None:
                result.fallbacks = fallbacks
                return result
            assert failure is not None
            fallbacks.append(failure)
            log.warning("job %s rank %d: generation %d not restorable (%s); falling back",
                        job, rank, rec.generation, failure.reason)
        cold = self._restore_cold(job, rank, fallbacks, peak.need, generation)
        if cold is not None:
            return cold
        if not records and not fallbacks:
            return None
        out = f" (holders out of reach: {','.join(sorted(unreached))})" if unreached else ""
        raise RestoreError(f"no generation of rank {rank} of job {job} could be restored: "
                           + "; ".join(f"{f.generation}: {f.reason}" for f in fallbacks)
                           + out, tuple(sorted(unreached)))

    def _decode(self, m: Manifest, where: Layout,
                memory: tuple[int, mmap.mmap | None] | None = None,
                fetch: Callable[[str], bytes | memoryview] | None = None,
                checked: Container[str] = frozenset()
                ) -> tuple[Restored | None, list[BadChunk]]:
        """Decode and verify ``m``'s non-zero chunks into a memory file allocated only
        where ``where`` says the state is not zero (``memory``: one allocated so
        beforehand, closed on failure like one allocated here). ``fetch``: where a chunk's
        stored bytes come from instead of this node's store (pulled chunks, held in
        memory); ``checked``: chunks it gives as verified already, only decoded."""
        t = time.perf_counter()
        fd, buf = memory if memory is not None else memory_file(m.total_size, where.ranges)
        alloc = time.perf_counter() - t
        try:
            view = memoryview(buf) if buf is not None else memoryview(bytearray())
            only = None if not where.zero else set(where.wanted(m.digests()))
            bad = read_into(m, fetch or functools.partial(self.chunks.read, m.job), view,
                            only=only, progress=self.local.progress, checked=checked)
            view.release()
        except BaseException:
            _close(fd, buf)
            raise
        if bad:
            _close(fd, buf)
            return None, bad
        return Restored(m, fd, buf, alloc), []

    def _restore_one(self, job: str, rank: int, rec: CkptRecord, unreached: set[str],
                     charge: Charge = _free) -> tuple[RestoreResult | None, Fallback | None]:
        peers = self._peers()
        sources = [h for h in rec.holders if h != self.node and h in peers]
        unreached.update(h for h in rec.holders if h != self.node and h not in peers)
        with self.chunks.pinned(job, gens=[(rank, rec.generation)]):
            m, why = self._manifest(job, rank, rec, peers, sources, unreached)
            if m is None:
                return None, Fallback(rec.generation, why)
            where = layout(m)
            need = where.nonzero_bytes  # the memory file, and below what is pulled
            charge(need)
            pulled = 0
            pull_s = local_s = 0.0
            traffic: dict[str, int] = {}  # holder -> bytes pulled from it
            bad_holders: dict[str, str] = {}
            # Pulled chunks stay in memory and are decoded from there: storing them first
            # (new pack files, 2.5 ms of CPU per MiB on the test machine) would keep the
            # rank waiting. They are stored after the reply, on the replication lane.
            # digest -> (raw size, stored bytes: a view of the batch it came in)
            held: dict[str, tuple[int, bytes | memoryview]] = {}
            tried_local = False
            for attempt in range(len(sources) + 2):
                # zero chunks are neither read nor pulled
                wanted = where.wanted(m.digests())
                missing = [d for d in self.chunks.missing(job, wanted) if d not in held]
                if not self.cfg.recovery.use_delta_transfer and attempt == 0:
                    # measured comparison: pull every chunk, held here or not
                    missing = sorted(set(wanted))
                t0 = time.perf_counter()
                memory = None
                if missing:
                    sizes = dict(m.chunks)
                    need += sum(sizes[d] for d in set(missing))  # held as pulled, at most
                    charge(need)
                    # The memory file's pages are allocated while the chunks travel.
                    with ThreadPoolExecutor(1, thread_name_prefix="raps-alloc") as pool:
                        pending = pool.submit(memory_file, m.total_size, where.ranges)
                        try:
                            pulled += self._pull(job, m, missing, sources, peers, bad_holders,
                                                 traffic, held, unreached)
                        except BaseException:
                            fd, buf = pending.result()
                            if buf is not None:
                                buf.close()
                            os.close(fd)
                            raise
                        memory = pending.result()
                t1 = time.perf_counter()
                restored, bad = self._decode(m, where, memory, fetch=functools.partial(
                    _held_or_stored, held, self.chunks, job), checked=held.keys())
                pull_s, local_s = pull_s + t1 - t0, local_s + time.perf_counter() - t1
                if restored is not None:
                    if held:
                        self._note(job, rank, rec, bad_holders)
                        self._keep_later(job, rank, Once(functools.partial(
                            self._keep, job, rank, rec, m, held)))
                    else:
                        if self.chunks.manifest_bytes(job, rank, rec.generation) is None:
                            self.chunks.put_manifest(m)
                        self._note(job, rank, rec, bad_holders, holder=self.node)
                    return RestoreResult(restored, rec.generation, [], pulled,
                                         sum(traffic.values()),
                                         tuple(h for h in sources if traffic.get(h)),
                                         round(pull_s, 3), round(local_s, 3)), None
                # A chunk stored here is bad: drop it and pull a good copy. (A pulled one
                # was verified as it came; it is dropped too, should it be.)
                if not tried_local and self.node in rec.holders:
                    for b in bad:
                        if b.digest not in held:
                            bad_holders.setdefault(b.digest, self.node)
                tried_local = True
                for b in bad:
                    held.pop(b.digest, None)
                self.chunks.drop(job, [b.digest for b in bad])
                if attempt >= len(sources):
                    break
            self._note(job, rank, rec, bad_holders)
            return None, Fallback(rec.generation, "no holder has a good copy of every chunk",
                                  [{"digest": d, "holder": h}
                                   for d, h in sorted(bad_holders.items())])

    def _manifest(self, job: str, rank: int, rec: CkptRecord,
                  peers: dict[str, tuple[str, int]], sources: list[str], unreached: set[str]
                  ) -> tuple[Manifest | None, str]:
        try:  # before anything is fetched or reserved
            check_total(f"record of generation {rec.generation}", rec.total_size, rec.chunks,
                        self.quota)
        except RecordError as exc:
            return None, str(exc)
        raw = self.chunks.manifest_bytes(job, rank, rec.generation)
        candidates: list[tuple[str, bytes | None]] = [(self.node, raw)]
        for src in sources:
            candidates.append((src, None))
        for holder, data in candidates:
            if data is None and holder != self.node:
                try:
                    with TransferClient(self._key, self.node, peers[holder],
                                        peer=holder, limiter=self.limiter) as client:
                        data = client.manifest(job, rank, rec.generation)
                except TransferError as exc:
                    log.warning("manifest of job %s rank %d gen %d from %s: %s", job, rank,
                                rec.generation, holder, exc)
                    unreached.add(holder)
                    continue
            if data is None:
                continue
            if manifest_digest(data) != rec.manifest_digest:
                log.warning("job %s rank %d generation %d: %s's manifest does not match "
                            "the digest in etcd", job, rank, rec.generation, holder)
                continue
            try:
                m = Manifest.from_json(f"manifest from {holder}", data)
                check_total(f"manifest from {holder}", m.total_size, len(m.chunks), self.quota)
                if (m.job, m.rank, m.generation) != (job, rank, rec.generation):
                    raise RecordError(f"manifest from {holder}: it is of job {m.job} rank "
                                      f"{m.rank} generation {m.generation}")
                return m, ""
            except RecordError as exc:
                log.warning("%s", exc)
        return None, "no holder has a manifest matching the record"

    def _keep(self, job: str, rank: int, rec: CkptRecord, m: Manifest,
              held: dict[str, tuple[int, bytes | memoryview]]) -> None:
        """After a restore from pulled chunks (on the replication lane once the node's
        other restores are done, or before the rank's next save): store them and the
        manifest, then count this node among the generation's holders."""
        try:
            with self.chunks.pinned(job, gens=[(rank, rec.generation)]) as pins:
                for digest in held:
                    self.chunks.pin_chunk(job, pins, digest)
                self.chunks.put_many(job, ((d, raw, stored) for d, (raw, stored)
                                           in held.items()), durable=False)
                if self.chunks.manifest_bytes(job, rank, rec.generation) is None:
                    self.chunks.put_manifest(m)
                self.chunks.sync_pending()
        except OSError as exc:
            log.error("job %s rank %d generation %d: restored, but its pulled chunks were "
                      "not stored here: %s", job, rank, rec.generation, exc)
            return
        finally:
            held.clear()
        self._note(job, rank, rec, {}, holder=self.node)

    def _pull(self, job: str, m: Manifest, missing: list[str], sources: list[str],
              peers: dict[str, tuple[str, int]], bad_holders: dict[str, str],
              traffic: dict[str, int], held: dict[str, tuple[int, bytes | memoryview]],
              unreached: set[str]) -> int:
        """Pull ``missing`` chunks into ``held`` (verified); how many came. With two or
        more holders the first pass splits the work between the first two (two agents
        serve at once); whatever is still missing is then asked of each holder in turn."""
        sizes = dict(m.chunks)
        want = set(missing)
        pulled = 0
        lock = threading.Lock()

        def from_source(src: str, part: set[str]) -> None:
            nonlocal pulled
            dec = Decoder()
            try:
                with TransferClient(self._key, self.node, peers[src],
                                    peer=src, limiter=self.limiter) as client:
                    # The next batch is on its way while this one is checked and stored.
                    for batch in prefetch(client.fetch_batches(job, sorted(part), sizes,
                                                               urgent=True)):
                        good = []
                        for digest, raw, stored in batch:
                            if digest not in part:
                                continue
                            reason = verify_chunk(m.digest_algo, digest, raw, stored, dec)
                            if reason is not None or raw != sizes.get(digest):
                                with lock:
                                    bad_holders.setdefault(digest, src)
                                log.warning("chunk %s of job %s from %s is bad: %s",
                                            digest[:16], job, src, reason or "wrong size")
                                continue
                            good.append((digest, raw, stored))
                        with lock:
                            for digest, raw, stored in good:
                                held[digest] = (raw, stored)
                            pulled += len(good)
                            traffic[src] = traffic.get(src, 0) + sum(len(g[2]) for g in good)
                            want.difference_update(g[0] for g in good)
            except TransferError as exc:
                log.warning("pull from %s failed: %s", src, exc)
                with lock:
                    unreached.add(src)

        if len(sources) >= 2 and len(want) >= 2:
            ordered = sorted(want)
            halves = [set(ordered[0::2]), set(ordered[1::2])]
            threads = [threading.Thread(target=from_source, args=(src, part),
                                        name=f"raps-pull-{src}")
                       for src, part in zip(sources[:2], halves, strict=True)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for src in sources:
            with lock:
                rest = {d for d in want if bad_holders.get(d) != src}
            if rest:
                from_source(src, rest)
        return pulled

    def _note(self, job: str, rank: int, rec: CkptRecord, bad_holders: dict[str, str],
              holder: str | None = None) -> None:
        bad = set(bad_holders.values())
        if not bad and (holder is None or holder in rec.holders):
            return
        for d, h in sorted(bad_holders.items()):
            log.warning("job %s rank %d generation %d: chunk %s on %s was bad", job, rank,
                        rec.generation, d[:16], h)

        def change(r: CkptRecord) -> CkptRecord:
            holders = set(r.holders) - bad
            if holder is not None:
                holders.add(holder)
            out = r.with_holders(holders) if holders else r
            return replace(out, bad=tuple(sorted(set(r.bad) | bad)))

        with contextlib.suppress(StoreError):
            self._update_holders(job, rank, rec.generation, change)

    def _restore_cold(self, job: str, rank: int, fallbacks: list[Fallback],
                      charge: Charge = _free, only: int | None = None
                      ) -> RestoreResult | None:
        """The newest cold copy (``only``: of that generation) that matches its record in
        etcd and whose every chunk is good (see :mod:`raps_slurm.checkpoint.cold`); each
        refused one is a fallback."""
        c = self.cfg.checkpoint
        if not c.cold_dir:
            return None
        directory = cold.cold_path(c.cold_dir, job, rank)
        try:
            gens = cold.generations(directory)
        except cold.ColdCopyError as exc:  # a link or someone else's directory on the way
            log.warning("job %s rank %d: cold copies refused: %s", job, rank, exc)
            fallbacks.append(Fallback("cold", str(exc)))
            return None
        records = {r.generation: r for r in self.trusted_records(job, rank)} if gens else {}
        for gen in gens:
            if only is not None and gen != only:
                continue
            bad: list[str] = []
            stored = 0
            try:
                m = cold.load_manifest(directory, job, rank, gen, records.get(gen), self.quota)
                where = layout(m)
                need = set(self.chunks.missing(job, where.wanted(m.digests())))
                for batch in cold.verified_chunks(directory, m, need, bad):
                    stored += self.chunks.put_many(job, batch)[0]
            except RapsError as exc:
                log.warning("job %s rank %d: cold copy %d refused: %s", job, rank, gen, exc)
                fallbacks.append(Fallback(f"cold {gen}", str(exc)))
                continue
            if bad:  # never restored from, even where the store holds good copies
                log.warning("job %s rank %d: cold copy %d has %d bad chunk(s)", job, rank,
                            gen, len(bad))
                fallbacks.append(Fallback(f"cold {gen}", "cold copy is damaged",
                                          [{"digest": d, "holder": "cold"} for d in bad]))
                continue
            charge(where.nonzero_bytes)
            restored, damaged = self._decode(m, where)
            if restored is not None:
                log.warning("job %s rank %d restored from the cold copy of generation %d",
                            job, rank, gen)
                return RestoreResult(restored, f"cold {gen}", fallbacks, stored)
            fallbacks.append(Fallback(f"cold {gen}", "cold copy is damaged",
                                      [{"digest": b.digest, "holder": "cold"} for b in damaged]))
        return None
