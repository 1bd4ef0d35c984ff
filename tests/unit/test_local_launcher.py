"""The local launcher binds its ranks to cores as ``mpirun`` does by default, and grows
their heap in huge pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raps_slurm.core.launch import heap_tunables
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


def test_heap_tunables_keep_the_users() -> None:
    assert heap_tunables({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert heap_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert heap_tunables({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}


# Keeps 8 MiB of 4 KiB bytes objects (as a log keeps small messages) and prints the
# tunables it ran with and the page faults that cost.
HEAP = ("import os, resource; t = os.environ.get('GLIBC_TUNABLES', '-'); "
        "f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; "
        "kept = [bytes(4096) + bytes([i % 256]) for i in range(2048)]; "
        "print(t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f, flush=True)")


def _heap(env: dict[str, str], tmp: Path) -> tuple[str, int]:
    proc = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", "-n", "1", "--",
                           sys.executable, "-c", HEAP], capture_output=True, text=True,
                          timeout=60, cwd=tmp, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tunables, faults = proc.stdout.split()
    return tunables, int(faults)


def test_a_ranks_heap_grows_in_huge_pages_unless_the_user_says_otherwise(
        tmp_path: Path) -> None:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    assert thp.exists() and "[never]" not in thp.read_text(), (
        "the kernel has no transparent huge pages (madvise or always needed): the heap "
        "tunable would change nothing")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    tunables, faults = _heap(env, tmp_path)
    assert tunables == "glibc.malloc.hugetlb=1"
    off, small_pages = _heap({**env, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, tmp_path)
    assert off == "glibc.malloc.hugetlb=0"
    # 8 MiB in 4 KiB pages is some 2000 faults. In huge pages, 290-510 here: the heap's
    # first and last pieces are not whole huge pages, and the kernel falls back to small
    # ones where it has no huge page free.
    assert small_pages > 1500 and faults < small_pages / 2, (faults, small_pages)
