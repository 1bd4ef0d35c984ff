"""scripts/install.sh on the real local cluster: a cluster whose Slurm hooks, SPANK plugin,
plugstack.conf and slurm.conf lines come only from the install script
(``RAPS_CLUSTER_INSTALL=script``: scripts/cluster.sh runs it for --role controller, then
compute), runs --raps jobs through them. And the agent's side of the raps-agent unit's
Type=notify: READY=1 once its socket listens, then WATCHDOG=1.

Its own small cluster (2 nodes), 50 ports above ``RAPS_CLUSTER_PORT`` so that it can run
beside the session cluster of the other tests here."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.agent.main import WATCHDOG_EVERY_SEC
from raps_slurm.config import load_file
from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until

REPO = Path(__file__).resolve().parents[2]
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module")
def installed() -> Iterator[LocalCluster]:
    run_dir = Path(tempfile.mkdtemp(prefix="raps-install-"))
    c = LocalCluster(run_dir, nodes=2, racks=2,
                     port_base=int(os.environ.get("RAPS_CLUSTER_PORT", "17000")) + 50)
    try:
        c.up(extra_env={"RAPS_CLUSTER_INSTALL": "script"})
        yield c
    finally:
        try:
            c.down()
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def run(installed: LocalCluster) -> CommandRunner:
    return CommandRunner(timeout=60, env=installed.env)


def sbatch(installed: LocalCluster, run: CommandRunner, *args: str) -> int:
    """sbatch without the harness's RAPS* variables: what the job sees, the plugin put."""
    unset = [f"--unset={k}" for k in {**os.environ, **installed.env} if "RAPS" in k]
    return int(run.run(["env", *unset, "sbatch", "--parsable", *args]).strip().split(";")[0])


def test_slurm_runs_what_install_sh_installed(installed: LocalCluster,
                                              run: CommandRunner) -> None:
    inst = installed.run_dir / "inst"
    config = dict(line.split("=", 1) for line in
                  (ln.replace(" ", "") for ln in run.run(["scontrol", "show", "config"])
                   .splitlines()) if "=" in line)
    assert config["PlugStackConfig"] == f"{inst}/etc/slurm/plugstack.conf"
    for hook, name in (("PrologSlurmctld", "prolog-slurmctld"), ("Prolog", "prolog"),
                       ("EpilogSlurmctld", "epilog-slurmctld"), ("Epilog", "epilog")):
        assert config[hook] == f"{inst}/lib/raps/{name}"
        assert "written by scripts/install-hooks.sh" in (inst / "lib/raps" / name).read_text()
    assert config["PrologFlags"] == "Alloc"
    assert not (installed.run_dir / "hooks").exists()  # cluster.sh's own wiring is unused
    assert "plugstack" not in (installed.run_dir / "etc/slurm.conf").read_text().lower()
    log = (installed.run_dir / "log/install.log").read_text()
    assert "install.sh: controller: " in log and "install.sh: compute: " in log


