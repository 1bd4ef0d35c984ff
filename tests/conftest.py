"""Who runs where when pytest has workers (scripts/test.sh: ``-n 2 --dist loadgroup``).

The tests of tests/ha and tests/integration wait on a Slurm cluster most of their time
and must not overlap each other (two clusters on two cores, and tests/ha first, before
the integration cluster starts): they form one group, run in order on one worker. The
rest (unit, contract, fuzz: CPU-bound, seconds each) takes the other worker meanwhile.
"""

from __future__ import annotations

import pytest

CLUSTER_DIRS = ("tests/ha/", "tests/integration/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put every test that needs a Slurm cluster in the ``cluster`` group."""
    for item in items:
        if any(d in str(item.fspath) for d in CLUSTER_DIRS):
            item.add_marker(pytest.mark.xdist_group("cluster"))
