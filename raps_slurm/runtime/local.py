"""``python -m raps_slurm.runtime.local -n N [--restarts K] [--mpi4py] [-l] [--unlogged]
[--bind-to core|none] -- PROGRAM ARGS``: N ranks here.

A launcher for trying an application without Slurm or agents: it starts PROGRAM N times
with ``RAPS_LOCAL_DIR`` (peers, logs and checkpoints in one directory),
``RAPS_RANK``, ``RAPS_SIZE`` and ``RAPS_EPOCH``; ``runtime.init()`` in the program picks
them up. A rank that dies (non-zero exit or a signal) is started again with the next
epoch, up to ``--restarts`` times in all: it restores its last checkpoint and its peers
replay what it missed, as on a cluster. A rank that fails for good (no restart left,
or it called ``MPI.Abort``, which leaves :data:`ABORT_FILE` in the directory) ends the
job, as ``mpirun`` does: the other ranks are stopped rather than left waiting for it.
So does a rank that escalates asking for a whole-job requeue (e.g. a logged body that
fails its checksum cannot be replayed): this launcher requeues nothing, and the ranks
waiting for what cannot come would wait for ever. An escalation recorded without that
request (a sender that could not serve a resend, which a later request may supersede)
ends nothing.
``--mpi4py`` makes ``from mpi4py import MPI`` in PROGRAM resolve to
:mod:`raps_slurm.mpi` (docs/mpi.md). ``--unlogged`` runs the ranks without message
logging (``RAPS_LOCAL_UNLOGGED=1``): the baseline ``rapsctl bench mpi`` compares the logged
path with; a rank lost then cannot be recovered. The ranks' output comes out in whole lines, as
under raps-run (launcher/output.py); with ``-l``/``--label`` each starts with its
rank. The exit code is 0 when every rank ended with 0, else the first failing rank's;
a rank whose program cannot be started (not found, not executable) counts as exiting
with :data:`CANNOT_START`, and the other ranks are stopped.

Binding, as ``mpirun``'s default: with ``--bind-to core`` (the default) and no more ranks
than CPUs this process may use, rank r runs on the r-th of them (a relaunched rank on the
same one); with more ranks, or ``--bind-to none``, the kernel places them. Unbound, two
ranks that wait for each other's messages were moved onto one core now and then, and a
ping-pong's bandwidth varied twofold between launches (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from raps_slurm.core.launch import hash_seed, heap_tunables
from raps_slurm.launcher.output import Lines
from raps_slurm.launcher.output import label as tag
from raps_slurm.launcher.output import say as output_say

ABORT_FILE = "abort"  # written by MPI.Abort (raps_slurm.mpi): "RANK CODE"
ESCALATIONS = "escalations"  # LocalPort.escalate writes RANK.log there: one reason a line
NO_REQUEUE = " (no requeue asked)"  # ends a line recorded without asking for a requeue
STOP_GRACE = 5.0      # seconds the other ranks get to exit on SIGTERM before SIGKILL
DRAIN_SEC = 5.0       # at the end, how long the ranks' last output may take to come
CANNOT_START = 127    # a rank's exit code when its program cannot be started, as a shell's
BIND = ("core", "none")  # --bind-to


def main(argv: list[str] | None = None) -> int:
    """Run the launcher."""
    p = argparse.ArgumentParser(prog="python -m raps_slurm.runtime.local",
                                description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("-n", "--ranks", type=int, required=True, help="number of ranks (1-256)")
    p.add_argument("--restarts", type=int, default=0,
                   help="how many rank failures to recover from by relaunching (default 0)")
    p.add_argument("--dir", default=None, help="state directory (default: a new temp dir, "
                                               "removed at the end)")
    p.add_argument("--mpi4py", action="store_true",
                   help="run an mpi4py program unchanged: mpi4py resolves to raps_slurm.mpi")
    p.add_argument("--unlogged", action="store_true",
                   help="no message logging (a benchmark's baseline: no recovery possible)")
    p.add_argument("-l", "--label", action="store_true",
                   help="start each line of a rank's output with its rank (\"3: \")")
    p.add_argument("--bind-to", choices=BIND, default="core",
                   help="core (default): rank r on the r-th usable CPU when there are no "
                        "more ranks than CPUs, as mpirun; none: the kernel places them")
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS")
    a = p.parse_args(argv)
    prog = a.program[1:] if a.program[:1] == ["--"] else a.program
    if not prog:
        p.error("expected -- PROGRAM ARGS")
    if not 1 <= a.ranks <= 256:
        p.error(f"--ranks {a.ranks}: expected 1-256")
    root = a.dir or tempfile.mkdtemp(prefix="raps-local-")
    try:
        if a.unlogged and a.restarts:
            p.error("--unlogged: a rank run without its message log cannot be recovered; "
                    "leave out --restarts")
        return run(prog, a.ranks, a.restarts, root, mpi4py=a.mpi4py, label=a.label,
                   unlogged=a.unlogged, bind=a.bind_to)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def cores(n: int, bind: str = "core") -> list[int] | None:
    """The CPU of each of ``n`` ranks under ``--bind-to bind``; None: not bound (``none``,
    or more ranks than CPUs this process may use, as ``mpirun`` then)."""
    if bind not in BIND:
        raise ValueError(f"bind {bind!r}: expected one of {', '.join(BIND)}")
    usable = sorted(os.sched_getaffinity(0))
    if bind == "none" or n > len(usable):
        return None
    return usable[:n]


def run(prog: list[str], n: int, restarts: int, root: str, *, mpi4py: bool = False,
        label: bool = False, unlogged: bool = False, bind: str = "core") -> int:
    """Start, watch and relaunch the ranks; the exit code (``label``: each line of a
    rank's output starts with its rank; ``unlogged``: no message logging; ``bind``:
    :func:`cores`)."""
    epochs = dict.fromkeys(range(n), 1)
    base = dict(os.environ)
    base.pop("RAPS_LOCAL_UNLOGGED", None)
    if unlogged:
        base["RAPS_LOCAL_UNLOGGED"] = "1"
    base.update(hash_seed(base, "local"))  # the same str hashes in a relaunched rank
    base.update(heap_tunables(base))
    if mpi4py:
        from raps_slurm.mpi import shim_env

        base = shim_env(base)

    output = Lines()
    cpus = cores(n, bind)

    def start(rank: int) -> subprocess.Popen[bytes]:
        env = {**base, "RAPS_LOCAL_DIR": root, "RAPS_RANK": str(rank),
               "RAPS_SIZE": str(n), "RAPS_EPOCH": str(epochs[rank]),
               "RAPS_LOCAL_SIZE": str(n)}
        if cpus is None:
            return output.start(prog, tag(rank, n) if label else b"", env=env)
        # A child inherits the mask of the thread that forks it: set on this thread for
        # the fork, so the rank is bound before it runs anything.
        mine = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpus[rank]})
        try:
            return output.start(prog, tag(rank, n) if label else b"", env=env)
        finally:
            os.sched_setaffinity(0, mine)

    # A previous run's escalations in a reused --dir are not this run's
    shutil.rmtree(os.path.join(root, ESCALATIONS), ignore_errors=True)
    try:
        codes = _watch(start, n, restarts, root, epochs, output)
    finally:
        output.close(DRAIN_SEC)  # the ranks' last lines come before the verdict
    bad = [(r, c) for r, c in sorted(codes.items()) if c != 0]
    for r, c in bad:
        _say(f"rank {r} failed with exit code {c}")
    return bad[0][1] if bad and bad[0][1] > 0 else (1 if bad else 0)


def _say(text: str, output: Lines | None = None) -> None:
    """One line on stderr, in one write; through ``output``, the ranks' forwarder, while
    there is one (their lines go there too)."""
    output_say(f"raps-local: {text}\n", output)


def _watch(start: Callable[[int], subprocess.Popen[bytes]], n: int, restarts: int,
           root: str, epochs: dict[int, int], output: Lines) -> dict[int, int]:
    """Watch the ranks ``start`` starts, relaunch those that fail; each rank's exit
    code (what it says goes through ``output``)."""
    procs: dict[int, subprocess.Popen[bytes]] = {}
    codes: dict[int, int] = {}

    def launch(rank: int) -> bool:
        try:
            procs[rank] = start(rank)
        except OSError as exc:  # no such program, not executable: one line, as srun's
            _say(f"rank {rank} could not start: {exc}", output)
            codes[rank] = CANNOT_START
            return False
        return True

    for rank in range(n):
        if not launch(rank):
            if procs:
                _say(f"stopping ranks {sorted(procs)}", output)
                _stop(procs)
            return codes
    left = restarts
    aborted = os.path.join(root, ABORT_FILE)
    while procs:
        escalated = _escalation(os.path.join(root, ESCALATIONS))
        if escalated is not None:
            rank, reason = escalated
            _say(f"rank {rank} escalated ({reason}): a whole-job requeue, which this launcher "
                 f"does not do; stopping ranks {sorted(procs)}", output)
            _stop(procs)
            codes.update({r: p.returncode for r, p in procs.items()})
            codes[rank] = 1
            procs.clear()
            break
        for rank, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del procs[rank]
            if code != 0 and left > 0 and not os.path.exists(aborted):
                left -= 1
                epochs[rank] += 1
                _say(f"rank {rank} exited with {code}; relaunching it with epoch "
                     f"{epochs[rank]}", output)
                if launch(rank):
                    continue
            else:
                codes[rank] = code
            code = codes[rank]
            if code != 0 and procs:
                why = "called MPI.Abort" if os.path.exists(aborted) else "failed"
                _say(f"rank {rank} {why} (exit code {code}); stopping ranks {sorted(procs)}",
                     output)
                _stop(procs)
                procs.clear()
                break
        time.sleep(0.02)
    return codes


def _escalation(directory: str) -> tuple[int, str] | None:
    """The first escalation asking for a requeue that a rank wrote under ``directory``:
    (rank, its reason)."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return None
    for name in names:
        rank, _, ext = name.partition(".")
        if ext == "log" and rank.isdigit():
            with open(os.path.join(directory, name), errors="replace") as f:
                for line in f:
                    # a line not ended is being written: the next look reads it whole
                    if line.endswith("\n") and not line.endswith(NO_REQUEUE + "\n"):
                        return int(rank), line.strip()
    return None


def _stop(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    """SIGTERM the ranks, SIGKILL those still running after :data:`STOP_GRACE`."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE
    for proc in procs.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
