"""The agent's watch on recovery plans: a plan that moves a rank to this node starts that
rank's restore at once (:mod:`raps_slurm.checkpoint.early`), while its step starts.

Only the leader writes plans (docs/store.md, roles), so a plan is trusted as far as to
spend this node's time and memory on a restore the rank would ask for anyway; the state
is handed over only to the rank itself, through ``ckpt_restore``. A malformed plan is
logged and counted; a lost watch is opened again from the revision after the last one
seen (from now if that one was compacted): a plan missed costs only the head start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from raps_slurm.core.planner import Plan, restore_early
from raps_slurm.errors import HistoryCompacted, RecordError, StoreError
from raps_slurm.store import Keys, StateStore
from raps_slurm.store.base import WatchEvent

log = logging.getLogger("raps.agent")

RETRY_S = 2.0  # between attempts to open the watch while etcd is out of reach


class PlanWatcher:
    """Calls ``start(job, rank)`` for each plan that starts a move of a rank to ``node``."""

    def __init__(self, store: StateStore, keys: Keys, node: str,
                 start: Callable[[str, int], bool]) -> None:
        self.store, self.keys, self.node, self._start = store, keys, node, start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: set[str] = set()  # plan ids started here (a plan is written many times)
        self.watching = threading.Event()  # set once a watch is open
        self.malformed = 0
        self.started = 0

    def handle(self, event: WatchEvent) -> bool:
        """Apply one change under ``plans/``; True if it started an early restore."""
        if event.kind != "put":
            self._seen.discard(event.key)
            return False
        try:
            plan = Plan.from_json(event.key, event.value)
        except RecordError as exc:
            self.malformed += 1
            log.warning("plan watch: %s", exc)
            return False
        if not restore_early(plan, self.node) or event.key in self._seen:
            return False
        self._seen.add(event.key)
        if self._start(plan.job, plan.rank):
            self.started += 1
            return True
        return False

    def start(self) -> None:
        """Watch in a background thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="raps-plan-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (returns within about a second)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        revision: int | None = None  # the next revision to read
        while not self._stop.is_set():
            try:
                if revision is None:
                    revision = self.store.current_revision() + 1
                with self.store.watch_prefix(self.keys.plans_prefix(), revision) as watch:
                    self.watching.set()
                    while not self._stop.is_set():
                        event = watch.next(1.0)
                        if event is not None:
                            revision = event.mod_revision + 1
                            self.handle(event)
            except HistoryCompacted as exc:
                log.warning("plan watch lost (%s): opening it again from now", exc)
                revision = None
                self._stop.wait(RETRY_S)
            except StoreError as exc:
                log.warning("plan watch lost (%s): opening it again", exc)
                self._stop.wait(RETRY_S)
