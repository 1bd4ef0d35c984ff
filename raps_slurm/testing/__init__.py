"""Helpers for tests that need real services (etcd); imported by tests, never by daemons."""

from raps_slurm.testing.clock import FakeClock
from raps_slurm.testing.etcd import EtcdServer, find_etcd, free_port

__all__ = ["EtcdServer", "FakeClock", "find_etcd", "free_port"]
