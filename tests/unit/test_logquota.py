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
