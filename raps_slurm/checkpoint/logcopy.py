"""Copies of a node's ranks' message-log segments to their log backups, with the lag
bounded and the commit rule's question answered: does the log backup hold every segment
up to a given one?

Each rank has a *backed* mark: the newest local segment such that it and every older
one still kept here are on the rank's current log backup. One background lane copies
segments in order, one connection per partner. When the log backup changes (the
coordinator repaired the group after a death), the lane first asks the new backup which
segments it holds (``log_have``) and copies the rest, so a new backup is complete, not
just current. Later passes to the same backup copy the segments appended since the last
pass, without listing the directory.

Back-pressure: :meth:`LogCopier.append` returns once the segment is backed or after
``max_lag`` seconds, so a rank whose flushes outrun its backup slows down. The guarantee
itself is the commit rule, enforced by :meth:`LogCopier.wait_backed` in the checkpoint
service: a generation commits only once the log up to its flush is backed.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raps_slurm.checkpoint.logstore import LogStore, LogStoreError
from raps_slurm.checkpoint.peer_keys import PeerKeys
from raps_slurm.checkpoint.transfer import (
    BATCH_BYTES,
    TokenBucket,
    TransferClient,
    TransferError,
)
from raps_slurm.checkpoint.transfer_wire import MAX_LOG_SEGMENTS_PER_PUT
from raps_slurm.core import checkpoints as decide
from raps_slurm.model import BackupGroup

log = logging.getLogger("raps.checkpoint")

GroupOf = Callable[[str, int], "BackupGroup | None"]
Peers = Callable[[], dict[str, tuple[str, int]]]


@dataclass
class _Rank:
    """A rank's replication state on this node (guarded by the copier's condition)."""

    appended: int = 0  # newest segment stored here
    backed: int = 0  # newest segment such that it and all older ones are on ``target``
    target: str | None = None  # the log backup ``backed`` refers to
    queued: bool = False  # a sync pass is in the lane's queue
    no_backup: bool = False  # the group names no log backup: nothing to wait for
    # Segments appended since the last pass took them, in order: a pass to the backup it
    # knows copies these rather than list the directory (thousands of segments when
    # checkpoints are minutes apart: 12.7 ms of CPU a listing at 6,000)
    fresh: list[int] = field(default_factory=list)
    appending: threading.Lock = field(default_factory=threading.Lock)  # see append


@dataclass
class LogCopyStats:
    """What the lane did since the agent started (reported by the agent)."""

    segments: int = 0  # segments copied
    bytes: int = 0
    slowed: int = 0  # appends that waited for the backup
    lagging: int = 0  # appends that waited ``max_lag`` and went on unbacked
    failures: int = 0  # copy passes that failed (retried at the next append or repair)
    max_lag_sec: float = 0.0  # the longest an append waited


class LogCopier:
    """The log lane of one node's checkpoint service."""

    def __init__(self, node: str, key: bytes | PeerKeys, logs: LogStore, group_of: GroupOf,
                 peers: Peers, limiter: TokenBucket, max_lag: float) -> None:
        self.node, self._key, self.logs = node, key, logs
        self._group_of, self._peers_of, self.limiter = group_of, peers, limiter
        self.max_lag = max_lag
        self.stats = LogCopyStats()
        self._cond = threading.Condition()
        self._ranks: dict[tuple[str, int], _Rank] = {}
        self._queue: queue.Queue[Callable[[], object] | None] = queue.Queue()
        # the lane's own caches (used by its one thread only): ranks flush every few ms
        self._clients: dict[str, TransferClient] = {}
        self._groups: dict[tuple[str, int], tuple[float, BackupGroup | None]] = {}
        self._peers: tuple[float, dict[str, tuple[str, int]]] = (-1e18, {})

    @property
    def queue(self) -> queue.Queue[Callable[[], object] | None]:
        """The lane's work queue (the service's worker thread drains it)."""
        return self._queue

    def close(self) -> None:
        """Close the lane's connections (after its worker stopped)."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _state(self, job: str, rank: int) -> _Rank:
        st = self._ranks.get((job, rank))
        if st is None:
            st = self._ranks[(job, rank)] = _Rank(appended=max(self.logs.segments(job, rank),
                                                               default=0))
        return st

    def append(self, job: str, rank: int, data: bytes, epoch: int = 0) -> int:
        """Store a segment here, have it copied, and wait (at most ``max_lag``) until it
        is backed; its number."""
        with self._cond:
            st = self._state(job, rank)
        # Numbered, stored and made fresh in one step per rank: a pass that sees a segment
        # as fresh has seen every older one this copier stored
        with st.appending:
            n = self.logs.append(job, rank, data, epoch=epoch)
            with self._cond:
                st.appended = max(st.appended, n)
                st.fresh.append(n)
        self.kick(job, rank)
        start = time.monotonic()
        if not self.wait_backed(job, rank, n, self.max_lag):
            self.stats.lagging += 1
        waited = time.monotonic() - start
        if waited > 0.001:
            self.stats.slowed += 1
            self.stats.max_lag_sec = max(self.stats.max_lag_sec, waited)
        return n

    def kick(self, job: str, rank: int) -> None:
        """Queue one copy pass for the rank (coalesced with one already queued)."""
        with self._cond:
            st = self._state(job, rank)
            if st.queued:
                return
            st.queued = True
        self._queue.put(lambda: self._sync(job, rank))

    def backed(self, job: str, rank: int) -> tuple[int, int]:
        """(newest segment backed, newest segment stored) of a rank."""
        with self._cond:
            st = self._state(job, rank)
            return (st.appended if st.no_backup else st.backed), st.appended

    def wait_backed(self, job: str, rank: int, upto: int, timeout: float) -> bool:
        """True once segment ``upto`` and all older ones are on the rank's log backup (or
        its group names none: nothing can hold more); False after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            st = self._state(job, rank)
            while not (st.no_backup or st.backed >= upto):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def retry_lagging(self) -> int:
        """Queue a copy pass for every rank whose backup lacks segments (the backup was
        down, or its group changed); how many. The service's repair pass calls it."""
        with self._cond:
            lagging = [k for k, st in self._ranks.items()
                       if not st.no_backup and st.backed < st.appended]
        for job, rank in lagging:
            self.kick(job, rank)
        return len(lagging)

    def forget(self, job: str, rank: int) -> None:
        """Drop a rank's state (its job ended here)."""
        with self._cond:
            self._ranks.pop((job, rank), None)

    # --- the lane ----------------------------------------------------------------------

    def _backup(self, job: str, rank: int) -> tuple[str | None, tuple[str, int] | None]:
        now = time.monotonic()
        cached = self._groups.get((job, rank))
        if cached is None or now - cached[0] > 1.0:
            cached = self._groups[(job, rank)] = (now, self._group_of(job, rank))
        if now - self._peers[0] > 1.0:
            self._peers = (now, self._peers_of())
        targets = decide.replica_targets(cached[1], self.node, 1)
        if not targets:
            return None, None
        return targets[0], self._peers[1].get(targets[0])

    def _call(self, target: str, address: tuple[str, int], header: dict[str, object],
              body: bytes = b"") -> dict[str, Any]:
        for attempt in (1, 2):
            client = self._clients.get(target)
            try:
                if client is None or client.address != address:
                    if client is not None:
                        client.close()
                    client = self._clients[target] = TransferClient(
                        self._key, self.node, address, peer=target, limiter=self.limiter)
                reply, _ = client.call(header, body)
                return reply
            except TransferError:
                self._clients.pop(target, None)
                if client is not None:
                    client.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _sync(self, job: str, rank: int) -> None:
        with self._cond:
            st = self._state(job, rank)
            st.queued = False
            backed, known = st.backed, st.target
        target, address = self._backup(job, rank)
        if target is None:
            with self._cond:
                st.no_backup, st.target = True, None
                st.fresh.clear()  # a backup named later is listed whole (target != known)
                self._cond.notify_all()
            return
        if address is None:
            return  # the backup is down: commits wait, the coordinator repairs the group
        with self._cond:
            fresh, st.fresh = st.fresh, []
        try:
            if target != known:
                reply = self._call(target, address, {"op": "log_have", "job": job,
                                                      "rank": rank})
                listed = reply.get("segments")
                have = {n for n in listed if type(n) is int} if isinstance(listed, list) \
                    else set()
                backed = 0
                segs = self.logs.segments(job, rank)
            else:
                have = set()
                segs = fresh
            batch: list[tuple[int, bytes]] = []
            size = 0
            for n in segs:
                if n <= backed or n in have:
                    continue
                if self.logs.size(job, rank, n) > BATCH_BYTES:
                    if batch:
                        self._put(target, address, job, rank, batch)
                        batch, size = [], 0
                    self._put_pieces(target, address, job, rank, n)
                    continue
                data = self.logs.segment(job, rank, n)
                if not data:  # trimmed meanwhile: its records can never be asked for
                    continue
                if batch and (size + len(data) > BATCH_BYTES
                              or len(batch) >= MAX_LOG_SEGMENTS_PER_PUT):
                    self._put(target, address, job, rank, batch)
                    batch, size = [], 0
                batch.append((n, data))
                size += len(data)
            if batch:
                self._put(target, address, job, rank, batch)
        except TransferError as exc:
            self.stats.failures += 1
            log.warning("job %s rank %d: log copy to %s failed: %s", job, rank, target, exc)
            with self._cond:
                st.target = None  # ask the backup what it holds on the next pass
            return
        with self._cond:
            st.no_backup, st.target = False, target
            # Only what was stored when this pass listed the segments is known backed.
            st.backed = max(st.backed if known == target else 0, max(segs, default=0))
            if segs is fresh and st.appended > st.backed and not st.fresh:
                st.target = None  # stored here another way (a pull): the next pass lists
            if st.appended > st.backed and not st.queued:
                st.queued = True
                self._queue.put(lambda: self._sync(job, rank))
            self._cond.notify_all()

    def _put(self, target: str, address: tuple[str, int], job: str, rank: int,
             batch: list[tuple[int, bytes]]) -> None:
        """Copy segments in one request: a rank flushes every ``batch_flush_ms``, and one
        round trip (and one directory sync on the backup) per segment let the lane fall
        seconds behind a node of busy ranks, which every commit then waited for."""
        self._call(target, address, {"op": "log_put", "job": job, "rank": rank,
                                     "segs": [[n, len(d)] for n, d in batch]},
                   b"".join(d for _, d in batch))
        for n, data in batch:
            self.logs.drop_pages(job, rank, n)  # copied: cold from now on
            self.stats.segments += 1
            self.stats.bytes += len(data)

    def _put_pieces(self, target: str, address: tuple[str, int], job: str, rank: int,
                    n: int) -> None:
        """Copy one segment larger than a request's body (a message may be up to
        MAX_SEGMENT, a frame is smaller) in BATCH_BYTES pieces, in order."""
        total = self.logs.size(job, rank, n)
        off = 0
        while off < total:
            piece = self.logs.segment(job, rank, n, off, BATCH_BYTES)
            if not piece:
                return  # trimmed meanwhile: its records can never be asked for
            self._call(target, address, {"op": "log_put", "job": job, "rank": rank,
                                         "part": [n, off, total]}, piece)
            off += len(piece)
        self.logs.drop_pages(job, rank, n)
        self.stats.segments += 1
        self.stats.bytes += total

    # --- reads and trims -------------------------------------------------------------------

    def read(self, job: str, rank: int) -> bytes:
        """A rank's log segments as one buffer (see :meth:`fetch`): for tests and tools;
        the agent's ``log_read`` copies them from disk a piece at a time."""
        return self.logs.read(job, rank) if self.fetch(job, rank) else b""

    def fetch(self, job: str, rank: int) -> bool:
        """Whether this node holds the rank's log segments, pulled from its group onto
        this node's disk (a page at a time) when none were here: a rank restored on a
        spare reloads its log from the log backup."""
        if self.logs.segments(job, rank):
            return True
        group = self._group_of(job, rank)
        peers = self._peers_of()
        for holder in [m for m in (group.log_backup, group.primary, *group.ckpt_mirrors)
                       if m] if group else []:
            if holder == self.node or holder not in peers:
                continue
            try:
                self._pull(peers[holder], holder, job, rank)
            except (TransferError, LogStoreError) as exc:
                log.warning("log of job %s rank %d from %s: %s", job, rank, holder, exc)
                continue
            with self._cond:
                st = self._state(job, rank)
                st.appended = max(st.appended, max(self.logs.segments(job, rank), default=0))
            return bool(self.logs.segments(job, rank))
        return False

    def _pull(self, address: tuple[str, int], holder: str, job: str, rank: int) -> None:
        """Copy a rank's log here from ``address``, page by page (a page is at most one
        frame; a segment larger than a page comes in pieces, stored once whole)."""
        cursor = [0, 0]
        pieces: list[bytes] = []
        with TransferClient(self._key, self.node, address, peer=holder,
                            limiter=self.limiter) as c:
            while True:
                reply, body = c.call({"op": "log_get", "job": job, "rank": rank,
                                      "from": cursor})
                pos = 0
                for item in reply.get("segments") or []:
                    if not (isinstance(item, list) and len(item) == 4 and all(
                            type(x) is int and x >= 0 for x in item)):
                        raise TransferError(f"log_get: malformed item {item!r:.60}")
                    n, off, size, total = item
                    if pieces and off == 0 and n > cursor[0]:
                        pieces = []  # trimmed meanwhile: its records are never asked for
                    expected = cursor[1] if pieces else 0
                    if n < cursor[0] or off != expected or not 0 < size <= len(body) - pos \
                            or off + size > total:
                        raise TransferError(f"log_get: item {item} out of order")
                    pieces.append(bytes(body[pos:pos + size]))
                    pos += size
                    if off + size == total:
                        self.logs.append(job, rank, b"".join(pieces), number=n)
                        pieces, cursor = [], [n + 1, 0]
                    else:
                        cursor = [n, off + size]
                if pos != len(body):
                    raise TransferError("log_get: items do not cover the body")
                if not reply.get("more"):
                    return
                if not reply.get("segments"):
                    raise TransferError("log_get: an empty page with more to come")

    def trim(self, job: str, rank: int, floors: dict[int, int]) -> int:
        """Drop segments the floors cover, here and (in the lane, after the copies queued
        before it) on the log backup."""
        n = self.logs.trim(job, rank, floors)
        body = {str(k): v for k, v in floors.items()}

        def remote() -> None:
            target, address = self._backup(job, rank)
            if target is not None and address is not None:
                with contextlib.suppress(TransferError):
                    self._call(target, address, {"op": "log_trim", "job": job, "rank": rank,
                                                 "floors": body})
        self._queue.put(remote)
        return n
