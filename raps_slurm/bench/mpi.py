"""``rapsctl bench mpi``: the same mpi4py program under RAPS and under Open MPI over TCP.

:mod:`raps_slurm.bench.mpi_prog` (nothing but ``from mpi4py import MPI`` and numpy) runs
on this machine with the local launcher's ``--mpi4py`` (the logged runtime) and with
``mpirun --mca btl tcp,self`` (Debian's Open MPI and python3-mpi4py): a ping-pong of 8
bytes, 4 KiB, 1 MiB and 8 MiB between 2 ranks, and an 8 MiB float64 ``Allreduce`` on 4
ranks. RAPS runs these over loopback TCP too (``messagelog.same_node: tcp``, through a
config file of that one key): TCP against TCP. Each round also runs the ping-pong under
RAPS without logging (the local launcher's ``--unlogged``, TCP as well:
``logged_vs_unlogged_*``, what logging itself costs), and RAPS with its default path
between ranks of one host (a Unix socket) against Open MPI with its default transports
(shared memory: ``same_node_*``). Each of
``--repeats`` rounds launches them one after the other (load that comes and goes
touches all alike); a launch runs untimed warm-up iterations first, then ``--blocks``
timed blocks of each measure, and keeps its fastest block (a block of 8 round trips of
1 MiB lasts milliseconds: one descheduling on a shared machine halved it). Every figure
is the median of the rounds. Each launch starts with an empty message log and
the default config; with no checkpoint to collect it, the log keeps every message: some
400 MiB a rank by the end of the ping-pong at the defaults, 336 MiB of them in the 8
MiB measure. Its first block stays below three quarters of the high watermark
(``messagelog.buffer_high_watermark_mb``, 192 MiB); the later ones spill to disk, as a
job that sends more than that between two checkpoints does. The fastest block counts,
so the 8 MiB figures are those of a log in memory.

Each round also runs the same ping-pong over plain TCP between two processes of this
interpreter (:mod:`raps_slurm.bench.tcp_floor`): Python's own floor, reported as
``*_python_tcp_*`` with its ratio to Open MPI; ``lat_8B_thread_python_tcp_us`` is the
same latency when a reader thread hands each message over (what RAPS's runtime avoids
by reading on the waiting thread: runtime/pump.py). ``datapath`` says whether RAPS's
large logged messages took the compiled path (wire/_datapath.c) or its fallback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from raps_slurm.bench import tcp_floor
from raps_slurm.errors import BenchError
from raps_slurm.wire import datapath

PROG = Path(__file__).with_name("mpi_prog.py")
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's python3-mpi4py is built for it
ALLREDUCE_RANKS = 4
LATENCY_FACTOR = 100  # 8-byte round trips are cheap: a hundred times the iterations
BLOCKS = 5  # timed blocks per launch (--blocks); the fastest counts
TIMEOUT = 300.0
MIB = 1 << 20
# measure -> (size in the program's result, the goal: ratio raps/openmpi at least / at most)
BANDWIDTH = {"bw_1MiB": MIB, "bw_8MiB": 8 * MIB}
SMALL_BANDWIDTH = {"bw_4KiB": 4096}
GOALS: dict[str, tuple[str, float]] = {"bw_1MiB": (">=", 0.7), "bw_8MiB": (">=", 0.7),
                                       "lat_8B": ("<=", 3.0), "allreduce_8MiB": (">=", 0.6),
                                       "same_node_bw_1MiB": (">=", 0.5),
                                       "logged_vs_unlogged_4KiB": (">=", 0.9),
                                       "logged_vs_unlogged_8MiB": (">=", 0.95)}


def openmpi_argv(ranks: int, python: str = SYSTEM_PYTHON, *, tcp: bool = True) -> list[str]:
    """``mpirun`` over TCP (shared memory off; ``tcp=False``: its default transports), as
    root if need be, cores oversubscribed."""
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    btl = ["--mca", "btl", "tcp,self"] if tcp else []
    return ["mpirun", *root, "--oversubscribe", *btl, "-n", str(ranks), python, str(PROG)]


def openmpi_default_argv(ranks: int) -> list[str]:
    """``mpirun`` with Open MPI's default transports (shared memory on one node)."""
    return openmpi_argv(ranks, tcp=False)


