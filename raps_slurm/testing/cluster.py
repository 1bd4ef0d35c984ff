"""Python handle on ``scripts/cluster.sh``: the local Slurm + etcd cluster of the tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from raps_slurm.coordinator.election import read_leader
from raps_slurm.errors import ClusterError, StoreError
from raps_slurm.slurm import CommandRunner, SlurmClient
from raps_slurm.store import Keys, StateStore

T = TypeVar("T")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cluster.sh"


class LocalCluster:
    """Starts and stops a cluster in ``run_dir``; ``env`` is what a shell needs to use it."""

    def __init__(self, run_dir: Path, nodes: int = 6, racks: int = 3,
                 port_base: int = 17000, script: Path = SCRIPT,
                 profile: Path | None = None, etcd_members: int = 1, net: str = "lo",
                 store_timeout: float | None = None) -> None:
        if not script.exists():
            raise ClusterError(f"{script} not found: run from a raps-slurm checkout")
        self.run_dir = Path(run_dir)
        self.nodes = nodes
        self.racks = racks
        self.port_base = port_base
        self.script = script
        self.profile = profile  # RAPS config profile (default configs/test.yaml)
        if etcd_members not in (1, 3):
            raise ClusterError(f"etcd_members must be 1 or 3, got {etcd_members}")
        self.etcd_members = etcd_members
        if net not in ("lo", "ns"):
            raise ClusterError(f"net must be 'lo' (loopback) or 'ns' (network namespaces), "
                               f"got {net!r}")
        self.net = net
        self.store_timeout = store_timeout  # store.timeout_sec (default: the profile's)
        self.env = {
            "SLURM_CONF": str(self.run_dir / "etc" / "slurm.conf"),
            "RAPS_CLUSTER_DIR": str(self.run_dir),
            "RAPS_ETCD_URL": ",".join(self.etcd_urls),
            "RAPS_CONFIG": str(self.run_dir / "etc" / "raps.yaml"),
        }

    @property
    def node_names(self) -> list[str]:
        """n1..nN."""
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    @property
    def net_octet(self) -> int:
        """S of the namespace mode's 10.S.0.0/16 (from the port base, as cluster.sh has it)."""
        return (self.port_base // 50) % 256

    @property
    def host(self) -> str:
        """The address of this host on the cluster's network: loopback, or in namespace
        mode the core bridge's (where slurmctld, coordinators and the tests live)."""
        return f"10.{self.net_octet}.0.1" if self.net == "ns" else "127.0.0.1"

    def etcd_host(self, member: int) -> str:
        """Where etcd member ``member`` (1..) listens: its namespace's address, or loopback."""
        return f"10.{self.net_octet}.0.{10 + member}" if self.net == "ns" else "127.0.0.1"

    def head_host(self, head: int) -> str:
        """Namespace mode: the address of head namespace ``head`` (1..2), where a
        coordinator can run that ``partition(f"h{head}")`` cuts off."""
        return f"10.{self.net_octet}.0.{20 + head}"

    def head_netns(self, head: int) -> Path:
        """Namespace mode: the network namespace of head ``head``."""
        return Path("/run/netns") / f"rc{self.port_base}h{head}"

    @property
    def etcd_urls(self) -> list[str]:
        """Client URLs of the cluster's etcd members (member i on base+377+2i)."""
        return [f"http://{self.etcd_host(i)}:{self.port_base + 377 + 2 * i}"
                for i in range(1, self.etcd_members + 1)]

    @property
    def etcd_url(self) -> str:
        """Client URL of the cluster's first etcd member (every client's first choice)."""
        return self.etcd_urls[0]

    def _run(self, *args: str, timeout: float = 180,
             extra_env: dict[str, str] | None = None) -> str:
        env = {**os.environ, **(extra_env or {}), "RAPS_CLUSTER_DIR": str(self.run_dir),
               "RAPS_CLUSTER_NODES": str(self.nodes), "RAPS_CLUSTER_RACKS": str(self.racks),
               "RAPS_CLUSTER_PORT": str(self.port_base),
               "RAPS_CLUSTER_ETCD_MEMBERS": str(self.etcd_members),
               "RAPS_CLUSTER_NET": self.net}
        if self.profile is not None:
            env["RAPS_CLUSTER_PROFILE"] = str(self.profile)
        if self.store_timeout is not None:
            env["RAPS_CLUSTER_STORE_TIMEOUT"] = f"{self.store_timeout:g}"
        try:
            proc = subprocess.run(["bash", str(self.script), *args], env=env, text=True,
                                  capture_output=True, timeout=timeout, check=False,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"cluster.sh {' '.join(args)} timed out after {timeout}s") from None
        if proc.returncode != 0:
            raise ClusterError(f"cluster.sh {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def up(self, extra_env: dict[str, str] | None = None) -> None:
        """Start munged (if needed), etcd, slurmctld and every slurmd; wait until all are up.

        ``extra_env`` goes to cluster.sh, e.g. RAPS_AGENT_ARGS for every agent it starts.
        """
        self._run("up", extra_env=extra_env)

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

    def partition(self, target: str, seconds: float | None = None) -> None:
        """Namespace mode: cut node ``nI``, rack ``rR`` or etcd member ``eI`` off the network
        (its link down); it keeps running. With ``seconds``, heal it after that long (in
        cluster.sh, so the down time is not stretched by starting it again)."""
        self._run("partition", target, *([f"{seconds:.3f}"] if seconds is not None else []))

    def heal(self, target: str) -> None:
        """Bring a partitioned node, rack or etcd member's link up again."""
        self._run("heal", target)

    def slurmd_kill(self, node: str) -> None:
        """Kill only the node's slurmd (its agent stays): job steps cannot start there."""
        self._run("slurmd-kill", node)

    def slurmd_start(self, node: str) -> None:
        """Start the node's slurmd again after ``slurmd_kill``."""
        self._run("slurmd-start", node)

    def agent_start(self, node: str, *args: str) -> None:
        """Start a node's raps-agent (in the node's cgroup), with extra ``raps-agent`` args."""
        self._run("agent-start", node, extra_env={"RAPS_AGENT_ARGS": " ".join(args)})

    def agent_stop(self, node: str) -> None:
        """Stop a node's raps-agent alone (SIGTERM)."""
        self._run("agent-stop", node)

    def etcd_stop(self, member: int | None = None) -> None:
        """Stop the cluster's etcd (every member, or member 1..N), keeping its data."""
        self._run("etcd-stop", *([str(member)] if member is not None else []))

    def etcd_start(self, member: int | None = None) -> None:
        """Start the cluster's etcd (or one member) again on its data; wait until it answers."""
        self._run("etcd-start", *([str(member)] if member is not None else []))

    def submit_raps_run(self, program: list[str], sbatch: list[str],
                        name: str = "heat", run_options: Sequence[str] = ()
                        ) -> tuple[str, Path]:
        """``sbatch --raps --no-kill`` a batch script that execs ``raps-run RUN_OPTIONS --
        PROGRAM`` (this interpreter's); returns the job id and its output file."""
        out = self.run_dir / "jobs"
        out.mkdir(exist_ok=True)
        out.chmod(0o777)  # the job may run as another user
        script = out / f"{name}.sh"
        script.write_text("#!/bin/bash\n"
                          f"exec {Path(sys.executable).parent / 'raps-run'} "
                          f"{' '.join([*run_options, '--', *program])}\n")
        job = CommandRunner(timeout=60, env=self.env).run(
            ["sbatch", "--parsable", "-o", str(out / f"{name}-%j.out"), "--raps", "--no-kill",
             *sbatch, str(script)]).strip().split(";")[0]
        return job, out / f"{name}-{job}.out"

    @property
    def config_path(self) -> Path:
        """The RAPS config of this cluster: rapsctl's and the tests' (an admin's etcd user
        when etcd runs with authentication, the default)."""
        return Path(self.env["RAPS_CONFIG"])

    @property
    def hooks_config_path(self) -> Path:
        """The config the Slurm hooks read: their own etcd user's when etcd runs with
        authentication, else the cluster's."""
        own = self.run_dir / "etc" / "raps-hooks.yaml"
        return own if own.exists() else self.config_path

    def coordinator(self, name: str, config: Path | None = None) -> CoordinatorProcess:
        """A raps-coordinator for this cluster (not started yet), with the cluster's config
        or ``config``."""
        return CoordinatorProcess(self, name, config)

    def cgroup(self, node: str) -> Path:
        """The cgroup v2 directory of a fake node (it may not exist without cgroup v2)."""
        return Path(self._run("cgroup", node).strip())

    def slurm(self, timeout: float = 30.0) -> SlurmClient:
        """A Slurm client bound to this cluster."""
        return SlurmClient(CommandRunner(timeout=timeout, env=self.env))


class CoordinatorProcess:
    """One ``raps-coordinator`` run by the tests or the demo, logging to the run dir."""

    def __init__(self, cluster: LocalCluster, name: str, config: Path | None = None) -> None:
        self.cluster, self.name = cluster, name
        self.config = config or cluster.config_path
        self.log_path = cluster.run_dir / "log" / f"coordinator-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0  # monotonic time of start()

    def start(self, metrics_address: str = "", user_address: str = "",
              receivers: int = 1, head: int | None = None) -> CoordinatorProcess:
        """Start it with the cluster's config, metrics on ``metrics_address`` (HOST:PORT)
        or none, the user door on ``user_address`` or none, ``receivers`` heartbeat
        receiver processes; in namespace mode with ``head``, in that head namespace
        (a partition of ``h<head>`` cuts it off), else in this host's."""
        self.started = time.monotonic()
        wrap: list[str] = []
        host = self.cluster.host
        if head is not None:
            if self.cluster.net != "ns":
                raise ClusterError("a coordinator in a head namespace needs namespace mode")
            wrap = ["nsenter", f"--net={self.cluster.head_netns(head)}"]
            host = self.cluster.head_host(head)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [*wrap, sys.executable, "-m", "raps_slurm.coordinator", "--config",
                 str(self.config), "--name", self.name, "--metrics-address", metrics_address,
                 "--heartbeat-address", f"{host}:0", "--user-address", user_address,
                 "--heartbeat-receivers", str(receivers)],
                env={**os.environ, **self.cluster.env}, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)
        return self

    @property
    def pid(self) -> int:
        """Its process id."""
        if self.proc is None:
            raise ClusterError(f"coordinator {self.name} was not started")
        return self.proc.pid

    def signal(self, sig: int) -> None:
        """Send ``sig`` to it (SIGSTOP freezes, SIGCONT thaws, SIGKILL kills)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (after SIGCONT, in case it is frozen), SIGKILL after ``timeout``."""
        if self.proc is None:
            return None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout)

    def log(self) -> str:
        """What it logged so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextmanager
def cluster_for_tests(prefix: str, etcd_members: int = 1, net: str | None = None,
                      port_offset: int = 0, nodes: int = 6, racks: int = 3,
                      store_timeout: float | None = None,
                      etcd_auth: bool = True) -> Iterator[LocalCluster]:
    """A cluster up in a fresh run dir for the test session (ports from
    ``RAPS_CLUSTER_PORT``, default 17000, plus ``port_offset``; network ``net``, else
    ``RAPS_CLUSTER_NET``, default loopback; etcd with authentication unless
    ``etcd_auth`` is off); always down and removed afterwards."""
    # Not pytest's tmp_path: its parents are mode 0700 and slurmctld runs as SlurmUser.
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    c = LocalCluster(run_dir, nodes=nodes, racks=racks,
                     port_base=int(os.environ.get("RAPS_CLUSTER_PORT", "17000")) + port_offset,
                     etcd_members=etcd_members,
                     net=net or os.environ.get("RAPS_CLUSTER_NET", "lo"),
                     store_timeout=store_timeout)
    try:
        c.up(extra_env=None if etcd_auth else {"RAPS_CLUSTER_ETCD_AUTH": "0"})
        yield c
    finally:
        try:
            c.down()  # also after a failed up: stops what it did start
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)


def wait_until(what: str, probe: Callable[[], T], ok: Callable[[T], bool] = bool,
               timeout: float = 30.0, interval: float = 0.2,
               explain: Callable[[], str] | None = None) -> T:
    """Poll ``probe`` until ``ok(value)``; fail naming what was awaited and the last value
    (and what ``explain()`` says then, if given)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what}; last seen: {value!r}"
                + (f"\n{explain()}" if explain is not None else ""))
        time.sleep(interval)


def leader_name(store: StateStore, keys: Keys) -> str | None:
    """The name in the coordinator leader key (whom ``rapsctl ping`` reports as leader), or
    None when nobody leads or etcd does not answer. Read here, not through a ``rapsctl``
    process: a probe that takes a second would see a new leader a second late."""
    try:
        value = read_leader(store, keys.leader())
    except StoreError:
        return None
    return str(value.get("name")) if isinstance(value, dict) else None


def wait_leading(store: StateStore, keys: Keys, name: str, timeout: float = 20.0) -> None:
    """Wait until coordinator ``name`` holds the leader key."""
    wait_until(f"coordinator {name!r} to lead", lambda: leader_name(store, keys),
               lambda n: n == name, timeout, interval=0.05)
