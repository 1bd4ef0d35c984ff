"""Session fixture: one real local Slurm cluster (6 nodes, 3 racks) + etcd for all tests here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from raps_slurm.config import load_file
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import (
    CoordinatorProcess,
    LocalCluster,
    cluster_for_tests,
    wait_leading,
)


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """Bring the cluster up once; always bring it down, even when a test fails.
    RAPS_CLUSTER_PORT moves its ports, e.g. beside a demo cluster on 17000."""
    with cluster_for_tests("raps-cluster-") as c:
        yield c


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration is marked integration."""
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


class Rapsctl:
    """Runs ``rapsctl`` (this interpreter's package) against the cluster's RAPS config."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "raps_slurm.cli", "--config", str(self.cluster.config_path),
             *args], env={**os.environ, **self.cluster.env}, capture_output=True, text=True,
            timeout=60, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"rapsctl {' '.join(args)} exited {proc.returncode}: "
                                 f"{proc.stderr.strip()}")
        return proc

    def job(self, job_id: int) -> dict[str, Any] | None:
        """``show job J --json``, or None while the job is not registered."""
        proc = self("show", "job", str(job_id), "--json", check=False)
        if proc.returncode == 1 and "not registered" in proc.stderr:
            return None
        assert proc.returncode == 0, proc.stderr
        data: dict[str, Any] = json.loads(proc.stdout)
        return data


@pytest.fixture(scope="session")
def rapsctl(cluster: LocalCluster) -> Rapsctl:
    return Rapsctl(cluster)


@pytest.fixture(scope="session")
def store(cluster: LocalCluster) -> Iterator[tuple[StateStore, Keys]]:
    """The cluster's etcd, for checks the CLI does not show (raw keys)."""
    s, keys = open_store(load_file(cluster.config_path).store)
    with s:
        yield s, keys


@pytest.fixture(scope="session")
def leading(cluster: LocalCluster, store: tuple[StateStore, Keys]) -> Callable[..., Any]:
    """``with leading(name[, receivers=N]) as c``: a coordinator that leads before the
    block starts."""
    return lambda name, receivers=1: _leading(cluster, store, name, receivers)


@contextmanager
def _leading(cluster: LocalCluster, store: tuple[StateStore, Keys], name: str,
             receivers: int = 1) -> Iterator[CoordinatorProcess]:
    c = cluster.coordinator(name).start(receivers=receivers)
    try:
        wait_leading(*store, name)
        yield c
    finally:
        assert c.stop() == 0, c.log()[-2000:]
