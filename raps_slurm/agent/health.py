"""The agent's health reporting: one probe sample per telemetry interval into etcd.

The sample goes to ``nodes/<node>/health`` under the node's membership lease, so it
vanishes with the node. The device inventory and raw counters stay in the agent (they
only serve the next delta); the leader's health policy judges what is written. The
sample also carries what the agent's doors refused since it started (``rejected``:
door -> kind -> count), which the leader exports as metrics: one scrape for a cluster.

At start the agent warns when the checkpoint dir shares a file system with ``/tmp`` or
``/var/tmp``: any user can fill those, and with them the room checkpoints need
(docs/install.md asks for a file system of its own).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from raps_slurm.agent.probes import ProbeSample, UdevWatcher, collect
from raps_slurm.errors import LeaseExpired, StoreError
from raps_slurm.store import Keys, Lease, StateStore

log = logging.getLogger("raps.agent")
_LOCAL_ONLY = ("devices", "counters")
USER_WRITABLE = ("/tmp", "/var/tmp")


def _device(path: Path) -> int | None:
    """The file system of ``path``, or of its nearest existing parent (a checkpoint dir
    not created yet will be made there)."""
    for p in (path, *path.parents):
        try:
            return os.stat(p).st_dev
        except OSError:
            continue
    return None


def shares_with(ckpt_dir: Path, others: Iterable[str] = USER_WRITABLE) -> list[str]:
    """Which of ``others`` (existing directories) are on the checkpoint dir's file system."""
    mine = _device(ckpt_dir)
    out = []
    for other in others:
        try:
            if mine is not None and os.stat(other).st_dev == mine:
                out.append(other)
        except OSError:
            continue
    return out


def warn_if_shared(ckpt_dir: Path, others: Iterable[str] = USER_WRITABLE) -> list[str]:
    """Log a warning when the checkpoint dir shares a file system with one of ``others``;
    which it shares."""
    shared = shares_with(ckpt_dir, others)
    if shared:
        log.warning("checkpoint dir %s shares a file system with %s, which any user can "
                    "fill, and with it the room for checkpoints: give it a file system of "
                    "its own (docs/install.md)", ckpt_dir, " and ".join(shared))
    return shared


class HealthReporter:
    """Collects and publishes probe samples of one node."""

    def __init__(self, store: StateStore, keys: Keys, node: str, probe_root: Path,
                 ckpt_dir: Path) -> None:
        self.store, self.keys, self.node = store, keys, node
        self.probe_root, self.ckpt_dir = probe_root, ckpt_dir
        self.previous: ProbeSample | None = None
        warn_if_shared(ckpt_dir)
        self.udev = UdevWatcher(probe_root)
        self.udev.start()

    def report(self, lease: Lease | None,
               rejected: Mapping[str, Mapping[str, int]] | None = None) -> ProbeSample:
        """Take a sample and write it (when registered), with the doors' rejection
        counts; returns the sample."""
        sample = collect(self.probe_root, self.ckpt_dir if self.ckpt_dir.exists() else None,
                         self.previous, removed_events=self.udev.drain())
        self.previous = sample
        for problem in sample.problems:
            log.debug("probe: %s", problem)
        if lease is None:
            return sample
        data = {k: v for k, v in sample.to_dict().items() if k not in _LOCAL_ONLY}
        if rejected is not None:
            data["rejected"] = {door: dict(kinds) for door, kinds in rejected.items()}
        try:
            self.store.put(self.keys.node_health(self.node), json.dumps(data).encode(), lease)
        except LeaseExpired:
            pass  # the main loop registers again; the next sample goes then
        except StoreError as exc:
            log.debug("health sample not written: %s", exc)
        return sample
