"""In-memory StateStore with etcd's semantics, for unit tests and the simulator.

Time comes from an injectable clock so tests can expire leases without
sleeping. Expiry is checked lazily at the start of every call (and while a
watch waits), the way a reader would observe it on etcd.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from raps_slurm.errors import HistoryCompacted, LeaseExpired, StoreError, StoreUnavailable
from raps_slurm.store.base import (
    Delete,
    Guard,
    KeyValue,
    Lease,
    Put,
    StateStore,
    StoreStatus,
    TxnOp,
    Watch,
    WatchEvent,
    check_key,
    check_revision,
    check_ttl,
    check_txn,
    check_value,
)

# How often a waiting watch re-checks lease expiry when leases exist: the
# clock may be a fake one advanced by another thread, which cannot notify us.
_EXPIRY_POLL_S = 0.05


@dataclass
class _Entry:
    value: bytes
    create_revision: int
    mod_revision: int
    lease_id: int | None


@dataclass
class _LeaseState:
    ttl: int
    deadline: float
    keys: set[str] = field(default_factory=set)


class MemoryStore(StateStore):
    """Thread-safe in-memory store; revisions start at 1 like a fresh etcd.

    ``history_limit`` bounds the event history kept for watches; a watch from
    a revision older than what is kept raises StoreError, as etcd does after
    compaction.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, *,
                 history_limit: int = 100_000) -> None:
        if history_limit < 1:
            raise ValueError("history_limit must be >= 1")
        self._clock = clock
        self._cond = threading.Condition(threading.RLock())
        self._data: dict[str, _Entry] = {}
        self._leases: dict[int, _LeaseState] = {}
        self._revision = 1
        self._next_lease = 0x1000
        # History of events; _history_revs mirrors mod_revision for bisect, and
        # _history_base is the absolute index of _history[0] after trimming.
        self._history: list[WatchEvent] = []
        self._history_revs: list[int] = []
        self._history_base = 0
        self._floor = 1  # oldest revision a new watch may start from
        self._history_limit = history_limit
        self._closed = False

    # -- internals (call with the lock held) ---------------------------------

    def _enter(self) -> None:
        if self._closed:
            raise StoreUnavailable("memory store is closed")
        self._expire()

    def _expire(self) -> None:
        now = self._clock()
        due = sorted((st.deadline, lid) for lid, st in self._leases.items() if st.deadline <= now)
        for _, lid in due:
            self._drop_lease(lid)

    def _drop_lease(self, lid: int) -> None:
        state = self._leases.pop(lid)
        keys = sorted(k for k in state.keys if k in self._data)
        if keys:
            self._revision += 1
            for k in keys:
                del self._data[k]
                self._record("delete", k, b"")

    def _record(self, kind: Literal["put", "delete"], key: str, value: bytes,
                created: int = 0) -> None:
        self._history.append(WatchEvent(kind, key, value, self._revision, created))
        self._history_revs.append(self._revision)
        if len(self._history) > self._history_limit:
            # Trim in chunks so appends stay amortised O(1).
            drop = max(1, self._history_limit // 4)
            self._trim(drop, self._history_revs[drop - 1] + 1)
        self._cond.notify_all()

    def _trim(self, count: int, floor: int) -> None:
        del self._history[:count]
        del self._history_revs[:count]
        self._history_base += count
        self._floor = max(self._floor, floor)

    def _live_lease(self, lease: Lease | None) -> int | None:
        if lease is None:
            return None
        if lease.id not in self._leases:
            raise LeaseExpired(f"lease {lease.id:x} has expired or was revoked")
        return lease.id

    def _write(self, key: str, value: bytes, lease_id: int | None) -> int:
        self._revision += 1
        self._set(key, value, lease_id)
        return self._revision

    def _set(self, key: str, value: bytes, lease_id: int | None) -> None:
        """Write at the current revision (the caller bumped it once for all its writes)."""
        old = self._data.get(key)
        if old is not None and old.lease_id is not None and old.lease_id in self._leases:
            self._leases[old.lease_id].keys.discard(key)
        created = old.create_revision if old is not None else self._revision
        self._data[key] = _Entry(value, created, self._revision, lease_id)
        if lease_id is not None:
            self._leases[lease_id].keys.add(key)
        self._record("put", key, value, created)

    def _remove(self, key: str) -> None:
        entry = self._data.pop(key)
        if entry.lease_id is not None and entry.lease_id in self._leases:
            self._leases[entry.lease_id].keys.discard(key)
        self._record("delete", key, b"")

    @staticmethod
    def _kv(key: str, e: _Entry) -> KeyValue:
        return KeyValue(key, e.value, e.mod_revision, e.create_revision, e.lease_id)

    def _prefix_keys(self, prefix: str) -> list[str]:
        # Sort by UTF-8 bytes, as etcd does.
        return sorted((k for k in self._data if k.startswith(prefix)), key=lambda k: k.encode())

    # -- StateStore ----------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        check_key(key)
        with self._cond:
            self._enter()
            e = self._data.get(key)
            return None if e is None else self._kv(key, e)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        check_key(prefix, "prefix")
        with self._cond:
            self._enter()
            return [self._kv(k, self._data[k]) for k in self._prefix_keys(prefix)]

    def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        check_key(key)
        check_value(value)
        with self._cond:
            self._enter()
            return self._write(key, value, self._live_lease(lease))

    def create(self, key: str, value: bytes, lease: Lease | None = None) -> bool:
        return self.compare_and_swap(key, value, 0, lease)

    def compare_and_swap(self, key: str, value: bytes, mod_revision: int,
                         lease: Lease | None = None) -> bool:
        check_key(key)
        check_value(value)
        check_revision(mod_revision)
        with self._cond:
            self._enter()
            e = self._data.get(key)
            if (e.mod_revision if e is not None else 0) != mod_revision:
                return False
            # Like etcd, the lease is checked only on the branch that writes.
            self._write(key, value, self._live_lease(lease))
            return True

    def transaction(self, guards: Sequence[Guard], ops: Sequence[TxnOp]) -> bool:
        check_txn(guards, ops)
        with self._cond:
            self._enter()
            for g in guards:
                e = self._data.get(g.key)
                if (e.mod_revision if e is not None else 0) != g.mod_revision:
                    return False
            # Leases first: a gone lease must fail the whole transaction before any write.
            leases = {i: self._live_lease(op.lease) for i, op in enumerate(ops)
                      if isinstance(op, Put)}
            bumped = False
            for i, op in enumerate(ops):
                if isinstance(op, Delete):
                    keys = (self._prefix_keys(op.key) if op.prefix
                            else [op.key] if op.key in self._data else [])
                    if keys and not bumped:
                        self._revision += 1
                        bumped = True
                    for k in keys:
                        self._remove(k)
                else:
                    if not bumped:
                        self._revision += 1
                        bumped = True
                    self._set(op.key, op.value, leases[i])
            return True

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._cond:
            self._enter()
            if key not in self._data:
                return False
            self._revision += 1
            self._remove(key)
            return True

    def delete_prefix(self, prefix: str) -> int:
        check_key(prefix, "prefix")
        with self._cond:
            self._enter()
            keys = self._prefix_keys(prefix)
            if keys:
                self._revision += 1
                for k in keys:
                    self._remove(k)
            return len(keys)

    def grant_lease(self, ttl: int) -> Lease:
        check_ttl(ttl)
        with self._cond:
            self._enter()
            self._next_lease += 1
            self._leases[self._next_lease] = _LeaseState(ttl, self._clock() + ttl)
            self._cond.notify_all()  # waiting watches must start polling expiry
            return Lease(self._next_lease, ttl)

    def refresh_lease(self, lease: Lease) -> None:
        with self._cond:
            self._enter()
            state = self._leases.get(lease.id)
            if state is None:
                raise LeaseExpired(f"lease {lease.id:x} has expired or was revoked")
            state.deadline = self._clock() + state.ttl

    def revoke_lease(self, lease: Lease) -> None:
        with self._cond:
            self._enter()
            if lease.id in self._leases:
                self._drop_lease(lease.id)

    def watch_prefix(self, prefix: str, start_revision: int | None = None) -> Watch:
        check_key(prefix, "prefix")
        with self._cond:
            self._enter()
            if start_revision is None:
                cursor = self._history_base + len(self._history)
            else:
                if start_revision < 1:
                    raise ValueError(f"start_revision must be >= 1, got {start_revision}")
                if start_revision < self._floor:
                    raise HistoryCompacted(f"revision {start_revision} is compacted; "
                                           f"watch from {self._floor} or later")
                idx = bisect.bisect_left(self._history_revs, start_revision)
                cursor = self._history_base + idx
            return _MemoryWatch(self, prefix, cursor)

    def current_revision(self) -> int:
        with self._cond:
            self._enter()
            return self._revision

    def compact(self, revision: int) -> None:
        with self._cond:
            self._enter()
            if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
                raise ValueError(f"revision must be a positive integer, got {revision!r}")
            if revision > self._revision:
                raise StoreError(f"memory: compaction at {revision}: required revision is a "
                                 f"future revision (latest {self._revision})")
            if revision <= self._floor:
                return
            self._trim(bisect.bisect_left(self._history_revs, revision), revision)

    def status(self) -> StoreStatus:
        with self._cond:
            self._enter()
            live = sum(len(k) + len(e.value) for k, e in self._data.items())
            history = sum(len(ev.key) + len(ev.value) for ev in self._history)
            return StoreStatus(self._revision, live + history, live, "memory")

    def quorum_lost(self, timeout: float = 1.0) -> bool:
        return False  # one process: it works or is closed, never a minority

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _MemoryWatch(Watch):
    """Reads the store's history from an absolute cursor; no thread of its own."""

    def __init__(self, store: MemoryStore, prefix: str, cursor: int) -> None:
        self._store = store
        self._prefix = prefix
        self._cursor = cursor
        self._cancelled = False

    def next(self, timeout: float) -> WatchEvent | None:
        s = self._store
        deadline = time.monotonic() + max(0.0, timeout)
        with s._cond:
            while True:
                if self._cancelled:
                    return None
                if s._closed:
                    raise StoreUnavailable("memory store is closed")
                s._expire()
                idx = self._cursor - s._history_base
                if idx < 0:
                    raise HistoryCompacted("watch fell behind the kept history (compacted); "
                                           "re-watch from the current revision")
                while idx < len(s._history):
                    ev = s._history[idx]
                    idx += 1
                    self._cursor += 1
                    if ev.key.startswith(self._prefix):
                        return ev
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                s._cond.wait(min(remaining, _EXPIRY_POLL_S) if s._leases else remaining)

    def cancel(self) -> None:
        with self._store._cond:
            self._cancelled = True
            self._store._cond.notify_all()
