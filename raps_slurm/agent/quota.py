"""Per-job quotas at the agent's local API: what one job may cost etcd and the node's disk.

On a shared node nothing one user sends may stall or steer another user's job, nor fill
etcd (a NOSPACE alarm stops every write of every job). So, per job (docs/architecture.md,
Per-job quotas):

- every etcd write the agent makes on a rank's behalf takes a token from the job's
  bucket: ``agent.job_etcd_writes_per_sec`` sustained, at most
  ``agent.job_etcd_write_burst`` at once; an empty bucket refuses with kind ``quota``;
- no value so written is larger than ``agent.max_value_kb`` (kind ``quota``);
- every job on the node together writes at most ``agent.node_etcd_kb_per_sec`` KiB a
  second, ``agent.node_etcd_burst_kb`` at once (each write counted at its value plus
  :data:`~raps_slurm.core.budget.WRITE_OVERHEAD`; kind ``quota``): with the compaction
  retention this bounds what the cluster's agents can hold in etcd
  (:mod:`raps_slurm.core.budget`, ``rapsctl config check``). Each job that wrote in the
  last minute has an equal share of it (but room for one largest value), so that one
  job's flood cannot spend another job's share;
- a job whose reports the leader paused (etcd above ``store.report_watermark_share``)
  writes nothing until it resumes them (kind ``paused``);
- a job's checkpoint chunks and message-log segments on this node (everything under its
  job directory) stay under ``agent.job_disk_quota_mb``: a pack or segment that would
  pass it is refused (kind ``quota``) before a byte is written.

A request is charged only once it is authorized, so a user who names another user's job
is refused for permission and takes nothing from that job's bucket. Root is not rate
limited: the agent and the admins act for every job.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from raps_slurm.config import AgentConfig
from raps_slurm.core.budget import WRITE_OVERHEAD
from raps_slurm.core.hygiene import ReportPause
from raps_slurm.core.jobs import JobRecord, RankMap
from raps_slurm.errors import RecordError, Refused, StoreError
from raps_slurm.store import Keys, StateStore

# Buckets kept before full ones (jobs idle long enough to have refilled) are dropped.
_MAX_BUCKETS = 4096


# A job that wrote within this many seconds counts for the node budget's fair shares.
_ACTIVE_SEC = 60.0


class _Bucket:
    __slots__ = ("at", "bytes", "tokens")

    def __init__(self, tokens: float, at: float, nbytes: float = 0.0) -> None:
        self.tokens, self.at, self.bytes = tokens, at, nbytes


class JobQuotas:
    """Write rate, value size and disk use per job; thread-safe.

    ``disk_root``: the node's checkpoint dir (``<root>/job-<id>`` holds a job's packs,
    manifests and log segments); None: no disk quota. The bytes under a job's directory
    are counted by a walk at most every ``rescan_sec``; what is reserved in between is
    added, so concurrent writes of one job cannot pass the quota together.
    """

    def __init__(self, writes_per_sec: float = 50.0, burst: int = 1000,
                 max_value_bytes: int = 64 << 10, disk_quota_bytes: int = 100 << 30,
                 disk_root: str | os.PathLike[str] | None = None, *,
                 node_bytes_per_sec: float = 16 << 10, node_burst_bytes: int = 1 << 20,
                 paused: Callable[[str], str | None] | None = None,
                 rescan_sec: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst = writes_per_sec, burst
        self.max_value_bytes, self.disk_quota_bytes = max_value_bytes, disk_quota_bytes
        self.node_rate, self.node_burst = node_bytes_per_sec, node_burst_bytes
        self.disk_root = None if disk_root is None else Path(disk_root)
        self._paused = paused
        self._rescan, self._clock = rescan_sec, clock
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}
        self._node = _Bucket(float(node_burst_bytes), clock())
        self._disk: dict[str, tuple[int, float]] = {}  # job -> (bytes, counted at)

    @classmethod
    def from_config(cls, cfg: AgentConfig, disk_root: str | os.PathLike[str] | None,
                    paused: Callable[[str], str | None] | None = None) -> JobQuotas:
        """The quotas ``cfg`` sets, for the jobs whose data lives under ``disk_root``;
        ``paused``: the leader's pause of a job's reports (:class:`PauseBook`)."""
        return cls(cfg.job_etcd_writes_per_sec, cfg.job_etcd_write_burst,
                   cfg.max_value_kb << 10, cfg.job_disk_quota_mb << 20, disk_root,
                   node_bytes_per_sec=cfg.node_etcd_kb_per_sec * 1024,
                   node_burst_bytes=cfg.node_etcd_burst_kb << 10, paused=paused)

    # --- etcd ----------------------------------------------------------------------------

    def write(self, op: str, job: str, uid: int, value: bytes = b"") -> bytes:
        """Charge one etcd write of ``value`` for ``job``; returns ``value``.

        Refused (kind ``quota``) when the value is too large or the job's or the node's
        bucket is empty; (kind ``paused``) while the leader pauses the job's reports.
        """
        if len(value) > self.max_value_bytes:
            raise Refused("quota", f"{op}: a value of {len(value)} bytes is more than "
                                   f"agent.max_value_kb={self.max_value_bytes / 1024:g} "
                                   f"({self.max_value_bytes} bytes); nothing written")
        if uid == 0:
            return value
        if self._paused is not None:
            why = self._paused(job)
            if why is not None:
                raise Refused("paused", f"{op}: {why}; nothing written")
        cost = float(len(value) + WRITE_OVERHEAD)
        now = self._clock()
        with self._lock:
            b = self._buckets.get(job)
            if b is None:
                if len(self._buckets) >= _MAX_BUCKETS:
                    self._forget_full(now)
                b = self._buckets[job] = _Bucket(float(self.burst), now, float(self.node_burst))
            shares = max(1, sum(1 for x in self._buckets.values() if now - x.at < _ACTIVE_SEC))
            rate = self.node_rate / shares
            room = max(self.node_burst / shares, float(self.max_value_bytes + WRITE_OVERHEAD))
            b.tokens = min(float(self.burst), b.tokens + (now - b.at) * self.rate)
            b.bytes = min(room, b.bytes + (now - b.at) * rate)
            b.at = now
            if b.tokens < 1.0:
                wait = (1.0 - b.tokens) / self.rate
                raise Refused("quota", f"{op}: job {job} is over its etcd write rate "
                                       f"(agent.job_etcd_writes_per_sec={self.rate:g}, "
                                       f"burst {self.burst}); nothing written, try again "
                                       f"in {wait:.2f}s")
            n = self._node
            n.tokens = min(float(self.node_burst), n.tokens + (now - n.at) * self.node_rate)
            n.at = now
            if b.bytes < cost or n.tokens < cost:
                wait = max(cost - b.bytes, 0.0) / rate + max(cost - n.tokens, 0.0) / self.node_rate
                who = (f"job {job} is over its share of" if b.bytes < cost
                       else "this node's jobs together are over")
                raise Refused("quota", f"{op}: {who} this node's "
                                       "etcd budget (agent.node_etcd_kb_per_sec="
                                       f"{self.node_rate / 1024:g}, burst "
                                       f"{self.node_burst >> 10} KiB, shared by {shares} "
                                       f"jobs); nothing written, try again in {wait:.2f}s")
            b.tokens -= 1.0
            b.bytes -= cost
            n.tokens -= cost
        return value

    def _forget_full(self, now: float) -> None:
        for job, b in list(self._buckets.items()):
            if b.tokens + (now - b.at) * self.rate >= self.burst:
                del self._buckets[job]

    # --- disk ----------------------------------------------------------------------------

    def reserve_disk(self, op: str, job: str, nbytes: int) -> None:
        """Count ``nbytes`` about to be written for ``job`` on this node; Refused (kind
        ``quota``, nothing counted) when that would pass the job's disk quota."""
        if self.disk_root is None:
            return
        used = self._used(job)
        with self._lock:
            counted, at = self._disk.get(job, (used, self._clock()))
            if counted + nbytes > self.disk_quota_bytes:
                raise Refused("quota", f"{op}: job {job} keeps {counted} bytes of "
                                       f"checkpoints and logs on this node; {nbytes} more "
                                       "would pass its quota agent.job_disk_quota_mb="
                                       f"{self.disk_quota_bytes / (1 << 20):g} "
                                       f"({self.disk_quota_bytes} bytes); nothing written")
            self._disk[job] = (counted + nbytes, at)

    def release_disk(self, job: str, nbytes: int) -> None:
        """Give back a reservation whose write failed."""
        with self._lock:
            if job in self._disk:
                counted, at = self._disk[job]
                self._disk[job] = (max(0, counted - nbytes), at)

    def _used(self, job: str) -> int:
        """The job's bytes on this node as last counted (walked again when stale)."""
        now = self._clock()
        with self._lock:
            got = self._disk.get(job)
            if got is not None and now - got[1] < self._rescan:
                return got[0]
        assert self.disk_root is not None
        used = dir_bytes(self.disk_root / f"job-{job}")
        with self._lock:
            self._disk[job] = (used, now)
            if len(self._disk) > _MAX_BUCKETS:  # jobs long gone from this node
                for old in [j for j, (_, t) in self._disk.items() if now - t > self._rescan]:
                    del self._disk[old]
        return used


