"""The StateStore contract: the only door to shared state (etcd in production).

Every backend (``MemoryStore``, ``EtcdStore``) passes the same contract tests in
``tests/contract``. The semantics follow etcd v3 so that the in-memory backend
can stand in for etcd in unit tests and in the simulator:

- One global *revision* counts committed writes. Every write call that changes
  something (put, create, CAS, delete, delete_prefix, lease revoke or expiry
  that removes keys) commits as ONE revision, whatever the number of keys.
- Each key carries ``create_revision`` (revision that created it, reset when the
  key is deleted and created again) and ``mod_revision`` (last revision that
  wrote it).
- Keys are ``str`` (encoded as UTF-8), values are ``bytes`` (any bytes).

What is atomic (linearizable on etcd):
- every single call: ``get``, ``get_prefix`` (one consistent snapshot of the
  whole prefix), ``put``, ``delete``, ``delete_prefix``;
- ``create``: create-if-absent, decided and written in one step;
- ``compare_and_swap``: writes only if the key's current ``mod_revision``
  equals the one given (``0`` means "the key must not exist"), in one step;
- ``transaction``: guards (each key's ``mod_revision``) checked and every
  operation applied in one step and one revision, or nothing at all. The
  coordinator guards each write with its leader key's revision this way, so a
  deposed leader cannot write; at most ``MAX_TXN_OPS`` operations, no key twice;
- lease grant, refresh (keep-alive) and revoke; when a lease is revoked or
  expires, all keys attached to it vanish in one revision.

Nothing is atomic *across* calls: a get followed by a put is a race; use
``compare_and_swap`` with the ``mod_revision`` from the get.

Failures: a backend raises ``StoreUnavailable`` when the store cannot be
reached or does not answer in time (never a raw HTTP or socket exception).
If a write (``create``, ``compare_and_swap``, ``delete``, ``delete_prefix``)
fails that way after the request may have reached the server, its outcome is
unknown: read the key again before deciding. ``LeaseExpired`` is raised when a
lease that is gone is refreshed or used in a write. Other store failures raise
``StoreError``. Backends are safe to share between threads.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

# etcd's default --max-txn-ops; every backend enforces it so code tested on memory fits etcd.
MAX_TXN_OPS = 128


@dataclass(frozen=True)
class StoreStatus:
    """What the store says about itself (etcd: the answering member's status)."""

    revision: int
    db_size: int          # bytes the database file takes (etcd: dbSize; the quota counts it)
    db_size_in_use: int   # bytes holding data still reachable (etcd: dbSizeInUse)
    version: str
    alarms: tuple[str, ...] = ()  # raised alarms, e.g. NOSPACE (writes refused)


@dataclass(frozen=True)
class KeyValue:
    """One key as read from the store; ``lease_id`` is None when no lease holds it."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease_id: int | None


@dataclass(frozen=True)
class Lease:
    """A granted lease; ``ttl`` is the TTL the store granted (etcd may round up)."""

    id: int
    ttl: int


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix; ``value`` is empty and ``create_revision`` 0 for
    a delete."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int
    create_revision: int = 0


@dataclass(frozen=True)
class Guard:
    """A transaction condition: ``key`` has this ``mod_revision`` (0: does not exist)."""

    key: str
    mod_revision: int


@dataclass(frozen=True)
class Put:
    """A transaction operation: write ``value`` at ``key`` (attached to ``lease`` if given)."""

    key: str
    value: bytes
    lease: Lease | None = None


@dataclass(frozen=True)
class Delete:
    """A transaction operation: delete ``key``, or every key under it with ``prefix=True``."""

    key: str
    prefix: bool = False


TxnOp = Put | Delete


class Watch(abc.ABC):
    """A stream of events under one prefix, in revision order.

    ``next`` returns the next event, or None if none came within ``timeout``
    seconds or the watch was cancelled. If the stream is lost (store down) the
    events already received are delivered first, then ``next`` raises
    ``StoreUnavailable`` (open a new watch from the last ``mod_revision`` seen + 1);
    if the requested start revision is no longer in the store's history (compacted)
    it raises ``HistoryCompacted`` (read what is needed and watch from the current
    revision).
    """

    @abc.abstractmethod
    def next(self, timeout: float) -> WatchEvent | None:
        """Wait up to ``timeout`` seconds for the next event."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop the watch and release its resources; idempotent."""

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cancel()


class StateStore(abc.ABC):
    """Key-value store with revisions, leases and watches (see module docstring)."""

    @abc.abstractmethod
    def get(self, key: str) -> KeyValue | None:
        """The key, or None if it does not exist."""

    @abc.abstractmethod
    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """All keys starting with ``prefix``, sorted by key, from one snapshot."""

    @abc.abstractmethod
    def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        """Write unconditionally; returns the new revision.

        With ``lease`` the key is attached to it (and detached from any other
        lease); without, any lease it had is detached, as in etcd.
        Raises ``LeaseExpired`` if ``lease`` is gone.
        """

    @abc.abstractmethod
    def create(self, key: str, value: bytes, lease: Lease | None = None) -> bool:
        """Atomic create-if-absent; False (and nothing written) if the key exists."""

    @abc.abstractmethod
    def compare_and_swap(self, key: str, value: bytes, mod_revision: int,
                         lease: Lease | None = None) -> bool:
        """Atomic write if the key's current ``mod_revision`` equals the given one.

        ``mod_revision=0`` means the key must not exist. Returns False (and
        writes nothing) on a mismatch.
        """

    @abc.abstractmethod
    def transaction(self, guards: Sequence[Guard], ops: Sequence[TxnOp]) -> bool:
        """Apply every op in one revision if every guard holds; else write nothing, False.

        A key must not be written twice, nor written and deleted (a Put inside a
        deleted prefix counts);
        raises ValueError for that or for more than ``MAX_TXN_OPS`` ops, and
        ``LeaseExpired`` if a Put's lease is gone (only when the guards hold).
        """

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Delete one key; False if it did not exist."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix`` in one revision; returns the count."""

    @abc.abstractmethod
    def grant_lease(self, ttl: int) -> Lease:
        """Grant a lease of ``ttl`` seconds (>= 1); it expires unless refreshed."""

    @abc.abstractmethod
    def refresh_lease(self, lease: Lease) -> None:
        """Reset the lease's countdown to its TTL; raises ``LeaseExpired`` if it is gone.

        No backend refreshes on its own: callers refresh at about TTL/3.
        """

    @abc.abstractmethod
    def revoke_lease(self, lease: Lease) -> None:
        """Revoke the lease; its keys vanish in one revision. A gone lease is a no-op."""

    @abc.abstractmethod
    def watch_prefix(self, prefix: str, start_revision: int | None = None) -> Watch:
        """Watch every key starting with ``prefix``.

        Without ``start_revision`` only changes committed after this call
        returns are delivered; with it, every change from that revision on
        (history first, then live), in revision order.
        """

    @abc.abstractmethod
    def current_revision(self) -> int:
        """The store's latest committed revision."""

    @abc.abstractmethod
    def status(self) -> StoreStatus:
        """Revision, database size, version and raised alarms."""

    @abc.abstractmethod
    def quorum_lost(self, timeout: float = 1.0) -> bool:
        """True only when no write can succeed anywhere: a majority of the members refuse
        connections (not running) or answer without a leader. False while the store works
        and whenever that cannot be proven (a member that times out may be running on the
        other side of a partition). Each member gets ``timeout`` seconds to answer.
        Never raises for an unreachable store."""

    @abc.abstractmethod
    def compact(self, revision: int) -> None:
        """Forget the history before ``revision`` (a watch from an older revision then
        fails). At or below an earlier compaction: nothing to do; a revision not yet
        written: StoreError."""

    @abc.abstractmethod
    def close(self) -> None:
        """Cancel open watches and release connections; idempotent."""

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def check_key(key: object, what: str = "key") -> str:
    """Reject what no backend can store the same way: non-str or empty keys."""
    if not isinstance(key, str):
        raise TypeError(f"{what} must be str, not {type(key).__name__}")
    if not key:
        raise ValueError(f"{what} must not be empty")
    return key


def check_value(value: object) -> bytes:
    """Values are bytes; refusing str here avoids silent encoding choices."""
    if not isinstance(value, bytes):
        raise TypeError(f"value must be bytes, not {type(value).__name__}")
    return value


def check_ttl(ttl: object) -> int:
    """TTLs are whole seconds, as etcd grants them."""
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
        raise ValueError(f"lease ttl must be an int >= 1 second, got {ttl!r}")
    return ttl


def check_revision(mod_revision: object) -> int:
    """A revision to compare with is an int >= 0 (0: must not exist)."""
    if isinstance(mod_revision, bool) or not isinstance(mod_revision, int) or mod_revision < 0:
        raise ValueError(f"mod_revision must be an int >= 0, got {mod_revision!r}")
    return mod_revision


def check_txn(guards: Sequence[Guard], ops: Sequence[TxnOp]) -> None:
    """Reject what etcd would reject: too many ops, a key touched twice, bad types."""
    if len(ops) > MAX_TXN_OPS or len(guards) > MAX_TXN_OPS:
        raise ValueError(f"a transaction takes at most {MAX_TXN_OPS} guards and "
                         f"{MAX_TXN_OPS} ops, got {len(guards)} and {len(ops)}")
    for g in guards:
        if not isinstance(g, Guard):
            raise TypeError(f"guards must be Guard, not {type(g).__name__}")
        check_key(g.key, "guard key")
        check_revision(g.mod_revision)
    puts: list[str] = []
    deletes: list[Delete] = []
    for op in ops:
        if isinstance(op, Put):
            puts.append(check_key(op.key))
            check_value(op.value)
        elif isinstance(op, Delete):
            check_key(op.key)
            deletes.append(op)
        else:
            raise TypeError(f"ops must be Put or Delete, not {type(op).__name__}")
    dup = {k for k in puts if puts.count(k) > 1}
    dup |= {k for k in puts for d in deletes if k == d.key or (d.prefix and k.startswith(d.key))}
    if dup:
        raise ValueError("a transaction must not write and delete or write twice the same "
                         f"key: {', '.join(sorted(dup))}")


__all__ = ["MAX_TXN_OPS", "Delete", "Guard", "KeyValue", "Lease", "Put", "StateStore", "TxnOp",
           "Watch", "WatchEvent", "check_key", "check_revision", "check_ttl", "check_txn",
           "check_value"]
