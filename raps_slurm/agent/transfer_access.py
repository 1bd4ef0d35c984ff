"""Which clients this node's transfer server lets move a job's checkpoint data.

A client authenticated as a node (its pair key, :mod:`raps_slurm.checkpoint.peer_keys`)
may read or write job J's chunks, manifests and logs here only if it is one of J's
nodes: in J's registration (the allocation, spares included), its rank map (nodes and
spares), or one of its ranks' backup groups (the nodes that hold its data, which repair
copies from). Root on a compute node cannot fetch the checkpoints of a job that never
ran there. A client whose name is no
node name (``rapsctl@host``) holds the cluster key, since no node holds a key for such a
name: the head node's tools are served every job.

What a job allows is read from the store (the backup groups only when the registration
and the rank map do not name the client) and kept ``TTL`` seconds; a refusal reads it
again at most once per ``RECHECK`` seconds (a node just added to a job is served within
that), so a stream of refused requests costs the store little.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from raps_slurm.core.jobs import JobRecord, RankMap, group_from_json
from raps_slurm.errors import RapsError
from raps_slurm.store import Keys, StateStore
from raps_slurm.wire.heartbeat import is_node_name

TTL = 60.0
RECHECK = 5.0
MAX_JOBS = 4096


class JobNodes:
    """The nodes of each job, cached (thread-safe): per job, when read, the nodes, and
    whether the backup groups were read too."""

    def __init__(self, store: StateStore, keys: Keys,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store, self._keys, self._clock = store, keys, clock
        self._cache: dict[str, tuple[float, frozenset[str], bool]] = {}
        self._lock = threading.Lock()

    def _read(self, job: str, client: str) -> frozenset[str]:
        try:
            nodes, full = self._job_nodes(job, client)
        except RapsError:
            nodes, full = frozenset(), True  # unreadable or malformed: only the head node
        with self._lock:
            while len(self._cache) >= MAX_JOBS:
                self._cache.pop(next(iter(self._cache)))
            self._cache[job] = (self._clock(), nodes, full)
        return nodes

    def _job_nodes(self, job: str, client: str) -> tuple[frozenset[str], bool]:
        out: set[str] = set()
        kv = self._store.get(self._keys.job(job))
        if kv is not None:
            out.update(JobRecord.from_json(kv.key, kv.value).nodes)
        kv = self._store.get(self._keys.job_map(job))
        if kv is not None:
            m = RankMap.from_json(kv.key, kv.value)
            out.update(m.nodes, m.spares)
        if client in out:
            return frozenset(out), False
        prefix = self._keys.job_groups_prefix(job)
        for kv in self._store.get_prefix(prefix):
            rank = kv.key[len(prefix):]
            if rank.isdigit():
                g = group_from_json(kv.key, kv.value, int(rank))
                out.update((g.primary, *g.ckpt_mirrors))
                if g.log_backup:
                    out.add(g.log_backup)
        return frozenset(out), True

    def allowed(self, client: str, job: str) -> bool:
        """May ``client`` (an authenticated name) move ``job``'s data here?"""
        if not is_node_name(client):
            return True  # only a holder of the cluster key can authenticate so
        now = self._clock()
        with self._lock:
            cached = self._cache.get(job)
        if cached is not None:
            at, nodes, full = cached
            if client in nodes and now - at < TTL:
                return True
            if full and now - at < RECHECK:
                return False
        return client in self._read(job, client)
