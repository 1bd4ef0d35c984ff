"""Python handle on ``scripts/cluster.sh``: the local Slurm + etcd cluster of the tests."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from raps_slurm.errors import ClusterError
from raps_slurm.slurm import CommandRunner, SlurmClient

T = TypeVar("T")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cluster.sh"


class LocalCluster:
    """Starts and stops a cluster in ``run_dir``; ``env`` is what a shell needs to use it."""

    def __init__(self, run_dir: Path, nodes: int = 6, racks: int = 3,
                 port_base: int = 17000, script: Path = SCRIPT) -> None:
        if not script.exists():
            raise ClusterError(f"{script} not found: run from a raps-slurm checkout")
        self.run_dir = Path(run_dir)
        self.nodes = nodes
        self.racks = racks
        self.port_base = port_base
        self.script = script
        self.env = {
            "SLURM_CONF": str(self.run_dir / "etc" / "slurm.conf"),
            "RAPS_CLUSTER_DIR": str(self.run_dir),
            "RAPS_ETCD_URL": f"http://127.0.0.1:{port_base + 379}",
        }

    @property
    def node_names(self) -> list[str]:
        """n1..nN."""
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    @property
    def etcd_url(self) -> str:
        """Client URL of the cluster's etcd."""
        return self.env["RAPS_ETCD_URL"]

    def _run(self, *args: str, timeout: float = 180) -> str:
        env = {**os.environ, "RAPS_CLUSTER_DIR": str(self.run_dir),
               "RAPS_CLUSTER_NODES": str(self.nodes), "RAPS_CLUSTER_RACKS": str(self.racks),
               "RAPS_CLUSTER_PORT": str(self.port_base)}
        try:
            proc = subprocess.run(["bash", str(self.script), *args], env=env, text=True,
                                  capture_output=True, timeout=timeout, check=False,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"cluster.sh {' '.join(args)} timed out after {timeout}s") from None
        if proc.returncode != 0:
            raise ClusterError(f"cluster.sh {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def up(self) -> None:
        """Start munged (if needed), etcd, slurmctld and every slurmd; wait until all are up."""
        self._run("up")

    def down(self) -> None:
        """Stop exactly what ``up`` started."""
        self._run("down")

    def crash(self, node: str) -> None:
        """Kill a fake node whole (cgroup.kill, or its process tree)."""
        self._run("crash", node)

    def freeze(self, node: str) -> None:
        """Freeze a fake node (cgroup.freeze, or SIGSTOP)."""
        self._run("freeze", node)

    def thaw(self, node: str) -> None:
        """Thaw a frozen node."""
        self._run("thaw", node)

    def restart(self, node: str) -> None:
        """Start a crashed node's slurmd again."""
        self._run("restart", node)

    def cgroup(self, node: str) -> Path:
        """The cgroup v2 directory of a fake node (it may not exist without cgroup v2)."""
        return Path(self._run("cgroup", node).strip())

    def slurm(self, timeout: float = 30.0) -> SlurmClient:
        """A Slurm client bound to this cluster."""
        return SlurmClient(CommandRunner(timeout=timeout, env=self.env))


def wait_until(what: str, probe: Callable[[], T], ok: Callable[[T], bool] = bool,
               timeout: float = 30.0, interval: float = 0.2) -> T:
    """Poll ``probe`` until ``ok(value)``; fail naming what was awaited and the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what}; last seen: {value!r}")
        time.sleep(interval)
