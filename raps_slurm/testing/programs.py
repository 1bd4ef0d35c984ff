"""The compiled MPI programs of ``examples/`` (the C and Fortran heat stencils), built
against libraps for the tests and ``rapsctl bench restart``."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

from raps_slurm.bench.mpi import session_tmpdir
from raps_slurm.config import load_file, node_dir
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry, RankMap, group_to_json
from raps_slurm.model import BackupGroup
from raps_slurm.store import Keys, StateStore

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "libraps"
# The fake nodes of the local cluster share one host: Open MPI's shared-memory transport
# would take ranks on two fake nodes for neighbours and crash. TCP over loopback is what
# ranks on separate hosts use (for sbatch: --export=ALL,<these>).
MPI_ENV = {"OMPI_MCA_btl": "^vader", "OMPI_MCA_btl_tcp_if_include": "lo"}


def build_stencils(out: Path, fortran: bool = True) -> dict[str, Path]:
    """libraps built (make), copied into ``out`` (which every uid may read), and the C
    stencil (``heat``) and, with ``fortran``, the Fortran one (``fheat``) linked to that
    copy; name -> program. CalledProcessError if a build fails."""
    subprocess.run(["make", "-s", "-C", str(LIB)], check=True, capture_output=True, timeout=180)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o755)
    for name in ("libraps.so.0", "libraps_f.so.0"):
        shutil.copy(LIB / name, out / name)
    link = ["-I", str(LIB), "-L", str(LIB), "-Wl,-rpath," + str(out)]
    built = {"heat": out / "heat"}
    subprocess.run(["mpicc", "-O2", "-o", str(built["heat"]), str(REPO / "examples/c/heat.c"),
                    *link, "-lraps"], check=True, capture_output=True, timeout=120)
    if fortran:
        built["fheat"] = out / "fheat"
        subprocess.run(["mpif90", "-O2", "-J", str(out), "-o", str(built["fheat"]),
                        str(REPO / "examples/fortran/heat.f90"), *link, "-lraps_f", "-lraps"],
                       check=True, capture_output=True, timeout=120)
    return built


def export_option(extra: dict[str, str] | None = None) -> str:
    """``--export=ALL,...`` with :data:`MPI_ENV` and ``extra`` (values without commas)."""
    pairs = {**MPI_ENV, **(extra or {})}
    return "--export=ALL," + ",".join(f"{k}={v}" for k, v in pairs.items())


def register_job(store: tuple[StateStore, Keys], ranks: int = 1) -> str:
    """A job of root registered by hand (no Slurm job) with ``ranks`` ranks on n1 (spare
    n4, backups on n2 and n3), for programs run beside the cluster with its agents."""
    s, k = store
    job = str(800000 + uuid.uuid4().int % 100000)
    s.put(k.job(job), JobRecord(job, 0, 0, ("n1", "n2", "n3", "n4"), JobSpec(spares=1))
          .to_json())
    s.put(k.job_map(job), RankMap(job, 0, ("n1",) * ranks, ("n4",), 2, 0.0).to_json())
    for rank in range(ranks):
        s.put(k.job_rank(job, rank), RankEntry(rank, "n1", 1, "running", ("n4",)).to_json())
        s.put(k.job_group(job, rank), group_to_json(BackupGroup(rank, "n1", "n2", ("n3",))))
    return job


def mpirun(config: Path, program: Path, job: str, args: tuple[str, ...], ranks: int = 4,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``program ARGS`` as ``ranks`` ranks of Open MPI's mpirun on this host, as ranks of
    ``job`` (:func:`register_job`) through n1's agent of the cluster whose RAPS config is
    ``config``."""
    cfg = load_file(config)
    full = {"PATH": "/usr/bin:/bin", "RAPS_JOB": job, "RAPS_APP_HEARTBEAT_SEC": "1",
            "RAPS_AGENT_SOCKET": node_dir(cfg.agent.socket_path, "n1"),
            "OMPI_MCA_btl": "self,vader", "OMPI_MCA_plm_rsh_agent": "false", **(env or {})}
    # 4 ranks on 2 cores: Open MPI yields instead of spinning when oversubscribed
    with session_tmpdir(full) as full:
        return subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np",
                               str(ranks), str(program), *args], env=full,
                              capture_output=True, text=True, timeout=180, cwd="/")
