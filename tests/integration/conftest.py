"""Session fixture: one real local Slurm cluster (6 nodes, 3 racks) + etcd for all tests here."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.testing.cluster import LocalCluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """Bring the cluster up once; always bring it down, even when a test fails."""
    # Not pytest's tmp_path: its parents are mode 0700 and slurmctld runs as SlurmUser.
    run_dir = Path(tempfile.mkdtemp(prefix="raps-cluster-"))
    # RAPS_CLUSTER_PORT moves the cluster's ports, e.g. beside a demo cluster on 17000.
    c = LocalCluster(run_dir, port_base=int(os.environ.get("RAPS_CLUSTER_PORT", "17000")))
    try:
        c.up()
    except Exception:
        c.down()
        raise
    try:
        yield c
    finally:
        c.down()
        shutil.rmtree(run_dir, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration is marked integration."""
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
