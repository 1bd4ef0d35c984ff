"""The local launcher binds its ranks to cores as ``mpirun`` does by default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raps_slurm.runtime.local import cores

# Prints "RANK EPOCH CPUS"; rank 1 fails once, so its relaunch is seen too.
PROG = ("import os, sys; r, e = os.environ['RAPS_RANK'], os.environ['RAPS_EPOCH']; "
        "print(r, e, ','.join(map(str, sorted(os.sched_getaffinity(0)))), flush=True); "
        "sys.exit(3 if (r, e) == ('1', '1') else 0)")


def _launch(args: list[str], tmp: Path) -> dict[tuple[str, str], str]:
    proc = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", *args,
                           "--restarts", "1", "--", sys.executable, "-c", PROG],
                          capture_output=True, text=True, timeout=60, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = {}
    for line in proc.stdout.splitlines():
        rank, epoch, cpus = line.split()
        seen[(rank, epoch)] = cpus
    return seen


def test_cores_follow_mpirun_default() -> None:
    usable = sorted(os.sched_getaffinity(0))
    assert cores(len(usable)) == usable
    assert cores(1) == usable[:1]
    assert cores(len(usable) + 1) is None  # oversubscribed: not bound, as mpirun
    assert cores(1, "none") is None
    with pytest.raises(ValueError, match="expected one of core, none"):
        cores(1, "socket")


def test_each_rank_and_its_relaunch_run_on_their_own_core(tmp_path: Path) -> None:
    usable = sorted(os.sched_getaffinity(0))
    assert len(usable) >= 2, f"binding two ranks needs two usable CPUs, this has {usable}"
    seen = _launch(["-n", "2"], tmp_path)
    assert seen == {("0", "1"): str(usable[0]), ("1", "1"): str(usable[1]),
                    ("1", "2"): str(usable[1])}
    everything = ",".join(map(str, usable))
    unbound = _launch(["-n", "2", "--bind-to", "none"], tmp_path)
    assert set(unbound.values()) == {everything}


def test_a_wrong_bind_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", "-n", "2",
                           "--bind-to", "socket", "--", "true"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert "argument --bind-to: invalid choice: 'socket' (choose from 'core', 'none')" \
        in proc.stderr
