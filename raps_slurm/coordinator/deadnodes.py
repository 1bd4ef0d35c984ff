"""Which nodes are dead, sick or draining, as etcd says: what recovery and placement avoid."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from typing import Any

from raps_slurm.core.jobs import node_fitness
from raps_slurm.core.membership import dead_nodes
from raps_slurm.errors import StoreError
from raps_slurm.store import Keys, StateStore
from raps_slurm.store.base import WatchEvent
from raps_slurm.store.follow import PrefixFollower

_UNHEALTHY = ("DEGRADED", "DRAIN")  # health levels that rule a node out as a recovery target

# How long a call after ``refresh`` waits for the watch to bring this leader's own verdict.
_REFRESH_WAIT_SEC = 1.0


class DeadNodes:
    """Nodes that are dead now: a DEAD verdict in etcd and no registration made after it
    (a crashed node's registration lingers until its lease runs out, ``lease_duration_sec``;
    one created after the verdict means the node came back).

    Followed in etcd (one read of ``nodes/``, then a watch; read again at most every
    ``every`` seconds after a store error) rather than taken from this process's
    detector, so that a leader elected after the death knows it too. The same keys give
    ``unhealthy`` (a SUSPECT verdict, or health DEGRADED or DRAIN: no recovery target) and
    ``dead_at`` (when each DEAD verdict was given).
    """

    def __init__(self, store: StateStore, keys: Keys, every: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store, self.keys = store, keys
        self._prefix = keys.nodes_prefix()
        self._follow = PrefixFollower(store, self._prefix, every, monotonic)
        self._until = 0
        self._created: dict[str, int] = {}  # node -> create revision of its registration
        self._verdicts: dict[str, tuple[int, float]] = {}  # node -> DEAD verdict (revision, at)
        self._suspect: set[str] = set()
        self._health: dict[str, tuple[str, str, float]] = {}  # node -> (level, reason, at)
        self._dead: set[str] = set()
        self.unhealthy: set[str] = set()
        self.suspect: set[str] = set()  # under a SUSPECT verdict (also in unhealthy)
        # node -> (reason, time) of a health verdict at DRAIN, the node alive
        self.draining: dict[str, tuple[str, float]] = {}
        self.dead_at: dict[str, float] = {}
        self.registered: set[str] | None = None  # None until read: no agent known yet

    def refresh(self) -> None:
        """This leader just wrote a verdict: the next call waits for the watch to bring it."""
        try:
            self._until = self.store.current_revision()
        except StoreError:
            self._until = 0

    def close(self) -> None:
        """Stop following etcd."""
        self._follow.cancel()

    def __call__(self) -> set[str]:
        until, self._until = self._until, 0
        changes = self._follow.poll(until, _REFRESH_WAIT_SEC if until else 0.0)
        if changes is None or not (changes.reset or changes.events):
            return set(self._dead)
        if changes.reset:
            self._created, self._verdicts, self._suspect, self._health = {}, {}, set(), {}
        for event in changes.events:
            self._apply(event)
        self._dead = dead_nodes(self._created, {n: v[0] for n, v in self._verdicts.items()})
        self.registered = set(self._created) - self._dead
        self.suspect = set(self._suspect)
        self.unhealthy = self._suspect | {n for n, h in self._health.items()
                                          if h[0] in _UNHEALTHY}
        self.draining = {n: (h[1], h[2]) for n, h in self._health.items()
                         if h[0] == "DRAIN" and n not in self._dead}
        self.dead_at = {n: self._verdicts[n][1] for n in self._dead}
        return set(self._dead)

    def fitness(self, nodes: Collection[str], since: float
                ) -> tuple[dict[str, str], dict[str, str]]:
        """(unfit, doubtful) among ``nodes`` as last read, for a run registered at
        ``since`` (``core.jobs.node_fitness``): what its rank map keeps ranks off."""
        return node_fitness(nodes, dead=self._dead, registered=self.registered,
                            suspect=self.suspect, draining=self.draining, since=since)

    def _apply(self, event: WatchEvent) -> None:
        rest = event.key[len(self._prefix):]
        put = event.kind == "put"
        if "/" not in rest:
            if put:
                self._created[rest] = event.create_revision or event.mod_revision
            else:
                self._created.pop(rest, None)
            return
        node, _, leaf = rest.partition("/")
        if leaf not in ("verdict", "health-verdict"):
            return
        # A malformed value counts as none: its key no longer says what it said before.
        value: dict[str, Any] = {}
        if put:
            try:
                loaded = json.loads(event.value)
                value = loaded if isinstance(loaded, dict) else {}
            except ValueError:
                pass
        try:
            if leaf == "verdict":
                self._verdicts.pop(node, None)
                self._suspect.discard(node)
                if value.get("kind") == "DEAD":
                    self._verdicts[node] = (event.mod_revision, float(value.get("at") or 0.0))
                elif value.get("kind") == "SUSPECT":
                    self._suspect.add(node)
            else:
                self._health.pop(node, None)
                if value:
                    self._health[node] = (
                        str(value.get("level")),
                        str(value.get("reason") or "health").removeprefix("raps: "),
                        float(value.get("at") or 0.0))
        except (ValueError, TypeError):
            return
