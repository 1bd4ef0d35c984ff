"""mpi4py programs run unchanged under Open MPI (Debian's ``mpirun`` and python3-mpi4py,
installed by scripts/test.sh) and under RAPS (the local launcher with ``--mpi4py``): the
outputs are equal, bit for bit where the program fixes the order of its floating-point
operations, to rounding where MPI chooses it. Under RAPS the programs that checkpoint
also lose a rank (a worker, and separately the master: ``--die``) and still print the
failure-free result, from their last checkpoint and, with none (as an unmodified program),
from the start; an ``Abort`` ends the job under both."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.bench.mpi import session_tmpdir
from raps_slurm.mpi.support import FAMILIES

REPO = Path(__file__).resolve().parents[2]
RANKS = 3
# Debian's mpi4py is built for the system Python; mpirun runs as root here only when
# told to, and with more ranks than cores only when allowed to oversubscribe.
SYSTEM_PYTHON = "/usr/bin/python3"


def _mpirun(ranks: int) -> list[str]:
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,tcp",
            "-n", str(ranks)]


def _local(ranks: int) -> list[str]:
    return [sys.executable, "-m", "raps_slurm.runtime.local", "-n", str(ranks), "--mpi4py"]


MPIRUN, LOCAL = _mpirun(RANKS), _local(RANKS)

# program, its arguments, and the crashes it must survive under RAPS: the arguments
# added (--die RANK:WHEN, and --every N to checkpoint seldom or never)
NEVER = ["--every", "1000000"]  # an unmodified program: it re-executes from the start
PROGRAMS: dict[str, tuple[str, list[str], list[list[str]]]] = {
    "ring": ("examples/mpi_ring.py", [], []),
    "collectives": ("examples/mpi_collectives.py", [], []),
    "calls": ("tests/data/mpi/calls.py", [], []),
    "pi": ("examples/mpi_pi.py", [], []),
    "reduce": ("examples/mpi_reduce.py", [], []),
    "stencil": ("examples/mpi_stencil.py", [], [["--die", "2:130"]]),
    "master_worker": ("examples/mpi_master_worker.py", [],
                      [["--die", "2:4"], ["--die", "0:7"], ["--die", "0:7", *NEVER]]),
    "waitany": ("examples/mpi_waitany.py", [], [["--die", "0:5"]]),
    "large_recv": ("tests/data/mpi/large_recv.py", [], [["--die", "1:3"]]),
    "waitall_recv": ("tests/data/mpi/waitall_recv.py", [], [["--die", "1:3"]]),
    "anysource_recv": ("tests/data/mpi/anysource_recv.py", [],
                       [["--die", "0:3"], ["--die", "1:4"]]),
}


# The programs of examples/mpi4py: one per call family of raps_slurm/mpi/support.py, run
# together in one test; each also loses rank 1 at its second step under RAPS.
BATCHED = sorted({p for f in FAMILIES for p in f.programs} - {p for p, _, _ in PROGRAMS.values()})


_SESSIONS = contextlib.ExitStack()


@pytest.fixture(scope="module", autouse=True)
def _session_dirs() -> Iterator[None]:
    with _SESSIONS:
        yield


def _start(argv: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAPS_", "OMPI_", "PMIX_"))}
    if argv[0] == "mpirun":  # started together, each in a session directory of its own
        env = _SESSIONS.enter_context(session_tmpdir(env))
    return subprocess.Popen(argv, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _finish(p: subprocess.Popen[str], what: str) -> tuple[str, str]:
    try:
        out, err = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"{what} did not end in 90 s: {err[-2000:]}")
    assert p.returncode == 0, f"{what} exited with {p.returncode}: {err[-3000:]}"
    return out, err


def _raps(program: str, args: list[str], tmp: Path, *extra: str) -> subprocess.Popen[str]:
    return _start([*LOCAL, *extra, "--", sys.executable, str(REPO / program), *args], tmp)


def _same(name: str, ours: str, theirs: str) -> None:
    """Equal outputs, except that a value on a line marked ``rounded`` (a floating-point
    reduction in the order MPI chooses) may differ by the rounding of a sum over the
    ranks."""
    a, b = ours.splitlines(), theirs.splitlines()
    assert len(a) == len(b) and a, f"{name}: RAPS printed\n{ours}\nOpen MPI printed\n{theirs}"
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        assert x.startswith("rounded ") and _words(x) == _words(y), \
            f"{name}: RAPS printed {x!r}, Open MPI {y!r}"
        for u, v in zip(x.split(), y.split(), strict=True):
            if u != v:
                assert math.isclose(float(u), float(v), rel_tol=1e-13), f"{name}: {x!r} vs {y!r}"


def _words(line: str) -> list[str]:
    """The line without its numbers."""
    return [w for w in line.split() if not w.lstrip("-").replace(".", "", 1)
            .replace("e-", "", 1).isdigit()]


@pytest.fixture(scope="module")
def mpirun() -> list[str]:
    have = shutil.which("mpirun") and os.path.exists(SYSTEM_PYTHON) and subprocess.run(
        [SYSTEM_PYTHON, "-c", "import mpi4py.MPI, numpy"], capture_output=True).returncode == 0
    assert have, "Open MPI and Debian's mpi4py are missing: scripts/test.sh installs " \
                 "openmpi-bin, python3-mpi4py and python3-numpy"
    return [*MPIRUN, SYSTEM_PYTHON]


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_prints_what_open_mpi_prints(name: str, mpirun: list[str],
                                             tmp_path: Path) -> None:
    program, args, crashes = PROGRAMS[name]
    # All at once (they are independent): the suite's time is what matters.
    theirs_p = _start([*mpirun, str(REPO / program), *args], tmp_path)
    ours_p = _raps(program, args, tmp_path)
    crashed = {" ".join(c): _raps(program, [*args, *c], tmp_path, "--restarts", "1",
                                  "--dir", str(tmp_path / f"crash{i}"))
               for i, c in enumerate(crashes)}
    theirs, _ = _finish(theirs_p, f"mpirun {program}")
    ours, _ = _finish(ours_p, f"RAPS {program}")
    _same(name, ours, theirs)
    for i, (how, p) in enumerate(crashed.items()):
        rank = how.split()[1].split(":")[0]
        out, err = _finish(p, f"RAPS {program} {how}")
        assert f"rank {rank} exited with 17; relaunching it with epoch 2" in err, err[-2000:]
        assert out == ours, f"{name} with rank {rank} lost: {out!r} != {ours!r}"
        # the relaunched rank said when it ran again, and when it had re-sent what it sent
        # before its loss: the end of its recovery (a plan's "done" on a cluster)
        events = [json.loads(x) for x in
                  (tmp_path / f"crash{i}" / "recovery-events.log").read_text().splitlines()]
        assert [(e["rank"], e["epoch"], e["phase"]) for e in events] == [
            (int(rank), 2, "running"), (int(rank), 2, "caught_up")], events


def test_every_program_of_the_support_list_is_run() -> None:
    assert BATCHED and all(p.startswith("examples/mpi4py/") for p in BATCHED), BATCHED


def test_the_call_family_programs_print_what_open_mpi_prints_and_survive_a_lost_rank(
        mpirun: list[str], tmp_path: Path) -> None:
    # All at once: their start-up is most of their time.
    runs = {p: (_start([*mpirun, str(REPO / p)], tmp_path), _raps(p, [], tmp_path),
                _raps(p, ["--die", "1:1"], tmp_path, "--restarts", "1"))
            for p in BATCHED}
    for p, (theirs_p, ours_p, lost_p) in runs.items():
        theirs, _ = _finish(theirs_p, f"mpirun {p}")
        ours, _ = _finish(ours_p, f"RAPS {p}")
        lost, err = _finish(lost_p, f"RAPS {p} --die 1:1")
        _same(p, ours, theirs)
        assert "rank 1 exited with 17; relaunching it with epoch 2" in err, err[-2000:]
        assert lost == ours, f"{p} with rank 1 lost: {lost!r} != {ours!r}"


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("program", ["examples/mpi_reduce.py",
                                     "tests/data/mpi/allreduce_sizes.py"])
def test_reductions_on_power_of_two_sizes_print_what_open_mpi_prints(
        ranks: int, program: str, mpirun: list[str], tmp_path: Path) -> None:
    # Allreduce of buffers takes recursive halving and doubling on these sizes.
    theirs_p = _start([*_mpirun(ranks), SYSTEM_PYTHON, str(REPO / program)], tmp_path)
    ours_argv = [*_local(ranks), "--", sys.executable, str(REPO / program)]
    ours_p = _start(ours_argv, tmp_path)
    again_p = _start(ours_argv, tmp_path)
    theirs, _ = _finish(theirs_p, f"mpirun -n {ranks} {program}")
    ours, _ = _finish(ours_p, f"RAPS -n {ranks} {program}")
    again, _ = _finish(again_p, f"RAPS -n {ranks} {program} again")
    _same(program, ours, theirs)
    assert again == ours  # the same bits run after run: a replay computes the same


def test_a_rank_lost_amid_halving_allreduces_replays_to_the_same_bits(tmp_path: Path) -> None:
    prog = [sys.executable, str(REPO / "tests/data/mpi/allreduce_sizes.py")]
    clean = _start([*_local(4), "--", *prog], tmp_path)
    lost = _start([*_local(4), "--restarts", "1", "--dir", str(tmp_path / "lost"), "--",
                   *prog, "--die", "1:5"], tmp_path)
    want, _ = _finish(clean, "RAPS -n 4 allreduce_sizes")
    got, err = _finish(lost, "RAPS -n 4 allreduce_sizes --die 1:5")
    assert "rank 1 exited with 17; relaunching it with epoch 2" in err, err[-2000:]
    assert got == want and want.count("\n") == 7


def test_a_relaunched_rank_sends_its_sets_of_strings_in_the_same_order(tmp_path: Path
                                                                        ) -> None:
    prog = [sys.executable, str(REPO / "tests/data/mpi/sets.py")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    p = subprocess.run([*_local(2), "--restarts", "1", "--", *prog, "--die", "3"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=90, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rank 1 exited with 17; relaunching it with epoch 2" in p.stderr
    assert p.stdout.splitlines() == [f"{s} 33 step{s}" for s in range(6)]


def test_the_launcher_keeps_a_hash_seed_the_user_set() -> None:
    from raps_slurm.core.launch import hash_seed

    assert hash_seed({"PYTHONHASHSEED": "random"}, "7") == {}
    seeds = {job: hash_seed({}, job)["PYTHONHASHSEED"] for job in ("7", "8", "local")}
    assert len(set(seeds.values())) == 3
    assert all(0 <= int(v) <= 4294967295 for v in seeds.values())
    assert hash_seed({}, "7") == {"PYTHONHASHSEED": seeds["7"]}  # every incarnation


def test_abort_ends_the_job_under_both(mpirun: list[str], tmp_path: Path) -> None:
    calls = str(REPO / "tests/data/mpi/calls.py")
    theirs = _start([*mpirun, calls, "abort"], tmp_path)
    # --restarts: a rank that called Abort is not relaunched, the others are stopped.
    ours = _start([*LOCAL, "--restarts", "2", "--", sys.executable, calls, "abort"], tmp_path)
    _, their_err = theirs.communicate(timeout=60)
    _, our_err = ours.communicate(timeout=60)
    assert theirs.returncode == 3, their_err[-2000:]
    assert ours.returncode == 3, our_err[-2000:]
    assert "rank 1 called MPI.Abort (exit code 3); stopping ranks [0, 2]" in our_err
    assert "relaunching" not in our_err


def test_a_program_that_cannot_start_ends_the_launch_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-program"
    p = subprocess.run([*_local(2), "--", str(missing)], capture_output=True, text=True,
                       timeout=60, check=False)
    assert p.returncode == 127, p.stderr
    assert p.stderr.splitlines() == [
        f"raps-local: rank 0 could not start: [Errno 2] No such file or directory: "
        f"'{missing}'", "raps-local: rank 0 failed with exit code 127"], p.stderr


def test_a_rank_that_cannot_be_relaunched_stops_the_others(tmp_path: Path) -> None:
    # Once rank 1 runs, rank 0 removes their program and fails: its relaunch cannot
    # start, and rank 1, which would sleep for a minute, is stopped.
    prog = tmp_path / "prog.sh"
    prog.write_text('#!/bin/sh\nup="$RAPS_LOCAL_DIR/up"\nif [ "$RAPS_RANK" = 0 ]; then\n'
                    '  while [ ! -e "$up" ]; do sleep 0.05; done; rm -f "$0"; exit 3\nfi\n'
                    'touch "$up"; exec sleep 60\n')
    prog.chmod(0o755)
    p = subprocess.run([*_local(2), "--restarts", "1", "--", str(prog)], capture_output=True,
                       text=True, timeout=40, check=False)
    assert p.returncode == 127, p.stderr
    lines = p.stderr.splitlines()
    assert lines[:3] == ["raps-local: rank 0 exited with 3; relaunching it with epoch 2",
                         f"raps-local: rank 0 could not start: [Errno 2] No such file or "
                         f"directory: '{prog}'",
                         "raps-local: rank 0 failed (exit code 127); stopping ranks [1]"], lines
    assert "Traceback" not in p.stderr


def test_the_local_launchers_labels_are_as_wide_as_sruns(tmp_path: Path) -> None:
    p = subprocess.run([*_local(11), "-l", "--", "sh", "-c", 'printf "hi $RAPS_RANK"'],
                       capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.splitlines(keepends=True)) == sorted(
        f"{r:>2}: hi {r}\n" for r in range(11))
