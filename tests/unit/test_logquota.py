"""One log line per kind and period; what was held back is counted in the next one."""

from __future__ import annotations

import logging

import pytest

from raps_slurm.logquota import LogQuota
from raps_slurm.testing import FakeClock


def test_one_line_per_kind_and_period_then_the_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    quota = LogQuota(logging.getLogger("raps.test.quota"), period=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="raps.test.quota"):
        assert quota.log("handshake", logging.WARNING, "refused %s", "a")
        assert not any(quota.log("handshake", logging.WARNING, "refused %s", "b")
                       for _ in range(500))
        assert quota.log("size", logging.INFO, "too big")  # another kind: its own quota
        clock.advance(10.0)
        assert quota.log("handshake", logging.WARNING, "refused %s", "c")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a", "too big",
        "refused c (500 more like it in the last 10s not logged)"]


def test_kinds_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """Kinds named after what was refused cannot grow the table: past MAX_KINDS, new
    kinds share one quota until old periods end, and then the old kinds are forgotten."""
    from raps_slurm.logquota import MAX_KINDS

    clock = FakeClock()
    quota = LogQuota(logging.getLogger("raps.test.quota"), period=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="raps.test.quota"):
        assert all(quota.log(f"k{i}", logging.INFO, "k") for i in range(MAX_KINDS))
        assert quota.log("new-1", logging.INFO, "first new")
        assert not quota.log("new-2", logging.INFO, "second new")  # the shared quota
        assert len(quota._next) == MAX_KINDS + 1
        clock.advance(10.0)
        assert quota.log("new-3", logging.INFO, "after the period")
    assert len(quota._next) <= 2
    assert caplog.records[-1].getMessage() == "after the period"
