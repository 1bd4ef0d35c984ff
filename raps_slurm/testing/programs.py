"""The compiled MPI programs of ``examples/`` (the C and Fortran heat stencils), built
against libraps for the tests and ``rapsctl bench restart``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

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
