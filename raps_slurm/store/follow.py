"""Following every key under a prefix: one full read, then a watch from its revision.

A full read of ``nodes/`` at 30,000 nodes takes about 0.4 s through the etcd gateway, and a
coordinator that re-read it every second spent that long not ticking its detector; a watch
costs per change only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from raps_slurm.errors import StoreError
from raps_slurm.store.base import StateStore, Watch, WatchEvent

log = logging.getLogger("raps.store")


@dataclass(frozen=True)
class Changes:
    """What ``PrefixFollower.poll`` found. ``reset``: ``events`` are a fresh full read (every
    key as a put): forget what was known before."""

    reset: bool
    events: list[WatchEvent] = field(default_factory=list)


class PrefixFollower:
    """Keeps up with ``prefix`` in ``store``; on any store error the next poll reads it
    all again, at most every ``retry_every`` seconds."""

    def __init__(self, store: StateStore, prefix: str, retry_every: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store, self.prefix, self.retry_every = store, prefix, retry_every
        self._mono = monotonic
        self._watch: Watch | None = None
        self._read_at = -1e18
        self.revision = 0  # the newest revision seen (read or event)

    def poll(self, until_revision: int = 0, timeout: float = 0.0) -> Changes | None:
        """Changes since the last call; None if the store could not be read.

        With ``until_revision``, waits up to ``timeout`` seconds for the watch to deliver
        that revision (a write this process just made) before answering."""
        if self._watch is not None:
            events: list[WatchEvent] = []
            deadline = self._mono() + timeout
            try:
                while True:
                    left = deadline - self._mono() if self.revision < until_revision else 0.0
                    event = self._watch.next(max(0.0, left))
                    if event is None:
                        if left <= 0.0:
                            return Changes(False, events)
                        continue
                    events.append(event)
                    self.revision = max(self.revision, event.mod_revision)
            except StoreError as exc:
                # The events received are dropped: the full read below replaces them.
                log.warning("watch on %s lost (%s): reading it again", self.prefix, exc)
                self.cancel()
        now = self._mono()
        if now - self._read_at < self.retry_every:
            return None
        self._read_at = now
        try:
            revision = self.store.current_revision()
            kvs = self.store.get_prefix(self.prefix)
            # From the revision before the read: a change in between is delivered again,
            # which is harmless to consumers that apply puts and deletes.
            self._watch = self.store.watch_prefix(self.prefix, start_revision=revision + 1)
        except StoreError as exc:
            log.warning("cannot read %s: %s", self.prefix, exc)
            return None
        self.revision = max(revision, *(kv.mod_revision for kv in kvs)) if kvs else revision
        return Changes(True, [WatchEvent("put", kv.key, kv.value, kv.mod_revision,
                                         kv.create_revision) for kv in kvs])

    def cancel(self) -> None:
        """Stop the watch (the next poll reads everything again)."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
