"""Fixtures for the StateStore contract: one ``backend`` fixture over memory and real etcd."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import pytest

from raps_slurm.errors import ClusterError
from raps_slurm.store import EtcdStore, MemoryStore, StateStore
from raps_slurm.testing import EtcdServer, FakeClock

T = TypeVar("T")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "etcd: runs against a real etcd started by the test session")



@dataclass
class Backend:
    """A store under test plus how time passes for it.

    ``prefix`` is unique per test, so tests sharing one etcd never see each other.
    ``elapse`` advances the fake clock (memory) or really waits (etcd: leases
    live in etcd's own clock, there is no other way to let them run out).
    """

    name: str
    store: StateStore
    prefix: str
    elapse: Callable[[float], None]
    server: EtcdServer | None = None

    def key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def poll(self, probe: Callable[[], T], timeout: float, what: str) -> T:
        """The first truthy result of ``probe`` within ``timeout`` seconds, else fail."""
        deadline = time.monotonic() + timeout
        while True:
            result = probe()
            if result:
                return result
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name}: timed out after {timeout}s waiting for {what} "
                            f"(last: {result!r})")
            time.sleep(0.05)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """One real etcd for the session. Missing etcd is a failure, not a skip."""
    try:
        server = EtcdServer().start()
    except ClusterError as exc:
        pytest.fail(f"the etcd contract tests need a real etcd: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    prefix = f"/contract/{uuid.uuid4().hex[:12]}/"
    if request.param == "memory":
        clock = FakeClock()
        store = MemoryStore(clock=clock)
        yield Backend("memory", store, prefix, clock.advance)
        store.close()
        return
    server: EtcdServer = request.getfixturevalue("etcd_server")
    etcd = EtcdStore([server.url], timeout=5.0)
    try:
        yield Backend("etcd", etcd, prefix, time.sleep, server)
    finally:
        try:
            etcd.delete_prefix(prefix)
        finally:
            etcd.close()
