"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from leader_world import World, new_world


@pytest.fixture
def world_ranks_per_node() -> int:
    """Ranks per working node of the ``world`` fixture's job (a test module overrides it)."""
    return 1


@pytest.fixture
def world(world_ranks_per_node: int) -> Iterator[World]:
    """The leader's pass on the in-memory store (tests/unit/leader_world.py)."""
    w = new_world(world_ranks_per_node)
    yield w
    w.store.close()
