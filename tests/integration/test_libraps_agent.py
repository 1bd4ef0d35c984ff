"""libraps against a real agent of the test cluster: a C rank and a Fortran rank register,
protect two regions, checkpoint twice, lose their memory and restore it byte for byte;
the generations are in etcd like a Python rank's. A wrong job, another user's job and a
missing agent get their own error codes, and the agent keeps serving. The heat stencils
of examples/c and examples/fortran, built with mpicc/mpif90 and run by Open MPI's mpirun,
lose a rank mid-run and, started again, restore and print the failure-free result."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.config import load_file, node_dir
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import RankEntry
from raps_slurm.core.planner import Plan, PlanEvent, plan_id
from raps_slurm.runtime.agent_client import encode_frame, read_reply
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster
from raps_slurm.testing.jobs import system_user
from raps_slurm.testing.programs import mpirun as run_mpi
from raps_slurm.testing.programs import register_job

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "libraps"
# raps.h codes (docs/c-api.md)
NO_AGENT, PERMISSION, WRONG_JOB = 3, 5, 6


@pytest.fixture(scope="module")
def programs() -> Iterator[Path]:
    """libraps built, and the C and Fortran test ranks linked to a copy of it in a
    directory every uid can read (the second user runs them too)."""
    subprocess.run(["make", "-s", "-C", str(LIB)], check=True, capture_output=True, timeout=180)
    out = Path(tempfile.mkdtemp(prefix="raps-libraps-"))
    try:
        out.chmod(0o755)
        for name in ("libraps.so.0", "libraps_f.so.0"):
            shutil.copy(LIB / name, out / name)
        link = ["-I", str(LIB), "-L", str(LIB), "-Wl,-rpath," + str(out)]
        subprocess.run(["cc", "-O2", "-o", str(out / "check"), str(LIB / "tests/check.c"),
                        *link, "-lraps"], check=True, capture_output=True, timeout=120)
        subprocess.run(["gfortran", "-O2", "-J", str(out), "-o", str(out / "fcheck"),
                        str(LIB / "tests/check.f90"), *link, "-lraps_f", "-lraps"],
                       check=True, capture_output=True, timeout=120)
        subprocess.run(["mpicc", "-O2", "-o", str(out / "heat"),
                        str(ROOT / "examples/c/heat.c"), *link, "-lraps"],
                       check=True, capture_output=True, timeout=120)
        subprocess.run(["mpicc", "-O2", "-o", str(out / "common"),
                        str(LIB / "tests/common.c"), *link, "-lraps"],
                       check=True, capture_output=True, timeout=120)
        subprocess.run(["mpif90", "-O2", "-J", str(out), "-o", str(out / "fheat"),
                        str(ROOT / "examples/fortran/heat.f90"), *link, "-lraps_f", "-lraps"],
                       check=True, capture_output=True, timeout=120)
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)


def setup_job(store: tuple[StateStore, Keys], ranks: int = 1) -> str:
    """A registered job of root with ``ranks`` ranks on n1 (backups on n2, n3)."""
    return register_job(store, ranks)


def run(cluster: LocalCluster, program: Path, job: str, *args: str, uid: int | None = None,
        socket: str | None = None) -> tuple[int, list[dict[str, Any]]]:
    cfg = load_file(cluster.config_path)
    env = {"PATH": "/usr/bin:/bin", "RAPS_JOB": job, "RAPS_RANK": "0", "RAPS_EPOCH": "1",
           "RAPS_APP_HEARTBEAT_SEC": "1",
           "RAPS_AGENT_SOCKET": socket or node_dir(cfg.agent.socket_path, "n1")}
    proc = subprocess.run([str(program), *args], env=env, capture_output=True, text=True,
                          timeout=120, user=uid, cwd="/")
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc.returncode, lines


def committed(store: tuple[StateStore, Keys], job: str) -> list[CkptRecord]:
    s, k = store
    out = []
    for gen in (1, 2, 3):
        kv = s.get(k.ckpt(job, 0, gen))
        if kv is not None:
            out.append(CkptRecord.from_json(kv.key, kv.value))
    return out


@pytest.mark.parametrize("program", ["check", "fcheck"])
def test_checkpoint_and_restore(cluster: LocalCluster, store: tuple[StateStore, Keys],
                                programs: Path, program: str) -> None:
    job = setup_job(store)
    rc, lines = run(cluster, programs / program, job)
    assert rc == 0, lines
    result = next(x for x in lines if "same" in x)
    assert result["version"] == 2 and result["restored"] == 2, result
    assert result["same"] in (True, "T"), result
    records = committed(store, job)
    assert [r.generation for r in records] == [1, 2], records
    # the second save sent only what changed: it is stored once more in part, not whole
    assert records[1].total_size == records[0].total_size
    assert records[1].whole_digest != records[0].whole_digest


def test_refusals_keep_the_agent_serving(cluster: LocalCluster,
                                         store: tuple[StateStore, Keys],
                                         programs: Path) -> None:
    root_job = setup_job(store)
    bob = system_user("raps-libraps-bob")
    # another user's job: refused at registration, with the agent's kind
    rc, lines = run(cluster, programs / "check", root_job, "init", uid=bob)
    assert rc == 1 and lines[0]["rc"] == PERMISSION, lines
    assert lines[0]["kind"] == "permission" and "uid" in lines[0]["error"], lines
    # a job raps-slurm does not know
    rc, lines = run(cluster, programs / "check", "1" + root_job, "init", uid=bob)
    assert rc == 1 and lines[0]["rc"] == WRONG_JOB and lines[0]["kind"] == "unknown_job", lines
    # root may register any rank, but a rank not in the job's rank map cannot commit
    rc, lines = run(cluster, programs / "check", "2" + root_job)
    failed = lines[-1]
    assert rc == 1 and failed["call"] == "checkpoint" and failed["rc"] == WRONG_JOB, lines
    # no agent behind the socket
    rc, lines = run(cluster, programs / "check", root_job, "init",
                    socket="/nonexistent/raps.sock")
    assert rc == 1 and lines[0]["rc"] == NO_AGENT and "/nonexistent" in lines[0]["error"], lines
    # and the agent still serves its own user
    rc, lines = run(cluster, programs / "check", root_job, "init")
    assert rc == 0 and [x["call"] for x in lines] == ["init", "finalize"], lines
    assert os.path.exists(node_dir(load_file(cluster.config_path).agent.socket_path, "n1"))


def ask(cluster: LocalCluster, request: dict[str, Any]) -> dict[str, Any]:
    """One request to n1's agent (as root), its reply."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(30)
        conn.connect(node_dir(load_file(cluster.config_path).agent.socket_path, "n1"))
        conn.sendall(encode_frame(request))
        return read_reply(conn)