def raps_argv(ranks: int, *, unlogged: bool = False) -> list[str]:
    """The local launcher with ``--mpi4py``, ranks on this interpreter (``unlogged``: no
    message logging, the baseline)."""
    flags = ["--unlogged"] if unlogged else []
    return [sys.executable, "-m", "raps_slurm.runtime.local", "-n", str(ranks), "--mpi4py",
            *flags, "--", sys.executable, str(PROG)]


def raps_unlogged_argv(ranks: int) -> list[str]:
    """:func:`raps_argv` without message logging."""
    return raps_argv(ranks, unlogged=True)


def check_openmpi(python: str = SYSTEM_PYTHON) -> str:
    """Open MPI's version line; BenchError naming what is missing."""
    if shutil.which("mpirun") is None:
        raise BenchError("mpirun not found: install Open MPI (Debian: openmpi-bin)")
    probe = subprocess.run([python, "-c", "import mpi4py, numpy"], capture_output=True,
                           text=True, check=False) if os.path.exists(python) else None
    if probe is None or probe.returncode != 0:
        raise BenchError(f"{python} cannot import mpi4py and numpy: install python3-mpi4py "
                         "and python3-numpy")
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, check=False)
    return (out.stdout.strip().splitlines() or ["mpirun (version unknown)"])[0]


