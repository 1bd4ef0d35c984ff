"""Freshness of signed datagrams: the (incarnation, counter) sequence an agent numbers its
heartbeats and app reports with (:func:`new_incarnation`), and the coordinator's
:class:`ReplayGuard` that accepts each node's sequence only strictly increasing."""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING

from raps_slurm.errors import ConfigError

if TYPE_CHECKING:
    from raps_slurm.wire.heartbeat import Heartbeat

# A real agent sends one heartbeat per interval (>= 0.05 s), one resend and its probe replies:
# far below this many per second of its incarnation's life. A counter above the bound is a
# forgery or a bug, and accepting it would make every later heartbeat of the node a "replay".
MAX_COUNTER_RATE = 1000
COUNTER_SLACK = 1000


class ReplayGuard:
    """Accepts a node's heartbeats only in strictly increasing (incarnation, counter) order.

    The signature says a RAPS daemon made a datagram, not that it is fresh: without this guard
    a captured heartbeat, re-sent after the node died, would keep the node alive. The skew
    window bounds how long a captured datagram stays usable even after ``forget``.

    Incarnations are wall-clock nanoseconds (``new_incarnation``): one later than this
    clock + the skew window ("future"), or a counter beyond ``MAX_COUNTER_RATE`` per second
    of the incarnation's age ("counter"), is refused without being remembered, so no single
    datagram can lock a node out. The coordinator forgets a node when its lease expires,
    when it registers a new incarnation and when it is declared DEAD: an agent restarted
    after its clock stepped back (a smaller incarnation) is accepted again.
    """

    def __init__(self, max_skew: float) -> None:
        """``max_skew``: seconds ``sent_at`` may differ from the receiver's clock."""
        if not (math.isfinite(max_skew) and max_skew > 0):
            raise ConfigError([f"heartbeat max_skew {max_skew!r}: must be a positive number "
                               "of seconds"])
        self.max_skew = max_skew
        self._last: dict[str, tuple[int, int]] = {}

    def check(self, hb: Heartbeat, now: float) -> str | None:
        """None if accepted (and remembered), else "skew", "future", "counter" or "replay";
        a rejection changes nothing.

        Skew is checked first: a node with a bad clock then reports the cause to fix. An older
        incarnation is a replay (a restarted agent always has a larger one); a newer one
        restarts the counter.
        """
        return self.check_fields(hb.node, hb.incarnation, hb.counter, hb.sent_at, now)

    def check_fields(self, node: str, incarnation: int, counter: int, sent_at: float,
                     now: float) -> str | None:
        """``check`` of a heartbeat given by its fields (the receiver's hot path)."""
        # Written as "not <=" so a NaN clock reading also counts as skew.
        if not abs(now - sent_at) <= self.max_skew:
            return "skew"
        latest = now + self.max_skew  # the newest incarnation any agent can have made
        if incarnation > latest * 1e9:
            return "future"
        if counter > (latest - incarnation / 1e9) * MAX_COUNTER_RATE + COUNTER_SLACK:
            return "counter"
        seen = (incarnation, counter)
        last = self._last.get(node)
        if last is not None and seen <= last:
            return "replay"
        self._last[node] = seen
        return None

    def last(self, node: str) -> tuple[int, int] | None:
        """The last accepted (incarnation, counter) of ``node``, if any."""
        return self._last.get(node)

    def forget(self, node: str) -> None:
        """Drop what we know of ``node`` (it left the cluster or its lease expired)."""
        self._last.pop(node, None)


_incarnation_lock = threading.Lock()
_last_incarnation = 0


def new_incarnation() -> int:
    """A fresh incarnation number for this agent process: wall-clock nanoseconds.

    Wall clock, not ``monotonic``: the monotonic clock restarts at every boot, and an agent
    restarted after a reboot must still outrank its previous life. A restart takes far longer
    than the clock's resolution, so the new value is larger unless the clock was stepped back
    by more than the downtime, which the skew check already forbids in a healthy cluster (and
    the coordinator forgets a node whose lease expired, which clears a stuck state). Within one
    process the values are also forced strictly increasing. Fits u64 until the year 2554.
    """
    global _last_incarnation
    with _incarnation_lock:
        _last_incarnation = max(time.time_ns(), _last_incarnation + 1)
        return _last_incarnation
