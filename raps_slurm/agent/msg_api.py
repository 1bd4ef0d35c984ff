"""Messaging ops of the agent's local API: what a rank's runtime needs besides checkpoints.

A rank holds no etcd credentials: it publishes its listening address and reads its
peers' through its agent, and it hands its message-log segments to the agent, which
keeps them in the node's store and copies them to the rank's log backup. Ops:

``peer_publish {job, rank, epoch, host, port, done}``  only the uid that registered the
    rank, with the registered epoch; written to ``reports/ranks/<node>/<id>/peers/<rank>``
    (``done``: the rank finished its program and waits for the others at ``finalize``;
    its silence is then no hang). ``host`` and ``port`` may be null only with ``done``:
    a rank that serves no messages (a libraps rank at ``raps_finalize``) has none.
``peer_lookup {job, rank}``  only the job's owner; ``host``/``port``/``epoch``/``done``
    or nulls: what the node the rank map gives the rank published (``host`` and
    ``port`` null, with its ``epoch`` and ``done``, for a rank that published none).
``log_append {job, rank, epoch}`` + sealed memory file   one log segment (parsed before
    it is kept); refused with kind ``epoch`` for a superseded epoch.
``log_read {job, rank}``  every segment (pulled from the log backup when this node has
    none, as on a spare after a relaunch), as a sealed memory file.
``log_trim {job, rank, floors}``  drop segments the receivers' floors cover.
``msg_stats {job, rank, stats}``  the rank's message-log figures, for ``rapsctl inspect``.
``escalate {job, rank, reason, requeue}``  a case the runtime cannot serve (a hole in a
    replay, a message that contradicts the log, a receive that timed out): recorded, with
    the rank's registered epoch, as the rank's verdict ``ESCALATE``; if ``requeue`` (the
    runtime's call), the leader requeues the job run from its checkpoints
    (docs/recovery.md).

Every etcd write here (``peer_publish``, ``msg_stats``, ``escalate``) and every segment
``log_append`` keeps is charged to the job's quotas (:mod:`raps_slurm.agent.quota`):
refused with kind ``quota`` over them. What ``log_append`` and ``log_read`` hold in the
agent's memory (the segment; the log, copied into the reply's memory file a piece at a
time) is charged to the caller's uid first, and a uid runs at most
``agent.uid_log_ops_at_once`` of them at once (:mod:`raps_slurm.agent.uid_limits`).
"""

from __future__ import annotations

import json
import os
import time
import typing
from collections.abc import Callable

from raps_slurm.agent.api_schema import EPOCH, JOB, RANK, Check, Refused, is_int
from raps_slurm.agent.local_api import (
    Extension,
    Peer,
    RankTable,
    close_fds,
    registered_epoch,
    require_owner,
)
from raps_slurm.agent.quota import JobQuotas
from raps_slurm.agent.uid_limits import LOG, Charge, UidLimits, shared
from raps_slurm.checkpoint.logstore import MAX_SEGMENT, LogStore, LogStoreError
from raps_slurm.checkpoint.pack import is_sealed, seal_memfd, write_all
from raps_slurm.checkpoint.service import CheckpointService
from raps_slurm.core.jobs import RankEntry
from raps_slurm.errors import RecordError

_HOST: Check = (lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= 255
                and v.isascii() and v.isprintable() and " " not in v),
                "a host name or address (null only with done)")
_PORT: Check = (lambda v: v is None or is_int(v, 1, 65535),
                "a port 1..65535 (null only with done)")
_DONE: Check = (lambda v: isinstance(v, bool), "true or false")
_FLOORS: Check = (lambda v: isinstance(v, dict) and len(v) <= 1 << 20 and all(
    isinstance(k, str) and k.isdigit() and is_int(x, 0, 2**63 - 1) for k, x in v.items()),
    "an object of rank -> seq")
_STATS: Check = (lambda v: isinstance(v, dict) and len(json.dumps(v)) <= 1 << 16,
                 "an object of at most 64 KiB")
