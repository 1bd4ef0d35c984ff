"""At most one log line per kind and period for events hostile input can repeat at will
(refused connections, malformed requests): a flood must not fill the disk with the same
line or slow the daemon writing it. What was held back is counted in the next line.
At most :data:`MAX_KINDS` kinds are kept: past that, kinds whose period is over are
forgotten (what was held back of them is not counted), and if all are still in their
period a new kind shares one quota with every other such kind, so a caller that names
kinds after what it refused cannot make the table grow without bound."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

MAX_KINDS = 1024
_OTHERS = "\0others"  # the kind new kinds share when the table is full


class LogQuota:
    """``log(kind, level, msg, *args)`` passes the first line of a kind per ``period``."""

    def __init__(self, logger: logging.Logger, period: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._period, self._clock = logger, period, clock
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def log(self, kind: str, level: int, msg: str, *args: object) -> bool:
        """Log it (True) or count it against ``kind`` for the next line that passes."""
        now = self._clock()
        with self._lock:
            if kind not in self._next and len(self._next) >= MAX_KINDS:
                self._forget(now)
                if len(self._next) >= MAX_KINDS:
                    kind = _OTHERS
            if now < self._next.get(kind, 0.0):
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._next[kind] = now + self._period
            held = self._held.pop(kind, 0)
        if held:
            msg += f" ({held} more like it in the last {self._period:g}s not logged)"
        self._log.log(level, msg, *args)
        return True

    def _forget(self, now: float) -> None:
        """Drop the kinds whose period is over (the lock held)."""
        for k in [k for k, t in self._next.items() if t <= now]:
            del self._next[k]
            self._held.pop(k, None)
