"""Leader election on one etcd key held under a lease, and leader-guarded writes.

The leader creates ``leader`` (create-if-absent) under a lease of
``coordinator.leader_lease_sec`` and refreshes it every third of the TTL. Every write
it makes is a transaction guarded by the key's ``mod_revision``: once the lease
expires and a standby creates the key again, the revision differs and a deposed
leader (paused, partitioned) can write nothing. Its own clock also tells it when to
stop: ``valid_until`` counts from the *send* time of its last successful refresh, which
is before etcd restarted the countdown, so it gives up no later than etcd does.
``ensure()`` checks that before any side effect outside etcd (Slurm commands).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from raps_slurm.errors import LeaseExpired, NotLeader, RecordError, StoreUnavailable
from raps_slurm.store import Guard, Lease, StateStore, TxnOp

log = logging.getLogger("raps.coordinator")
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"  # the daemons' %(asctime)s, to the microsecond


class Leadership:
    """This coordinator's view of the leader key; call ``step()`` once per cycle."""

    def __init__(self, store: StateStore, key: str, lease_sec: float, identity: Mapping[str, Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store, self._key, self._clock = store, key, clock
        self._ttl = max(1, math.ceil(lease_sec))  # etcd leases are whole seconds
        self._identity = dict(identity)
        self._lease: Lease | None = None
        self._revision = 0
        self._valid_until = 0.0
        self._next_refresh = 0.0
        self.leader_name = ""  # who leads, as last seen
        self.lost_reason = ""
        self.outages = 0  # lease refreshes that found etcd unavailable while leading

    @property
    def revision(self) -> int:
        """The leader key's revision this coordinator guards its writes with (0: none)."""
        return self._revision if self._lease is not None else 0

    @property
    def valid_until(self) -> float:
        """When this coordinator's leadership may end, on its clock (0: not leading)."""
        return self._valid_until if self._lease is not None else 0.0

    def is_leader(self) -> bool:
        """Leader by the local clock (the lease cannot have expired yet)."""
        return self._lease is not None and self._clock() < self._valid_until

    def step(self) -> bool:
        """Keep or seek leadership; True when this coordinator leads after the step."""
        if self._lease is not None:
            self._keep()
        if self._lease is None:
            self._campaign()
        return self.is_leader()

    def _keep(self) -> None:
        assert self._lease is not None
        now = self._clock()
        if now >= self._valid_until:
            # Said when the loop gets here, which a store call cut off from etcd can delay
            # by seconds; the leadership ended (ensure() refused) at valid_until already.
            ended = datetime.fromtimestamp(time.time() - (now - self._valid_until))
            self._lose(f"lease not refreshed for {self._ttl}s (paused or cut off from etcd); "
                       f"it ran out at {ended.strftime(LOG_TIME)[:-3]}")
            return
        if now < self._next_refresh:
            return
        try:
            self._store.refresh_lease(self._lease)
        except LeaseExpired:
            self._lose("leader lease expired in etcd")
            return
        except StoreUnavailable as exc:
            self.note_outage()
            log.warning("leader lease refresh failed: %s", exc)
            return  # retried next cycle; valid_until ends it if etcd stays away
        self._valid_until = now + self._ttl
        self._next_refresh = now + self._ttl / 3

    def _campaign(self) -> None:
        current = self._store.get(self._key)
        if current is not None:
            self.leader_name = _name(current.value)
            return
        sent = self._clock()
        lease = self._store.grant_lease(self._ttl)
        value = json.dumps({**self._identity, "since": time.time()}).encode()
        if not self._store.create(self._key, value, lease):
            self._store.revoke_lease(lease)
            return
        kv = self._store.get(self._key)
        if kv is None or kv.lease_id != lease.id:
            return  # expired already (we were paused): try again next cycle
        self._lease, self._revision = lease, kv.mod_revision
        self._valid_until = sent + lease.ttl
        self._next_refresh = sent + self._ttl / 3
        self.leader_name = str(self._identity.get("name", ""))
        self.lost_reason = ""
        log.info("became leader (revision %d, lease %ds)", self._revision, lease.ttl)

    def _lose(self, reason: str) -> None:
        if self._lease is not None:
            log.warning("lost leadership: %s", reason)
        self._lease, self._revision, self.lost_reason = None, 0, reason

    def note_outage(self) -> None:
        """etcd failed a call of this leader (the detector starts its hold again)."""
        self.outages += 1

    def ensure(self) -> None:
        """Raise NotLeader unless the lease is still valid by the local clock."""
        if not self.is_leader():
            raise NotLeader(f"not the leader ({self.lost_reason or 'lease not held'})")

    def commit(self, guards: Sequence[Guard], ops: Sequence[TxnOp]) -> bool:
        """Apply ``ops`` if this coordinator still leads (checked by etcd) and ``guards`` hold.

        Returns False when only ``guards`` failed; raises NotLeader (and steps down)
        when the leader key is no longer the one this coordinator created.
        """
        if self._lease is None:
            raise NotLeader("not the leader")
        mine = Guard(self._key, self._revision)
        if self._store.transaction([mine, *guards], ops):
            return True
        kv = self._store.get(self._key)
        if kv is None or kv.mod_revision != self._revision:
            self._lose("write refused: the leader key changed (another coordinator leads)")
            raise NotLeader("write refused: another coordinator leads")
        return False

    def resign(self) -> None:
        """Give up leadership at once (clean shutdown): standbys need not wait for the TTL."""
        if self._lease is not None:
            lease = self._lease
            self._lose("resigned")
            try:
                self._store.revoke_lease(lease)
            except StoreUnavailable as exc:
                log.warning("could not revoke the leader lease: %s", exc)


def _name(raw: bytes) -> str:
    try:
        value = json.loads(raw)
        return str(value.get("name", "?")) if isinstance(value, dict) else "?"
    except ValueError:
        return "?"


def read_leader(store: StateStore, key: str) -> dict[str, Any] | None:
    """The leader key's JSON value (plus its revision), or None when nobody leads."""
    kv = store.get(key)
    if kv is None:
        return None
    try:
        value = json.loads(kv.value)
    except ValueError:
        raise RecordError(f"{key}: not JSON") from None
    if not isinstance(value, dict):
        raise RecordError(f"{key}: expected a JSON object")
    return {**value, "revision": kv.mod_revision, "lease_id": kv.lease_id}