_REASON: Check = (lambda v: isinstance(v, str) and 0 < len(v) <= 1000, "a text of 1..1000")
_REQUEUE: Check = (lambda v: isinstance(v, bool), "true or false")


class MessagingOps:
    """The handlers."""

    def __init__(self, service: CheckpointService, ranks: RankTable,
                 owner_of: Callable[[str], int | None],
                 quotas: JobQuotas | None = None, limits: UidLimits | None = None) -> None:
        self.service, self.ranks, self._owner_of = service, ranks, owner_of
        self.quotas = quotas if quotas is not None else JobQuotas()
        self.limits = limits if limits is not None else shared(service, service.cfg.agent)
        self.store, self.keys = service.store, service.keys

    def extensions(self) -> dict[str, Extension]:
        """What :class:`LocalApiServer` serves for messaging."""
        return {
            "peer_publish": Extension({"job": JOB, "rank": RANK, "epoch": EPOCH,
                                       "host": _HOST, "port": _PORT, "done": _DONE},
                                      self.publish),
            "peer_lookup": Extension({"job": JOB, "rank": RANK}, self.lookup),
            "log_append": Extension({"job": JOB, "rank": RANK, "epoch": EPOCH},
                                    self.log_append),
            "log_read": Extension({"job": JOB, "rank": RANK}, self.log_read),
            "log_trim": Extension({"job": JOB, "rank": RANK, "floors": _FLOORS},
                                  self.log_trim),
            "msg_stats": Extension({"job": JOB, "rank": RANK, "stats": _STATS},
                                   self.stats),
            "escalate": Extension({"job": JOB, "rank": RANK, "reason": _REASON,
                                   "requeue": _REQUEUE}, self.escalate),
        }

    def _own(self, peer: Peer, job: str, rank: int, epoch: int | None = None) -> None:
        registered = registered_epoch(self.ranks, peer, job, rank)
        if epoch is not None and registered is not None and epoch != registered:
            raise Refused("epoch", f"epoch {epoch} is not the registered epoch {registered} "
                                   f"of rank {rank} of job {job}")

    def publish(self, f: dict[str, object], peer: Peer, fds: list[int]
                ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        if (f["host"] is None or f["port"] is None) and f["done"] is not True:
            raise Refused("schema", "fields 'host' and 'port': null only with 'done' true "
                                    "(a finished rank that serves no messages)")
        self._own(peer, job, rank, typing.cast(int, f["epoch"]))
        value = json.dumps({"host": f["host"], "port": f["port"], "epoch": f["epoch"],
                            "done": f["done"], "node": self.service.node}).encode()
        self.store.put(self.keys.job_peer(self.service.node, job, rank),
                       self.quotas.write("peer_publish", job, peer.uid, value))
        return {"ok": True}, []

    def lookup(self, f: dict[str, object], peer: Peer, fds: list[int]
               ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        require_owner(self._owner_of, peer, job)
        # Only what the node the rank map gives the rank published counts: under another
        # node's prefix it is that node's claim, not the rank's.
        entry = self.store.get(self.keys.job_rank(job, rank))
        kv = None
        if entry is not None:
            try:
                node = RankEntry.from_json(entry.key, entry.value).node
            except RecordError:
                node = None
            kv = self.store.get(self.keys.job_peer(node, job, rank)) if node else None
        if kv is None:
            return {"ok": True, "host": None, "port": None, "epoch": None, "done": False}, []
        try:
            d = json.loads(kv.value)
            served = d["host"] is not None and d["port"] is not None
            return {"ok": True, "host": str(d["host"]) if served else None,
                    "port": int(d["port"]) if served else None,
                    "epoch": int(d["epoch"]), "done": bool(d.get("done"))}, []
        except (ValueError, KeyError, TypeError):
            return {"ok": True, "host": None, "port": None, "epoch": None, "done": False}, []

    def log_append(self, f: dict[str, object], peer: Peer, fds: list[int]
                   ) -> tuple[dict[str, object], list[int]]:
        try:
            job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
            self._own(peer, job, rank, typing.cast(int, f["epoch"]))
            if len(fds) != 1 or not is_sealed(fds[0]):
                raise Refused("fds", "log_append: expected one sealed memory file")
            size = os.fstat(fds[0]).st_size
            if size > MAX_SEGMENT:
                raise Refused("size", f"log_append: {size} bytes is more than {MAX_SEGMENT}")
            with self.limits.op(LOG, peer.uid, "log_append") as charge:
                charge(size)  # the segment is read whole: it is parsed before it is kept
                self.quotas.reserve_disk("log_append", job, size)
                try:
                    n = self.service.append_log(job, rank, os.pread(fds[0], size, 0),
                                                typing.cast(int, f["epoch"]))
                except LogStoreError as exc:
                    self.quotas.release_disk(job, size)
                    raise Refused("log", f"log_append: {exc}") from None
                except BaseException:
                    self.quotas.release_disk(job, size)
                    raise
            return {"ok": True, "segment": n}, []
        finally:
            close_fds(fds)

    def log_read(self, f: dict[str, object], peer: Peer, fds: list[int]
                 ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        self._own(peer, job, rank)
        with self.limits.op(LOG, peer.uid, "log_read") as charge:
            # none here (a spare after a relaunch): pulled from the log backup onto this
            # node's disk a page at a time first; never held whole, charged before copied
            self.service.logcopy.fetch(job, rank)
            fd, size = copy_log(self.service.logs, job, rank, charge)
            return {"ok": True, "size": size}, [fd]

    def log_trim(self, f: dict[str, object], peer: Peer, fds: list[int]
                 ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        self._own(peer, job, rank)
        floors = {int(k): int(v) for k, v in typing.cast("dict[str, int]", f["floors"]).items()}
        return {"ok": True, "trimmed": self.service.trim_log(job, rank, floors)}, []

    def stats(self, f: dict[str, object], peer: Peer, fds: list[int]
              ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        self._own(peer, job, rank)
        value = {"stats": f["stats"], "node": self.service.node, "at": time.time()}
        self.store.put(self.keys.job_msgstats(self.service.node, job, rank),
                       self.quotas.write("msg_stats", job, peer.uid, json.dumps(value).encode()))
        return {"ok": True}, []

    def escalate(self, f: dict[str, object], peer: Peer, fds: list[int]
                 ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        # the epoch the rank registered with: an escalation from a copy that a newer epoch
        # superseded, or from a rank not registered here, is not acted on
        epoch = registered_epoch(self.ranks, peer, job, rank)
        value = {"kind": "ESCALATE", "node": self.service.node, "job": job, "rank": rank,
                 "epoch": epoch, "at": time.time(), "requeue": f["requeue"],
                 "evidence": {"reason": f["reason"]}}
        self.store.put(self.keys.rank_escalation(self.service.node, job, rank),
                       self.quotas.write("escalate", job, peer.uid, json.dumps(value).encode()))
        return {"ok": True}, []


LOG_PIECE = 4 << 20  # bytes of a segment read at once


def copy_log(logs: LogStore, job: str, rank: int, charge: Charge) -> tuple[int, int]:
    """A sealed memory file holding a rank's segments in order, and its size: the size
    is charged first, then each segment is copied a piece at a time (the agent never
    holds the log as one buffer). A segment trimmed meanwhile, or a torn spill
    (:meth:`LogStore.torn`), is left out, as :meth:`LogStore.read` leaves it out."""
    sizes = [(n, logs.size(job, rank, n)) for n in logs.segments(job, rank)
             if not logs.torn(job, rank, n)]
    charge(sum(s for _, s in sizes))
    fd = os.memfd_create("raps-log", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        total = 0
        for n, size in sizes:
            off = 0
            while off < size:
                piece = logs.segment(job, rank, n, off, min(LOG_PIECE, size - off))
                if not piece:
                    break
                write_all(fd, [piece])
                off += len(piece)
            total += off
        seal_memfd(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd, total
