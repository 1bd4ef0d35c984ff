"""Restores started before their rank asks.

A recovery plan names the spare node as soon as the leader starts it, but the relaunched
rank asks its agent for its state only once its step is up and its interpreter has
loaded (1.4-2.8 s after the plan in the recovery benchmark on the test machine). The
spare's agent, which sees the plan, starts the restore at once; the rank's own
``ckpt_restore`` then takes the result (or waits for the one still running).

A result is handed over only if the rank's newest generation record is still the one
the early restore started from (a newer one came: the rank restores anew), at most once,
and only within ``hold_s`` of being made: unclaimed results are closed (their memory
files hold the rank's whole state).

What an early restore allocates is charged as the rank's own restore would be, to the
job owner's share (``charge_for``, set by the agent: :mod:`raps_slurm.agent.uid_limits`),
from its start until the rank takes it or it is closed: the agent starts it for the
user, not for itself. A charge refused ends it; the rank restores when it asks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from raps_slurm.checkpoint.restore_parts import Charge, RestoreResult
from raps_slurm.errors import RapsError

log = logging.getLogger("raps.checkpoint")

Release = Callable[[], None]
# (job, rank) -> what charges the job owner's share, and what gives the charge back
ChargeFor = Callable[[str, int], tuple[Charge, Release]]


def _nothing() -> None:
    return None


def _uncharged(job: str, rank: int) -> tuple[Charge, Release]:
    return (lambda nbytes: None), _nothing


HOLD_S = 120.0  # an unclaimed early restore is dropped this long after it was made
MAX_HELD = 256  # early restores made or running at once on one node (more: not started)

Newest = Callable[[str, int], object]  # the rank's newest generation record, as compared


@dataclass
class _Slot:
    newest: object
    done: threading.Event = field(default_factory=threading.Event)
    result: RestoreResult | None = None
    made_at: float = 0.0
    release: Release = _nothing  # the charge of what the result holds


class EarlyRestores:
    """Early restores of one node's checkpoint service, keyed by (job, rank)."""

    def __init__(self, restore: Callable[[str, int, Charge], RestoreResult | None],
                 newest: Newest,
                 hold_s: float = HOLD_S, monotonic: Callable[[], float] = time.monotonic
                 ) -> None:
        self._restore, self._newest = restore, newest
        self.hold_s, self._mono = hold_s, monotonic
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, int], _Slot] = {}
        # When each rank last asked: a plan seen after its rank asked (a watch that was
        # down) starts no second restore of it.
        self._asked: dict[tuple[str, int], float] = {}
        self.started = self.taken = self.dropped = 0
        self.charge_for: ChargeFor = _uncharged

    def start(self, job: str, rank: int) -> bool:
        """Start restoring the rank in the background; False if one is already held or
        running for it, or too many are."""
        self.expire()
        key = (job, rank)
        with self._lock:
            if key in self._slots or len(self._slots) >= MAX_HELD or key in self._asked:
                return False
        try:
            newest = self._newest(job, rank)
        except RapsError as exc:
            log.warning("job %s rank %d: early restore not started: %s", job, rank, exc)
            return False
        if newest is None:
            return False  # nothing committed: the rank starts from scratch
        slot = _Slot(newest)
        with self._lock:
            if key in self._slots:
                return False
            self._slots[key] = slot
            self.started += 1
        threading.Thread(target=self._run, args=(job, rank, slot), daemon=True,
                         name=f"raps-early-{job}-{rank}").start()
        log.info("job %s rank %d: restore started before the rank asks", job, rank)
        return True

    def _run(self, job: str, rank: int, slot: _Slot) -> None:
        try:
            charge, slot.release = self.charge_for(job, rank)
            slot.result = self._restore(job, rank, charge)
        except (RapsError, OSError) as exc:
            # The rank's own request restores again and reports what is wrong.
            log.warning("job %s rank %d: early restore failed: %s", job, rank, exc)
        finally:
            if slot.result is None:
                slot.release()
            slot.made_at = self._mono()
            slot.done.set()

    def take(self, job: str, rank: int) -> RestoreResult | None:
        """The rank's early restore, waited for if still running; None if there is none,
        it failed, or its generation is no longer the rank's newest (then dropped)."""
        with self._lock:
            slot = self._slots.pop((job, rank), None)
            self._asked[(job, rank)] = self._mono()
        if slot is None:
            return None
        slot.done.wait()
        result = slot.result
        slot.release()  # handed to the rank's own restore, or dropped below
        if result is None:
            return None
        try:
            same = self._newest(job, rank) == slot.newest
        except RapsError:
            same = False
        if not same:
            log.info("job %s rank %d: early restore dropped: a newer generation came", job,
                     rank)
            self._close(result)
            return None
        self.taken += 1
        result.early = True
        return result

    def expire(self) -> int:
        """Close early restores made more than ``hold_s`` ago and never claimed."""
        now = self._mono()
        with self._lock:
            old = [k for k, s in self._slots.items()
                   if s.done.is_set() and now - s.made_at > self.hold_s]
            slots = [self._slots.pop(k) for k in old]
            for k in [k for k, at in self._asked.items() if now - at > self.hold_s]:
                del self._asked[k]
        for (job, rank), s in zip(old, slots, strict=True):
            if s.result is not None:
                log.info("job %s rank %d: early restore never claimed, dropped", job, rank)
                self._close(s.result)
            s.release()
        return len(old)

    def close(self) -> None:
        """Close every early restore made (those still running are left to finish)."""
        with self._lock:
            slots = [s for s in self._slots.values() if s.done.is_set()]
            self._slots.clear()
        for s in slots:
            if s.result is not None:
                self._close(s.result)
            s.release()

    def _close(self, result: RestoreResult) -> None:
        self.dropped += 1
        result.restored.close()
