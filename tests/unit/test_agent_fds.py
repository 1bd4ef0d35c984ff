"""The agent's descriptor budget (agent/fds.py): users get what is left after the
agent's own reserve, one uid a quarter of it, and the local API enforces both."""

from __future__ import annotations

import resource

import pytest

from raps_slurm.agent import fds


@pytest.mark.parametrize("limit", [1024, 4096, 65536, 1 << 20])
def test_users_never_reach_the_agent_s_reserve(limit: int) -> None:
    c = fds.caps(limit, 3, 1 << 30)
    assert fds.reserved(limit) >= fds.MIN_RESERVED
    assert c.users * 3 + fds.reserved(limit) <= limit
    assert c.per_uid * fds.UID_SHARE <= c.users  # one uid: a quarter at most


def test_the_configured_per_uid_cap_wins_when_lower() -> None:
    assert fds.caps(65536, 3, 1024).per_uid == 1024
    assert fds.caps(1024, 3, 1024).per_uid < 1024


def test_raise_limit_raises_the_soft_limit_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
        got = fds.raise_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got
        assert got == (hard if hard != resource.RLIM_INFINITY else fds.WANTED)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("unit", ["raps-agent.service", "raps-coordinator.service"])
def test_the_units_set_the_limit_the_agent_sizes_for(unit: str) -> None:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "slurm" / "systemd" / unit).read_text()
    limits = [line.split("=", 1)[1] for line in text.splitlines()
              if line.startswith("LimitNOFILE=")]
    assert limits and int(limits[0]) >= fds.WANTED, limits
