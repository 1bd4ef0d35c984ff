"""The SPANK shim (spank/raps_spank.so) on the real local cluster.

scripts/cluster.sh puts the shim into the cluster's plugstack.conf when
spank/raps_spank.so exists when the cluster comes up (scripts/test.sh builds it first).
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm import CommandRunner
from raps_slurm.testing.cluster import LocalCluster, wait_until

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "spank" / "raps_spank.so"
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="session", autouse=True)
def shim_built() -> None:
    """Checked before the session cluster comes up: its plugstack.conf is written then."""
    if not SHIM.is_file():
        pytest.fail(f"{SHIM} is missing: build it: make -C spank", pytrace=False)


@pytest.fixture(scope="module")
def plugin_args(cluster: LocalCluster) -> dict[str, str]:
    """The arguments the cluster's plugstack.conf gives the shim (agent_socket, coordinator)."""
    conf = (cluster.run_dir / "etc" / "plugstack.conf").read_text()
    lines = [ln.split() for ln in conf.splitlines() if ln.strip() and not ln.startswith("#")]
    ours = [ln for ln in lines if len(ln) >= 2 and Path(ln[1]) == SHIM]
    assert ours, f"the cluster's plugstack.conf does not load {SHIM}:\n{conf}"
    args = dict(a.split("=", 1) for a in ours[0][2:])
    assert set(args) == {"agent_socket", "coordinator"}, args
    return args


@pytest.fixture
def run(cluster: LocalCluster) -> CommandRunner:
    return CommandRunner(timeout=60, env=cluster.env)


@pytest.fixture
def out_dir(cluster: LocalCluster) -> Iterator[Path]:
    """A directory the jobs (run as root, the test user) write their output into."""
    d = cluster.run_dir / "spank-out" / uuid.uuid4().hex[:8]
    d.mkdir(parents=True)
    yield d


def unique_name() -> str:
    return f"raps-spank-{uuid.uuid4().hex[:10]}"


def jobs_named(run: CommandRunner, name: str) -> list[str]:
    """Every job of that name slurmctld knows, finished ones included."""
    return run.run(["squeue", "-h", "-t", "all", "-n", name, "-o", "%i"]).split()


def submit(cluster: LocalCluster, run: CommandRunner, *args: str) -> int:
    """sbatch from an environment without RAPS* variables (the harness has some), so that
    whatever RAPS* variable the job sees was put there by the shim."""
    unset = [f"--unset={k}" for k in {**os.environ, **cluster.env} if "RAPS" in k]
    return int(run.run(["env", *unset, "sbatch", "--parsable", *args]).strip().split(";")[0])


def wait_done(cluster: LocalCluster, job_id: int) -> None:
    slurm = cluster.slurm()
    state = wait_until(f"job {job_id} to finish", lambda: slurm.job(job_id).state,
                       lambda s: s in FINISHED, timeout=60)
    assert state == "COMPLETED", f"job {job_id} ended {state}"


def env_lines(path: Path) -> dict[str, str]:
    """NAME=VALUE lines of an `env | grep` dump."""
    return dict(ln.split("=", 1) for ln in path.read_text().splitlines() if ln)


def assert_refused(run: CommandRunner, args: list[str], message: str) -> None:
    """sbatch fails with ``message`` as one error line of its own and queues no job."""
    name = unique_name()
    with pytest.raises(SlurmCommandError) as info:
        run.run(["sbatch", "-J", name, "-o", "/dev/null", *args, "--wrap", "true"])
    assert f"sbatch: error: {message}" in info.value.stderr.splitlines(), info.value.stderr
    assert jobs_named(run, name) == [], "a refused submission still queued a job"