class PauseBook:
    """The leader's pauses of jobs' reports (``jobs/<id>/paused``), read at most every
    ``refresh_sec`` per job; call it with a job id: the pause's line, or None.

    etcd out of reach: the last answer stands (none for a job never read), since the
    writes it would guard fail then anyway.
    """

    def __init__(self, store: StateStore, keys: Keys, refresh_sec: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.keys, self.refresh = store, keys, refresh_sec
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[str | None, float]] = {}

    def __call__(self, job: str) -> str | None:
        now = self._clock()
        with self._lock:
            got = self._seen.get(job)
        if got is not None and now - got[1] < self.refresh:
            return got[0]
        why = got[0] if got is not None else None
        try:
            kv = self.store.get(self.keys.job_paused(job))
            why = None if kv is None else ReportPause.from_json(kv.key, kv.value).line()
        except RecordError as exc:
            # A pause the leader wrote that cannot be read is still a pause.
            why = f"reports of job {job} paused by the leader ({exc})"
        except StoreError:
            pass
        with self._lock:
            if len(self._seen) >= _MAX_BUCKETS:
                self._seen.clear()
            self._seen[job] = (why, now)
        return why


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks not followed); 0 if none."""
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue  # collected while we walked
            total += st.st_size
    return total


def job_size(store: StateStore, keys: Keys, job: str, node: str | None = None) -> int | None:
    """Ranks of ``job``'s current run: its rank map's; before the map (or when it failed)
    the most its nodes hold (nodes × ``ranks_per_node``); None if not registered.

    With ``node`` (the asking agent's): Refused (kind ``node``) unless ``node`` is one of
    the job's nodes as its registration recorded them from Slurm, or one its rank map
    placed ranks or spares on. A rank registers only with its own node's agent, so
    another node's ranks are not the job's.
    """
    kv = store.get(keys.job(job))
    if kv is None:
        return None
    record = JobRecord.from_json(kv.key, kv.value)
    mkv = store.get(keys.job_map(job))
    rank_map = None if mkv is None else RankMap.from_json(mkv.key, mkv.value)
    current = (rank_map is not None and rank_map.restart_count == record.restart_count
               and not rank_map.error)
    if node is not None:
        allowed = set(record.nodes)
        if rank_map is not None and current:
            allowed |= set(rank_map.nodes) | set(rank_map.spares)
        if node not in allowed:
            raise Refused("node", f"node {node} is not a node of job {job} (its nodes: "
                                  f"{', '.join(sorted(allowed)) or 'none'}); a rank "
                                  "registers only with the agent of a node of its job")
    if rank_map is not None and current:
        return len(rank_map.nodes)
    return len(set(record.nodes)) * record.spec.ranks_per_node


def check_rank(job: str, rank: int, size: int | None) -> None:
    """Refused (kind ``rank``) unless ``rank`` is one of the job's ``size`` ranks."""
    if size is not None and not 0 <= rank < size:
        allowed = f"0..{size - 1}" if size > 0 else "none"
        raise Refused("rank", f"rank {rank} is outside job {job}: its ranks are {allowed}")
