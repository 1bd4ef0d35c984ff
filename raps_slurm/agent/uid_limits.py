"""Per-uid limits on the agent's costly local ops: how many run at once, how much memory.

A restore, a ``log_read`` and a ``log_append`` make the agent (root, its own cgroup) hold
memory for a user: the restored state, the log, the segment. Users share compute nodes,
so one of them must not make the agent hold more than the node can afford, nor keep
another user's restore waiting (docs/architecture.md, Per-job quotas). Per uid:

- at most ``agent.uid_restores_at_once`` restores and ``agent.uid_log_ops_at_once`` log
  reads and appends run at once; more wait their turn (the ranks of one job on a spare
  all restore at once), at most :data:`QUEUE` of them and :data:`WAIT_S` seconds each,
  beyond which they are refused with kind ``busy``. With one restore per uid (the
  default) and two per node, another user's restore always finds a slot;
- what they hold together stays under ``agent.uid_memory_percent`` of the node's
  memory: each charges the bytes it is about to allocate before allocating them, and a
  charge that would pass the share is refused with kind ``quota``.

Root is not limited: the agent and the admins act for every job. What the agent starts
on its own for a user's job is charged to the job's owner all the same
(:meth:`UidLimits.held_for`): an early restore, made when a plan moves a rank here,
holds the rank's state until the rank takes it (:mod:`raps_slurm.checkpoint.early`).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from raps_slurm.config import AgentConfig
from raps_slurm.errors import Refused

RESTORE, LOG = "restore", "log"
QUEUE = 64  # ops of one uid and kind that may wait for a slot
WAIT_S = 600.0  # the longest one waits
_KEYS = {RESTORE: "agent.uid_restores_at_once", LOG: "agent.uid_log_ops_at_once"}


def node_memory_bytes() -> int:
    """The node's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Charge:
    """The memory one op holds for its uid; released when the op ends."""

    def __init__(self, limits: UidLimits, uid: int, op: str) -> None:
        self._limits, self.uid, self.op = limits, uid, op
        self.bytes = 0

    def __call__(self, nbytes: int) -> None:
        """Charge ``nbytes`` more, or refuse (kind ``quota``) if the uid's share is full."""
        self._limits.take(self, nbytes)


class UidLimits:
    """Concurrent ops and memory per uid; thread-safe."""

    def __init__(self, restores_at_once: int = 1, log_ops_at_once: int = 4,
                 memory_bytes: int | None = None, *, queue: int = QUEUE,
                 wait_s: float = WAIT_S) -> None:
        self.at_once = {RESTORE: restores_at_once, LOG: log_ops_at_once}
        self.memory_bytes = (memory_bytes if memory_bytes is not None
                             else node_memory_bytes() // 2)
        self.queue, self.wait_s = queue, wait_s
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._running: dict[tuple[int, str], int] = {}
        self._waiting: dict[tuple[int, str], int] = {}
        self._held: dict[int, int] = {}

    @classmethod
    def from_config(cls, cfg: AgentConfig, node_memory: int | None = None) -> UidLimits:
        """The limits ``cfg`` sets on a node with ``node_memory`` bytes (default: this one)."""
        total = node_memory if node_memory is not None else node_memory_bytes()
        return cls(cfg.uid_restores_at_once, cfg.uid_log_ops_at_once,
                   int(total * cfg.uid_memory_percent / 100))

    @contextmanager
    def op(self, kind: str, uid: int, op: str) -> Iterator[Charge]:
        """One ``kind`` op (``restore`` or ``log``) of ``uid``, once the uid runs fewer
        than its limit; refused with kind ``busy`` when too many wait or the wait is too
        long. Its memory charges end with it."""
        charge = Charge(self, uid, op)
        if uid != 0:
            self._enter((uid, kind), op)
        try:
            yield charge
        finally:
            if uid != 0:
                with self._lock:
                    _count(self._running, (uid, kind), -1)
                    self._release(charge)
                    self._freed.notify_all()

    def _enter(self, key: tuple[int, str], op: str) -> None:
        uid, kind = key
        with self._lock:
            if self._running.get(key, 0) < self.at_once[kind]:
                _count(self._running, key, 1)
                return
            if self._waiting.get(key, 0) >= self.queue:
                raise Refused("busy", f"{op}: uid {uid} already has {self.queue} {kind} "
                                      f"op(s) waiting here behind the {self.at_once[kind]} "
                                      f"{_KEYS[kind]} lets run at once")
            _count(self._waiting, key, 1)
            try:
                if not self._freed.wait_for(
                        lambda: self._running.get(key, 0) < self.at_once[kind], self.wait_s):
                    raise Refused("busy", f"{op}: uid {uid} waited {self.wait_s:g} s for "
                                          f"one of its {self.at_once[kind]} {kind} slot(s) "
                                          f"({_KEYS[kind]})")
                _count(self._running, key, 1)
            finally:
                _count(self._waiting, key, -1)

    def take(self, charge: Charge, nbytes: int) -> None:
        """Add ``nbytes`` to ``charge`` (see :meth:`Charge.__call__`)."""
        if charge.uid == 0 or nbytes <= 0:
            return
        with self._lock:
            held = self._held.get(charge.uid, 0)
            if held + nbytes > self.memory_bytes:
                raise Refused("quota", f"{charge.op}: {nbytes} bytes more would make the "
                                       f"agent hold {held + nbytes} for uid {charge.uid}, "
                                       f"above its {self.memory_bytes} "
                                       "(agent.uid_memory_percent of the node's memory)")
            self._held[charge.uid] = held + nbytes
            charge.bytes += nbytes

    def held_for(self, uid: int, op: str) -> tuple[Charge, Callable[[], None]]:
        """A charge of ``uid``'s memory share outside any op (no slot: the agent's own
        work for the uid's job), and what releases it (once; later calls do nothing)."""
        charge = Charge(self, uid, op)

        def release() -> None:
            with self._lock:
                self._release(charge)
                self._freed.notify_all()
        return charge, release

    def held(self, uid: int) -> int:
        """Bytes the uid's running ops hold."""
        with self._lock:
            return self._held.get(uid, 0)

    def _release(self, charge: Charge) -> None:
        if not charge.bytes:
            return
        left = self._held.get(charge.uid, 0) - charge.bytes
        if left > 0:
            self._held[charge.uid] = left
        else:
            self._held.pop(charge.uid, None)
        charge.bytes = 0


def _count(counts: dict[tuple[int, str], int], key: tuple[int, str], delta: int) -> None:
    left = counts.get(key, 0) + delta
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


_SHARED: weakref.WeakKeyDictionary[object, UidLimits] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def shared(owner: object, cfg: AgentConfig) -> UidLimits:
    """The one set of limits of ``owner`` (the agent's checkpoint service): its
    checkpoint and messaging ops count against the same uid's share."""
    with _SHARED_LOCK:
        limits = _SHARED.get(owner)
        if limits is None:
            limits = _SHARED[owner] = UidLimits.from_config(cfg)
        return limits


def early_charges(limits: UidLimits, owner_of: Callable[[str], int | None]
                  ) -> Callable[[str, int], tuple[Charge, Callable[[], None]]]:
    """What an early restore of a rank of job J charges: J's owner's share (refused, kind
    ``not_registered``, for a job whose owner is not known here)."""
    def charge_for(job: str, rank: int) -> tuple[Charge, Callable[[], None]]:
        owner = owner_of(job)
        if owner is None:
            raise Refused("not_registered", f"early restore of rank {rank} of job {job}: "
                                            "its owner is not known")
        return limits.held_for(owner, "early restore")
    return charge_for