BAD_VALUES = [
    ("--raps-spares=abc", "raps: --raps-spares: expected an integer 0-64, got 'abc'"),
    ("--raps-spares=65", "raps: --raps-spares: expected an integer 0-64, got '65'"),
    ("--raps-replicas=-1", "raps: --raps-replicas: expected an integer 0-8, got '-1'"),
    ("--raps-replicas=+1", "raps: --raps-replicas: expected an integer 0-8, got '+1'"),
    ("--raps-ckpt-interval=0", "raps: --raps-ckpt-interval: expected an integer 1-604800, got '0'"),
    ("--raps-ckpt-interval=99999999999999999999", "raps: --raps-ckpt-interval: expected an integer 1-604800, got '99999999999999999999'"),
    ("--raps-ranks-per-node=1x", "raps: --raps-ranks-per-node: expected an integer 1-1024, got '1x'"),
    ("--raps-ranks-per-node=0x10", "raps: --raps-ranks-per-node: expected an integer 1-1024, got '0x10'"),
    ("--raps-ranks-per-node= 4", "raps: --raps-ranks-per-node: expected an integer 1-1024, got ' 4'"),
    ("--raps-spares=", "raps: --raps-spares: expected an integer 0-64, got ''"),
]


@pytest.mark.parametrize(("option", "message"), BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_bad_value_refuses_submission(cluster: LocalCluster, run: CommandRunner,
                                      option: str, message: str) -> None:
    assert_refused(run, ["--raps", option], message)


@pytest.mark.parametrize("option", ["--raps-spares=2", "--raps-replicas=1",
                                    "--raps-ckpt-interval=60", "--raps-ranks-per-node=2"])
def test_value_without_raps_is_refused(cluster: LocalCluster, run: CommandRunner,
                                       option: str) -> None:
    name = option[2:].split("=")[0]
    assert_refused(run, [option], f"raps: --{name} needs --raps")


def dump_script(out_dir: Path, tag: str, pattern: str = "^RAPS_") -> str:
    """Batch script: its own RAPS_* env, then that of a step on the job's last node."""
    dump = f"env | grep {pattern} | sort"
    return (f"{dump} > {out_dir}/batch-{tag}.env; "
            f"srun -N1 -n1 -w \"$(scontrol show hostnames | tail -1)\" "
            f"sh -c '{dump}' > {out_dir}/step-{tag}.env; echo done > {out_dir}/done-{tag}")


def test_raps_job_environment(cluster: LocalCluster, run: CommandRunner, out_dir: Path,
                              plugin_args: dict[str, str]) -> None:
    plain = submit(cluster, run, "--raps", "--raps-spares=2", "-N2", "-J", unique_name(),
                   "-o", str(out_dir / "a.out"), "--wrap", dump_script(out_dir, "a"))
    full = submit(cluster, run, "--raps", "--raps-spares=1", "--raps-replicas=3",
                  "--raps-ckpt-interval=604800", "--raps-ranks-per-node=4", "-N2",
                  "-J", unique_name(), "-o", str(out_dir / "b.out"),
                  "--wrap", dump_script(out_dir, "b"))
    wait_done(cluster, plain)
    wait_done(cluster, full)

    where = {"RAPS_AGENT_SOCKET": plugin_args["agent_socket"],
             "RAPS_COORDINATOR": plugin_args["coordinator"]}
    expected = {"RAPS_ENABLED": "1", "RAPS_SPARES": "2", "RAPS_RANKS_PER_NODE": "1", **where}
    assert env_lines(out_dir / "batch-a.env") == expected
    assert env_lines(out_dir / "step-a.env") == expected
    expected = {"RAPS_ENABLED": "1", "RAPS_SPARES": "1", "RAPS_REPLICAS": "3",
                "RAPS_CKPT_INTERVAL": "604800", "RAPS_RANKS_PER_NODE": "4", **where}
    assert env_lines(out_dir / "batch-b.env") == expected
    assert env_lines(out_dir / "step-b.env") == expected


def test_job_without_raps_sees_nothing(cluster: LocalCluster, run: CommandRunner,
                                       out_dir: Path) -> None:
    job = submit(cluster, run, "-N2", "-J", unique_name(), "-o", str(out_dir / "c.out"),
                 "--wrap", dump_script(out_dir, "c", pattern="RAPS"))
    wait_done(cluster, job)
    assert (out_dir / "done-c").read_text() == "done\n"
    assert (out_dir / "batch-c.env").read_text() == ""
    assert (out_dir / "step-c.env").read_text() == ""


@pytest.mark.parametrize(("args", "message"), [
    ("agent_socket=/run/raps/agent.sock colour=blue", "raps: unknown plugin argument 'colour=blue'"),
    ("agent_socket=run/agent.sock", "raps: plugin argument agent_socket: invalid value 'run/agent.sock'"),
    ("coordinator=127.0.0.1:0", "raps: plugin argument coordinator: invalid value '127.0.0.1:0'"),
    ("coordinator=127.0.0.1:7470,", "raps: plugin argument coordinator: invalid value '127.0.0.1:7470,'"),
    ("coordinator=a:1 coordinator=b:2", "raps: plugin argument coordinator given twice"),
], ids=["unknown", "relative-socket", "port-0", "trailing-comma", "twice"])
def test_bad_plugin_arguments_fail(cluster: LocalCluster, tmp_path: Path,
                                   args: str, message: str) -> None:
    """sbatch with a copy of the cluster's slurm.conf whose plugstack.conf is wrong."""
    conf = (cluster.run_dir / "etc" / "slurm.conf").read_text()
    plugstack = tmp_path / "plugstack.conf"
    plugstack.write_text(f"required {SHIM} {args}\n")
    conf, n = re.subn(r"(?m)^PlugStackConfig=.*$", f"PlugStackConfig={plugstack}", conf)
    assert n == 1
    (tmp_path / "slurm.conf").write_text(conf)
    run = CommandRunner(timeout=60, env={**cluster.env, "SLURM_CONF": str(tmp_path / "slurm.conf")})
    name = unique_name()
    with pytest.raises(SlurmCommandError) as info:
        run.run(["sbatch", "--raps", "-J", name, "-o", "/dev/null", "--wrap", "true"])
    lines = info.value.stderr.splitlines()
    assert any(ln.startswith(f"sbatch: error: {message}") for ln in lines), info.value.stderr
    assert jobs_named(CommandRunner(env=cluster.env), name) == []


ALLOWED = {"plugin_name", "plugin_type", "plugin_version", "spank_plugin_version"}
REQUIRED = {"plugin_name", "plugin_type", "plugin_version", "slurm_spank_init",
            "slurm_spank_init_post_opt", "slurm_spank_user_init"}


def unexpected_exports(path: Path) -> set[str]:
    """Defined dynamic symbols of ``path`` beyond the SPANK plugin interface."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True,
                         text=True, check=True, timeout=30).stdout
    names = set()
    for line in out.splitlines():
        fields = line.split()
        assert len(fields) == 3, f"unexpected nm line: {line!r}"
        names.add(fields[2])
    assert names >= REQUIRED, f"{path} lacks plugin symbols: {sorted(REQUIRED - names)}"
    return {n for n in names - ALLOWED if not n.startswith("slurm_spank_")}


def test_shim_exports_only_plugin_symbols() -> None:
    assert unexpected_exports(SHIM) == set()


def test_export_check_catches_a_leaked_symbol(tmp_path: Path) -> None:
    """The real Makefile hides even a default-visibility global; without its version script
    the same global leaks and the check above says so."""
    leak = tmp_path / "leak.h"
    leak.write_text('__attribute__((visibility("default"))) int raps_leaked_global = 1;\n')

    def build(name: str, *overrides: str) -> Path:
        so = tmp_path / name
        subprocess.run(["make", "-s", "-C", str(SHIM.parent), f"PLUGIN={so}",
                        f"CFLAGS=-include {leak}", *overrides],
                       capture_output=True, text=True, check=True, timeout=120)
        return so

    assert unexpected_exports(build("hidden.so")) == set()
    assert unexpected_exports(build("leaky.so", "RAPS_LDFLAGS=-shared")) == {"raps_leaked_global"}