def test_a_raps_job_goes_through_the_installed_plugin_and_hooks(
        installed: LocalCluster, run: CommandRunner) -> None:
    out = installed.run_dir / "jobs"
    out.mkdir(exist_ok=True)
    out.chmod(0o777)
    job = sbatch(installed, run, "--raps", "--raps-spares=1", "-N1", "-J", "raps-installed",
                 "-o", str(out / "%j.out"), "--wrap", "env | grep ^RAPS_ | sort")
    slurm = installed.slurm()
    state = wait_until(f"job {job} to finish", lambda: slurm.job(job).state,
                       lambda s: s in FINISHED, timeout=60)
    assert state == "COMPLETED", state
    env = dict(ln.split("=", 1) for ln in (out / f"{job}.out").read_text().splitlines() if ln)
    # The SPANK plugin, loaded from the plugstack snippet install.sh wrote, with the
    # arguments it took from the installed RAPS config.
    cfg = load_file(installed.config_path)
    snippet = (installed.run_dir / "inst/etc/slurm/plugstack.conf.d/raps.conf").read_text()
    assert snippet.splitlines()[-1] == (
        f"required {installed.run_dir}/inst/lib/raps/raps_spank.so "
        f"agent_socket={cfg.agent.socket_path} coordinator={','.join(cfg.coordinator.addresses)}")
    assert env["RAPS_ENABLED"] == "1" and env["RAPS_SPARES"] == "1"
    assert env["RAPS_AGENT_SOCKET"] == cfg.agent.socket_path
    assert env["RAPS_COORDINATOR"] == ",".join(cfg.coordinator.addresses)
    # The installed PrologSlurmctld registered the job in etcd; the installed Prolog made
    # its checkpoint dir.
    store, keys = open_store(cfg.store)
    with store:
        assert store.get(keys.job(job)) is not None
    logs = installed.run_dir / "log/raps"
    assert f"job={job}: registered run 0" in (logs / "prolog-slurmctld.log").read_text()
    assert f"job={job}: " in (logs / "prolog.log").read_text()
    assert f"job-{job} created" in (logs / "prolog.log").read_text()


def test_the_installed_plugin_refuses_a_raps_option_without_raps(
        installed: LocalCluster, run: CommandRunner) -> None:
    name = f"raps-install-{uuid.uuid4().hex[:8]}"
    with pytest.raises(SlurmCommandError) as info:
        run.run(["sbatch", "-J", name, "-o", "/dev/null", "--raps-spares=2", "--wrap", "true"])
    assert "sbatch: error: raps: --raps-spares needs --raps" in info.value.stderr.splitlines()


def test_install_sh_again_on_the_live_cluster_changes_nothing(installed: LocalCluster) -> None:
    inst = installed.run_dir / "inst"
    # The interpreter cluster.sh installed with (RAPS_PYTHON), as the hooks name it.
    python = (inst / "lib/raps/prolog").read_text().split("exec '", 1)[1].split("'", 1)[0]
    for role in ("controller", "compute"):
        out = subprocess.run(
            ["bash", str(REPO / "scripts/install.sh"), "--role", role, "--prefix", str(inst),
             "--sysconfdir", str(inst / "etc"), "--python", python, "--config",
             str(installed.config_path)], capture_output=True, text=True, check=False,
            timeout=120)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        if role == "compute":
            # One host holds both roles here: the compute install names the controller's
            # cluster key, which a compute node with transfer tickets does not need.
            assert lines[0].endswith("raps.key is not needed here (detection."
                                     "transfer_tickets_file is set): remove it from this "
                                     "compute node"), out.stdout
            lines = lines[1:]
        assert lines == [f"install.sh: {role}: nothing changed under /"], out.stdout


def test_the_agent_tells_systemd_it_is_ready_once_its_socket_listens(
        installed: LocalCluster, tmp_path: Path) -> None:
    """What Type=notify in slurm/systemd/raps-agent.service relies on, with a real agent on
    the cluster: READY=1 arrives on $NOTIFY_SOCKET once the agent's socket exists, then
    WATCHDOG=1 every few seconds; stopped on SIGTERM."""
    installed.agent_stop("n2")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(30)
    agent_sock = Path(load_file(installed.config_path).agent.socket_path.replace("%n", "n2"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "raps_slurm.agent", "--node", "n2", "--config",
         str(installed.config_path)], env={**os.environ, **installed.env,
                                           "NOTIFY_SOCKET": str(tmp_path / "notify")},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ready = notify.recv(512).decode()
        assert ready.startswith("READY=1\nSTATUS=agent of n2"), ready
        assert agent_sock.is_socket()
        started = time.monotonic()
        assert notify.recv(512) == b"WATCHDOG=1"
        assert time.monotonic() - started < WATCHDOG_EVERY_SEC + 2
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        notify.close()
        installed.agent_start("n2")
    assert proc.returncode == 0, err.decode()[-2000:]