@contextlib.contextmanager
def session_tmpdir(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """``env`` with ``TMPDIR`` a fresh directory of its own (removed on exit), for one
    ``mpirun``: Open MPI 4.1 makes its session directory (``ompi.HOST.UID``) under it, and
    two mpiruns starting at once in the same one can both find it missing, the second
    then failing with "File exists" (orte_session_dir). Short, under the system's temporary
    directory: the session directory holds Unix sockets, whose paths are bounded."""
    with tempfile.TemporaryDirectory(prefix="ompi-") as tmp:
        yield {**env, "TMPDIR": tmp}


@contextlib.contextmanager
def tcp_config() -> Iterator[str]:
    """A config file of one key, ``messagelog.same_node: tcp``: RAPS over loopback TCP, as
    Open MPI's tcp BTL (removed on exit)."""
    with tempfile.TemporaryDirectory(prefix="raps-bench-mpi-") as tmp:
        path = os.path.join(tmp, "tcp.yaml")
        with open(path, "w") as f:
            f.write("messagelog:\n  same_node: tcp\n")
        yield path


def launch(who: str, argv: list[str], measure: str, iterations: int, warmup: int,
           config: str | None = None, extra: tuple[str, ...] = (), blocks: int = 1
           ) -> dict[str, Any]:
    """One run of the program (``config``: RAPS's config file, else the defaults) timing
    ``blocks`` blocks of each measure; its rank 0 result (BenchError if the run fails)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAPS_", "OMPI_", "PMIX_"))}
    if config is not None:
        env["RAPS_CONFIG"] = config
    cmd = [*argv, measure, "--iterations", str(iterations), "--warmup", str(warmup),
           "--repeats", str(blocks), "--latency-factor", str(LATENCY_FACTOR), *extra]
    try:
        with session_tmpdir(env) as env:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                               timeout=TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{who} {measure} run did not end in {TIMEOUT:.0f} s") from None
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        why = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"{who} {measure} run failed (exit code {p.returncode}): {why}")
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))["results"]
    return result


def figures(pingpong: dict[str, Any], allreduce: dict[str, Any]) -> dict[str, float]:
    """One launch's figures from its fastest block of each measure: half round-trip
    latency (us), ping-pong bandwidth (MB/s, both directions counted), seconds per
    allreduce."""
    lat = pingpong["8"]
    out = {"lat_8B": min(lat["seconds"]) / lat["round_trips"] / 2 * 1e6}
    for key, nbytes in {**SMALL_BANDWIDTH, **BANDWIDTH}.items():
        r = pingpong[str(nbytes)]
        out[key] = 2 * nbytes * r["round_trips"] / min(r["seconds"]) / 1e6
    if allreduce:
        (ar,) = allreduce.values()
        out["allreduce_8MiB"] = min(ar["seconds"]) / ar["calls"]
    return out


UNITS = {"lat_8B": "us", "bw_1MiB": "MBps", "bw_8MiB": "MBps", "allreduce_8MiB": "s"}


def _judge(key: str, ratio: float) -> bool:
    sense, goal = GOALS[key]
    return ratio >= goal if sense == ">=" else ratio <= goal


def side_figures(raps: list[dict[str, float]], unlogged: list[dict[str, float]],
                 default: list[dict[str, float]], same_node: list[dict[str, float]]
                 ) -> tuple[dict[str, Any], dict[str, bool]]:
    """Logged against unlogged RAPS (``logged_vs_unlogged_*``: bandwidth ratios) and RAPS
    on its same-host path (``same_node``) against Open MPI's default transports on one
    node (``same_node_*``); their goals."""
    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    out: dict[str, Any] = {}
    met: dict[str, bool] = {}
    for size, key in (("4KiB", "bw_4KiB"), ("8MiB", "bw_8MiB")):
        mine, base = med(raps, key), med(unlogged, key)
        out[f"{key}_raps_MBps"] = round(mine, 1)
        out[f"{key}_raps_unlogged_MBps"] = round(base, 1)
        name = f"logged_vs_unlogged_{size}"
        out[name] = round(mine / base, 3)
        met[name] = _judge(name, mine / base)
    mine, theirs = med(same_node, "bw_1MiB"), med(default, "bw_1MiB")
    out["same_node_bw_1MiB_raps_MBps"] = round(mine, 1)
    out["same_node_bw_1MiB_openmpi_MBps"] = round(theirs, 1)
    out["same_node_bw_1MiB_ratio"] = round(mine / theirs, 3)
    met["same_node_bw_1MiB"] = _judge("same_node_bw_1MiB", mine / theirs)
    return out, met


def assemble(raps: list[dict[str, float]], openmpi: list[dict[str, float]]
             ) -> dict[str, Any]:
    """Medians of the rounds, ratios raps/openmpi (for the allreduce, of throughputs:
    openmpi seconds over raps seconds) and whether each goal is met."""
    out: dict[str, Any] = {}
    goals: dict[str, bool] = {}
    for key, unit in UNITS.items():
        mine = statistics.median(r[key] for r in raps)
        theirs = statistics.median(r[key] for r in openmpi)
        ratio = theirs / mine if key.startswith("allreduce") else mine / theirs
        digits = 4 if unit == "s" else 1
        out[f"{key}_raps_{unit}"] = round(mine, digits)
        out[f"{key}_openmpi_{unit}"] = round(theirs, digits)
        out[f"{key}_ratio"] = round(ratio, 3)
        goals[key] = _judge(key, ratio)
    out["goals"] = {k: f"{s} {g}" for k, (s, g) in GOALS.items()}
    out["goals_met"] = goals
    return out


def floor_figures(runs: list[dict[str, float]], openmpi: list[dict[str, float]]
                  ) -> dict[str, Any]:
    """Medians of the plain-TCP rounds (:mod:`raps_slurm.bench.tcp_floor`) and their
    ratios to Open MPI: the best a Python rank that sleeps in the kernel could reach
    (``*_python_tcp_*``), and the bandwidth once each message gets the work a logged,
    authenticated one needs (``*_python_tcp_logged_*``)."""
    out: dict[str, Any] = {}
    # (the floor's key, Open MPI's key, the label)
    rows = [("lat_8B", "lat_8B", "lat_8B_python_tcp"),
            ("lat_8B_thread", "lat_8B", "lat_8B_thread_python_tcp")]
    for key in BANDWIDTH:
        rows += [(key, key, f"{key}_python_tcp"),
                 (f"{key}_logged", key, f"{key}_python_tcp_logged")]
    for name, base, label in rows:
        mine = statistics.median(r[name] for r in runs)
        theirs = statistics.median(r[base] for r in openmpi)
        out[f"{label}_{UNITS[base]}"] = round(mine, 1)
        out[f"{label}_ratio"] = round(mine / theirs, 3)
    return out


def spins() -> dict[str, int]:
    """How long RAPS's ranks poll before they sleep in each program (the config's
    ``messagelog.spin_us``, 0 where the ranks outnumber the cores)."""
    from raps_slurm.runtime import settings_from

    return {f"spin_us_{name}": settings_from({**os.environ, "RAPS_LOCAL_SIZE": str(n),
                                              "RAPS_LISTEN_ADDRESS": "127.0.0.1"}).spin_us
            for name, n in (("pingpong", 2), ("allreduce", ALLREDUCE_RANKS))}


def run_mpi(iterations: int, repeats: int, warmup: int,
            say: Callable[[str], None] = lambda _: None, blocks: int = BLOCKS
            ) -> dict[str, Any]:
    """The benchmark; its JSON object."""
    load = os.getloadavg()
    version = check_openmpi()
    started = time.monotonic()
    runs: dict[str, list[dict[str, float]]] = {
        "raps": [], "openmpi": [], "tcp": [], "raps_unlogged": [], "openmpi_default": [],
        "raps_same_node": []}
    with tcp_config() as tcp:
        main_runs: list[tuple[str, Callable[[int], list[str]], str | None]] = [
            ("raps", raps_argv, tcp), ("openmpi", openmpi_argv, None)]
        side_runs: list[tuple[str, Callable[[int], list[str]], str | None]] = [
            ("raps_unlogged", raps_unlogged_argv, tcp),
            ("openmpi_default", openmpi_default_argv, None),
            ("raps_same_node", raps_argv, None)]
        for i in range(repeats):
            for who, argv, conf in main_runs:
                say(f"round {i + 1}/{repeats}: {who}")
                pp = launch(who, argv(2), "pingpong", iterations, warmup, conf,
                            blocks=blocks)
                ar = launch(who, argv(ALLREDUCE_RANKS), "allreduce", iterations, warmup, conf,
                            blocks=blocks)
                runs[who].append(figures(pp, ar))
            for who, argv, conf in side_runs:
                say(f"round {i + 1}/{repeats}: {who}")
                runs[who].append(figures(
                    launch(who, argv(2), "pingpong", iterations, warmup, conf, blocks=blocks),
                    {}))
            say(f"round {i + 1}/{repeats}: python tcp")
            runs["tcp"].append(tcp_floor.figures(iterations, warmup, LATENCY_FACTOR,
                                                 BANDWIDTH))
    main = assemble(runs["raps"], runs["openmpi"])
    side, met = side_figures(runs["raps"], runs["raps_unlogged"], runs["openmpi_default"],
                             runs["raps_same_node"])
    main["goals_met"].update(met)
    return {"benchmark": "mpi", "iterations": iterations,
            "latency_round_trips": iterations * LATENCY_FACTOR, "warmup": warmup,
            "repeats": repeats, "blocks": blocks,
            "allreduce_ranks": ALLREDUCE_RANKS, **main, **side,
            **floor_figures(runs["tcp"], runs["openmpi"]),
            **spins(),
            # the logged path's large messages: compiled (wire/_datapath.c) or not
            "datapath": "compiled" if datapath.compiled() else "python",
            "openmpi": version, "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "loadavg": [round(x, 2) for x in load],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "wall_s": round(time.monotonic() - started, 1)}
