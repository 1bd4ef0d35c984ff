"""Checkpoint ops of the agent's local API: how a rank saves and restores through its agent.

A rank (a user process) never writes into the agent's store and never names a path:
it cuts, names and compresses its chunks itself, writes them into a memory file, seals
it (no later change possible) and passes the descriptor with ``SCM_RIGHTS``. The agent
refuses an unsealed descriptor, parses the pack strictly and copies it into its own
store. Ops, each answered ``{"ok": true, ...}`` or an error with a kind:

``ckpt_begin {job, rank, epoch, base}``  open a save; only the uid that registered the
    rank, with the registered epoch. Answers ``session``, ``base_ok`` (the base
    generation's chunks are here and pinned: reference them) and the codec ``params``.
``ckpt_put {session}`` + pack descriptor   store the pack's chunks.
``ckpt_commit {session}`` + manifest descriptor   commit (epoch check in etcd); answers
    ``generation``, ``state``, ``holders``. A superseded epoch is refused with kind
    ``epoch``.
``ckpt_abort {session}``   drop an unfinished save.
``ckpt_restore {job, rank, generation?}``   the newest verified generation, or with
    ``generation`` (optional; null or an integer >= 1) that one only (its cold copy as
    the one fallback), as a restart of every rank from their common generation needs:
    refused with kind ``no_generation`` when the rank has no record of it. Answers
    ``generation`` (null when the rank never committed), ``fallbacks``, ``size`` and
    ``resume_step`` (the ``progress`` of the recovery plan that gave the rank its
    registered epoch: the step it had reached before the fault; null without such a
    plan or progress), with two descriptors: the data and the manifest. Generations
    exist but none is whole (nor the cold copy): refused with kind ``lost``, and the
    rank's verdict ESCALATE is written first, for the leader, with ``lost`` true when
    every holder answered (docs/recovery.md).
``ckpt_generations {job, rank}``   the rank's newest generations (at most 64), newest
    first, as ``generations``: ``[{generation, label}]``, ``label`` the ``version`` a
    libraps rank gave it (null for others, or when no manifest of it could be read),
    ``more`` (older ones exist) and ``resume_step`` as ``ckpt_restore``'s. Only the uid
    that registered the rank; it counts as one of the uid's restores (its manifests are
    read, maybe from holders).

A pack counts against the job's disk quota on this node at its full size (before
chunks already here are skipped) and a commit as one etcd write of the job
(:mod:`raps_slurm.agent.quota`): refused with kind ``quota`` over them. A restore
allocates only the non-zero part of the state and the chunks it pulls, charged to the
caller's uid first; a uid runs at most ``agent.uid_restores_at_once`` at once
(:mod:`raps_slurm.agent.uid_limits`): refused with kind ``busy`` or ``quota``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
import typing

from raps_slurm.agent.api_schema import EPOCH, JOB, RANK, Check, Omittable, Refused, is_int
from raps_slurm.agent.local_api import Extension, Peer, RankTable, close_fds, registered_epoch
from raps_slurm.agent.quota import JobQuotas
from raps_slurm.agent.recovery_api import record_event
from raps_slurm.agent.uid_limits import RESTORE, UidLimits, shared
from raps_slurm.checkpoint.manifest import MAX_MANIFEST, Manifest
from raps_slurm.checkpoint.pack import PackError, is_sealed, sealed_bytes
from raps_slurm.checkpoint.restore_parts import RestoreError
from raps_slurm.checkpoint.service import CheckpointService, Fenced, LogUnbacked
from raps_slurm.core.checkpoints import restore_order
from raps_slurm.core.planner import Plan, plan_id
from raps_slurm.errors import RapsError, RecordError, StoreError, StoreUnavailable

log = logging.getLogger("raps.agent")

_BASE: Check = (lambda v: v is None or is_int(v, 1, 2**63 - 1), "null or an integer >= 1")
_GENERATION = Omittable((lambda v: v is None or is_int(v, 1, 2**63 - 1),
                         "null or an integer >= 1"))
MAX_LISTED = 64  # generations ckpt_generations lists (checkpoint.max_generations: 5)
MANIFEST_BYTES_PER_CHUNK = 80  # ["<64 hex>",<size>], in a manifest's JSON
# A generation record's JSON is ~450 bytes with two holders; charged as the most it takes.
_RECORD_CHARGE = bytes(1024)
_SESSION: Check = (lambda v: isinstance(v, str) and len(v) == 32 and v.isalnum(),
                   "a session id from ckpt_begin")


class CheckpointOps:
    """The handlers; sessions are bound to the uid that opened them."""

    def __init__(self, service: CheckpointService, ranks: RankTable,
                 quotas: JobQuotas | None = None, limits: UidLimits | None = None) -> None:
        self.service, self.ranks = service, ranks
        self.quotas = quotas if quotas is not None else JobQuotas()
        self.limits = limits if limits is not None else shared(service, service.cfg.agent)
        self._owners: dict[str, tuple[int, str, int]] = {}  # session -> (uid, job, rank)
        self._lock = threading.Lock()

    def extensions(self) -> dict[str, Extension]:
        """What :class:`LocalApiServer` serves for checkpoints."""
        return {
            "ckpt_begin": Extension({"job": JOB, "rank": RANK, "epoch": EPOCH, "base": _BASE},
                                    self.begin),
            "ckpt_put": Extension({"session": _SESSION}, self.put),
            "ckpt_commit": Extension({"session": _SESSION}, self.commit),
            "ckpt_abort": Extension({"session": _SESSION}, self.abort),
            "ckpt_restore": Extension({"job": JOB, "rank": RANK, "generation": _GENERATION},
                                      self.restore),
            "ckpt_generations": Extension({"job": JOB, "rank": RANK}, self.generations),
        }

    # --- checks --------------------------------------------------------------------------

    def _rank_of(self, peer: Peer, job: str, rank: int) -> int | None:
        """The registered epoch of a rank the peer may act for (root: any, maybe None)."""
        return registered_epoch(self.ranks, peer, job, rank)

    def _session(self, peer: Peer, sid: str) -> tuple[str, int]:
        with self._lock:
            owner = self._owners.get(sid)
        if owner is None:
            raise Refused("session", f"no open checkpoint session {sid!r}")
        if peer.uid != 0 and owner[0] != peer.uid:
            raise Refused("permission", "permission denied: the session belongs to uid "
                                        f"{owner[0]}, you are uid {peer.uid}")
        return owner[1], owner[2]

    @staticmethod
    def _one_sealed(fds: list[int], what: str, limit: int) -> int:
        if len(fds) != 1:
            raise Refused("fds", f"{what}: expected exactly one descriptor, got {len(fds)}")
        fd = fds[0]
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not is_sealed(fd):
            raise Refused("fds", f"{what}: the descriptor must be a sealed memory file "
                                 "(memfd with write, grow and shrink seals)")
        if st.st_size > limit:
            raise Refused("size", f"{what}: {st.st_size} bytes is more than {limit}")
        return fd

    # --- ops -----------------------------------------------------------------------------

    def begin(self, f: dict[str, object], peer: Peer, fds: list[int]
              ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        epoch, base = typing.cast(int, f["epoch"]), typing.cast("int | None", f["base"])
        registered = self._rank_of(peer, job, rank)
        if registered is not None and registered != epoch:
            raise Refused("epoch", f"epoch {epoch} is not the registered epoch {registered} "
                                   f"of rank {rank} of job {job}")
        sid, base_ok = self.service.begin(job, rank, epoch, base)
        with self._lock:
            self._owners[sid] = (peer.uid, job, rank)
        p = self.service.params
        return {"ok": True, "session": sid, "base_ok": base_ok,
                "params": {"avg_chunk_kb": p.avg_chunk_kb, "digest": p.digest,
                           "zstd_level": p.zstd_level, "shuffle": p.shuffle}}, []

    def put(self, f: dict[str, object], peer: Peer, fds: list[int]
            ) -> tuple[dict[str, object], list[int]]:
        try:
            sid = typing.cast(str, f["session"])
            job, _ = self._session(peer, sid)
            fd = self._one_sealed(fds, "ckpt_put", 1 << 36)
            size = os.fstat(fd).st_size
            self.quotas.reserve_disk("ckpt_put", job, size)
            try:
                written, nbytes = self.service.put(sid, fd)
            except PackError as exc:
                self.quotas.release_disk(job, size)
                raise Refused("pack", f"ckpt_put: {exc}") from None
            except BaseException:
                self.quotas.release_disk(job, size)
                raise
            return {"ok": True, "chunks": written, "bytes": nbytes}, []
        finally:
            close_fds(fds)

    def commit(self, f: dict[str, object], peer: Peer, fds: list[int]
               ) -> tuple[dict[str, object], list[int]]:
        sid = typing.cast(str, f["session"])
        try:
            job, _ = self._session(peer, sid)
            fd = self._one_sealed(fds, "ckpt_commit", MAX_MANIFEST)
            try:
                # two writes: the shared record and the node's own commit of it
                for _ in range(2):
                    self.quotas.write("ckpt_commit", job, peer.uid, _RECORD_CHARGE)
            except Refused:
                self.service.abort(sid)  # its pinned chunks go at the next collection
                raise
            raw = os.pread(fd, MAX_MANIFEST, 0)
            try:
                record = self.service.commit(sid, raw)
            except Fenced as exc:
                raise Refused("epoch", str(exc)) from None
            except LogUnbacked as exc:
                # nothing lost: the previous generation stands, the rank goes on and its
                # next checkpoint commits once the backup (or a repaired group) holds the log
                raise Refused("unbacked", f"ckpt_commit: {exc}") from None
            except StoreUnavailable as exc:
                # etcd away (no quorum): nothing was committed and nothing is lost; the
                # rank goes on and commits at its next checkpoint.
                raise Refused("unavailable", f"ckpt_commit: etcd unavailable, generation "
                                             f"not committed: {exc}") from None
            except (RecordError, RapsError) as exc:
                raise Refused("manifest", f"ckpt_commit: {exc}") from None
            return {"ok": True, "generation": record.generation, "state": record.state,
                    "holders": list(record.holders), "epoch": record.epoch}, []
        finally:
            close_fds(fds)
            self._forget(sid)

    def abort(self, f: dict[str, object], peer: Peer, fds: list[int]
              ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        sid = typing.cast(str, f["session"])
        self._session(peer, sid)
        self.service.abort(sid)
        self._forget(sid)
        return {"ok": True}, []

    def restore(self, f: dict[str, object], peer: Peer, fds: list[int]
                ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        wanted = typing.cast("int | None", f.get("generation"))
        epoch = self._rank_of(peer, job, rank)
        asked = time.time()
        try:
            # what the restore allocates is charged to the caller's uid, refused over it
            with self.limits.op(RESTORE, peer.uid, "ckpt_restore") as charge:
                result = self.service.restore(job, rank, charge, wanted)
        except RestoreError as exc:
            if epoch is not None:
                self._lost(job, rank, epoch, peer, str(exc), not exc.unreached)
            raise Refused("lost", str(exc)) from None
        if result is None and wanted is not None:
            raise Refused("no_generation", f"rank {rank} of job {job} has no generation "
                                           f"{wanted} (ckpt_generations lists them)")
        resume = self._resume_step(job, rank, epoch)
        if result is None:
            if epoch is not None and epoch > 1:
                self.recovery_event(job, rank, epoch, "restored", {
                    "generation": None, "bytes": 0, "bytes_pulled": 0, "chunks_pulled": 0,
                    "sources": [], "fallbacks": []})
            return {"ok": True, "generation": None, "fallbacks": [], "size": 0,
                    "resume_step": resume}, []
        r = result.restored
        manifest_fd = sealed_bytes(r.manifest.to_json(), "raps-manifest")
        if r.buffer is not None:
            r.buffer.close()  # the rank maps its own view; ours must not outlive the reply
        log.info("local API: restored rank %d of job %s from generation %s for pid %d", rank,
                 job, result.generation, peer.pid)
        if epoch is not None and epoch > 1:
            self.recovery_event(job, rank, epoch, "restored", {
                "generation": result.generation, "bytes": r.manifest.total_size,
                "bytes_pulled": result.pulled_bytes, "chunks_pulled": result.pulled_chunks,
                "sources": list(result.sources), "asked_at": asked, "pull_s": result.pull_s,
                "local_s": result.local_s, "early": result.early,
                "fallbacks": [fb.to_dict() for fb in result.fallbacks]})
        return {"ok": True, "generation": result.generation,
                "fallbacks": [fb.to_dict() for fb in result.fallbacks],
                "size": r.manifest.total_size, "pulled_chunks": result.pulled_chunks,
                "resume_step": resume}, [r.fd, manifest_fd]

    def generations(self, f: dict[str, object], peer: Peer, fds: list[int]
                    ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        epoch = self._rank_of(peer, job, rank)
        try:
            records = restore_order(self.service.trusted_records(job, rank))
        except RestoreError as exc:
            raise Refused("lost", str(exc)) from None
        out: list[dict[str, object]] = []
        listed = records[:MAX_LISTED]
        # manifests read from holders, one at a time: in turn with the uid's restores, and
        # charged to it as the largest of them (about 80 bytes of JSON per chunk)
        with self.limits.op(RESTORE, peer.uid, "ckpt_generations") as charge:
            charge(max((rec.chunks for rec in listed), default=0) * MANIFEST_BYTES_PER_CHUNK)
            for rec in listed:
                m = self.service.manifest(job, rank, rec)
                out.append({"generation": rec.generation, "label": _label(m)})
        return {"ok": True, "generations": out, "more": len(records) > MAX_LISTED,
                "resume_step": self._resume_step(job, rank, epoch)}, []

    def _resume_step(self, job: str, rank: int, epoch: int | None) -> int | None:
        """The step the rank had reached before the fault that relaunched it: the
        ``progress`` of the plan that gave it ``epoch`` (None: no plan, or no progress)."""
        if epoch is None or epoch < 2:
            return None
        try:
            kv = self.service.store.get(self.service.keys.plan(plan_id(job, rank, epoch)))
            return Plan.from_json(kv.key, kv.value).progress if kv is not None else None
        except (StoreError, RecordError) as exc:
            log.warning("job %s rank %d: resume step unknown: %s", job, rank, exc)
            return None

    def _lost(self, job: str, rank: int, epoch: int, peer: Peer, reason: str,
              checked: bool) -> None:
        """Record the rank's verdict ESCALATE: a relaunch on another spare would find the
        same generations. ``checked`` (every holder answered, every copy is damaged):
        ``lost``, and the leader gives up; else it requeues the run, which may find the
        holders back (docs/recovery.md). Written before the refusal reaches the rank, so
        before raps-run sees it exit."""
        value = {"kind": "ESCALATE", "node": self.service.node, "job": job, "rank": rank,
                 "epoch": epoch, "at": time.time(), "requeue": True, "lost": checked,
                 "evidence": {"reason": f"its checkpoint could not be restored: "
                                        f"{reason}"[:300]}}
        try:
            self.service.store.put(self.service.keys.rank_escalation(self.service.node, job,
                                                                      rank),
                                   self.quotas.write("escalate", job, peer.uid,
                                                     json.dumps(value).encode()))
        except (StoreError, Refused) as exc:
            log.error("job %s rank %d: lost checkpoint not reported: %s", job, rank, exc)
        else:
            log.error("job %s rank %d epoch %d: no checkpoint generation whole: %s", job,
                      rank, epoch, reason)

    def recovery_event(self, job: str, rank: int, epoch: int, phase: str,
                       detail: dict[str, object]) -> None:
        """Report a phase of the recovery plan that gave this rank ``epoch`` (if one did:
        a requeued job's ranks restore without a plan)."""
        record_event(self.service.store, self.service.keys, self.service.node,
                     plan_id(job, rank, epoch), phase, detail)

    def _forget(self, sid: str) -> None:
        with self._lock:
            self._owners.pop(sid, None)


def _label(m: Manifest | None) -> int | None:
    """The ``version`` a libraps rank gave a generation (its manifest's
    ``extra.libraps.version``), or None."""
    lib = m.extra.get("libraps") if m is not None else None
    v = lib.get("version") if isinstance(lib, dict) else None
    return v if is_int(v, 0, 2**63 - 1) else None
