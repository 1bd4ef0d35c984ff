"""A local Slurm cluster whose etcd has three members, for the HA tests here only.

It runs alone: pytest reaches tests/ha before tests/integration, whose one-member cluster
starts only when its first test needs it, so the two never share the two cores or ports.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from raps_slurm.testing.cluster import LocalCluster, cluster_for_tests


@pytest.fixture(scope="module")
def cluster3() -> Iterator[LocalCluster]:
    """Six nodes in three racks, etcd of three members; always brought down. A request
    fails over to the next member within 1.5 s, under 2/3 of the test profile's 3 s
    leader lease (the config refuses more with several endpoints).

    Its etcd runs without authentication: with password users a new client must first
    get a token (a request that needs a majority), so with the quorum lost `rapsctl
    ping` cannot tell a member that answers from none (production authenticates with
    client certificates, which need no token)."""
    with cluster_for_tests("raps-cluster3-", etcd_members=3, store_timeout=1.5,
                           etcd_auth=False) as c:
        yield c


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/ha is marked integration."""
    for item in items:
        if "tests/ha/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