def phases(store: tuple[StateStore, Keys], pid: str) -> dict[str, dict[str, Any]]:
    """What n1's agent recorded of the plan's phases: phase -> detail."""
    s, k = store
    out = {}
    for phase in ("restored", "running", "caught_up"):
        kv = s.get(k.plan_event("n1", pid, phase))
        if kv is not None:
            out[phase] = PlanEvent.from_json(kv.key, kv.value).detail
    return out


def mpirun(cluster: LocalCluster, program: Path, job: str, crash_at: int | None = None,
           args: tuple[str, ...] = ("64", "64", "120", "20"), ranks: int = 4,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    crash = {} if crash_at is None else {"RAPS_HEAT_CRASH_AT": str(crash_at)}
    return run_mpi(cluster.config_path, program, job, args, ranks, {**crash, **(env or {})})


def per_rank(proc: subprocess.CompletedProcess[str]) -> dict[int, dict[str, Any]]:
    """The JSON line each rank of libraps/tests/common.c printed last."""
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            out[d["rank"]] = d
    assert proc.returncode == 0, (proc.returncode, out, proc.stderr[-2000:])
    return out


def test_ranks_restore_their_common_generation(
        cluster: LocalCluster, store: tuple[StateStore, Keys], programs: Path) -> None:
    job = setup_job(store, 2)
    saved = per_rank(mpirun(cluster, programs / "common", job, args=("save",), ranks=2))
    assert saved == {0: {"rank": 0, "saved": True}, 1: {"rank": 1, "saved": True}}, saved
    s, k = store
    assert s.get(k.ckpt(job, 0, 2)) is not None and s.get(k.ckpt(job, 1, 2)) is None
    listed = [ask(cluster, {"op": "ckpt_generations", "job": job, "rank": r}) for r in (0, 1)]
    assert [x["generations"] for x in listed] == [
        [{"generation": 2, "label": 20}, {"generation": 1, "label": 10}],
        [{"generation": 1, "label": 10}]], listed
    # a generation the rank lacks, and ones that are no generation number
    for gen, kind in ((2, "no_generation"), ("2", "schema"), (True, "schema"), (0, "schema")):
        reply = ask(cluster, {"op": "ckpt_restore", "job": job, "rank": 1, "generation": gen})
        assert not reply["ok"] and reply["kind"] == kind, (gen, reply)
    # no address is for a rank that is done only
    reply = ask(cluster, {"op": "peer_publish", "job": job, "rank": 1, "epoch": 1,
                          "host": None, "port": None, "done": False})
    assert not reply["ok"] and "null only with 'done'" in reply["error"], reply
    # rank 0 holds labels 10 and 20, rank 1 only 10: both restore 10, byte for byte
    again = per_rank(mpirun(cluster, programs / "common", job, args=("restore",), ranks=2))
    for rank in (0, 1):
        assert again[rank] == {"rank": rank, "common": 10, "restored": 10, "same": True}, again


def final(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [x for x in proc.stdout.splitlines() if x.startswith("final ")]
    assert proc.returncode == 0 and len(lines) == 1, (proc.returncode, proc.stdout[-2000:],
                                                      proc.stderr[-2000:])
    return lines[0]


@pytest.mark.parametrize("program", ["heat", "fheat"])
def test_heat_restarts_with_the_failure_free_result(
        cluster: LocalCluster, store: tuple[StateStore, Keys], programs: Path,
        program: str) -> None:
    clean = final(mpirun(cluster, programs / program, setup_job(store, 4)))
    job = setup_job(store, 4)
    crashed = mpirun(cluster, programs / program, job, crash_at=70)
    assert crashed.returncode != 0 and "final " not in crashed.stdout, crashed.stdout[-2000:]
    again = mpirun(cluster, programs / program, job)
    assert "restored step 60" in again.stdout, (again.stdout[-2000:], again.stderr[-2000:])
    assert final(again) == clean


def test_a_relaunched_rank_reports_its_recovery_and_a_finished_rank_is_done(
        cluster: LocalCluster, store: tuple[StateStore, Keys], programs: Path) -> None:
    s, k = store
    job = setup_job(store, 2)
    per_rank(mpirun(cluster, programs / "common", job, args=("save",), ranks=2))
    # a plan moved rank 1 to n1 with epoch 2 when it had reached step 5; the step starts
    # again whole, every rank from the common generation
    pid = plan_id(job, 1, 2)
    s.put(k.plan(pid), Plan(pid, job, 1, "n2", "n1", 2, "node n2 DEAD", 0, "running",
                            created_at=time.time(), progress=5).to_json())
    # (rank 1 ran on n1 at epoch 1: setup_job puts every rank there)
    s.put(k.job_rank(job, 1),
          RankEntry(1, "n1", 2, "running", ("n4",), ((1, "n1"),)).to_json())
    again = per_rank(mpirun(cluster, programs / "common", job, args=("restore", "8"), ranks=2,
                            env={"RAPS_EPOCH": "1", "RAPS_EPOCHS": "1=2"}))
    assert all(again[r]["same"] is True and again[r]["common"] == 10 for r in (0, 1)), again
    seen = phases(store, pid)
    # restored by the agent, running at the first progress, caught up at the plan's step
    assert seen["restored"]["generation"] == 1, seen
    assert seen["running"] == {"step": 0} and seen["caught_up"] == {"step": 5}, seen
    # rank 0 kept epoch 1: no plan of its own gets a report
    assert phases(store, plan_id(job, 0, 2)) == {}
    # raps_finalize said each rank is done (with its epoch): its silence is no hang
    for rank, epoch in ((0, 1), (1, 2)):
        kv = s.get(k.job_peer("n1", job, rank))
        assert kv is not None, f"rank {rank} published nothing"
        assert json.loads(kv.value) == {"host": None, "port": None, "epoch": epoch,
                                        "done": True, "node": "n1"}, kv.value
