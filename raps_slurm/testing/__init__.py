"""Helpers for tests that need real services (etcd); imported by tests, never by daemons."""

from raps_slurm.testing.clock import FakeClock
from raps_slurm.testing.etcd import EtcdCluster, EtcdServer, find_etcd, free_port

__all__ = ["EtcdCluster", "EtcdServer", "FakeClock", "find_etcd", "free_port"]
