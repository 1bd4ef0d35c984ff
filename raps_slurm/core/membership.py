"""Which nodes are dead now, from what etcd holds about them. Pure: no I/O.

A DEAD verdict counts until the node registers again: a crashed or frozen node's
registration lingers until its lease runs out (``detection.lease_duration_sec``), so a
registration only proves the node is back when it was created after the verdict.
"""

from __future__ import annotations

from collections.abc import Mapping


def dead_nodes(registered: Mapping[str, int], dead_verdicts: Mapping[str, int]) -> set[str]:
    """Nodes whose DEAD verdict (its etcd revision) is newer than their registration (the
    revision that created it; absent: 0)."""
    return {n for n, rev in dead_verdicts.items() if registered.get(n, 0) < rev}
