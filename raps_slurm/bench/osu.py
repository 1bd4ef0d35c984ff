"""``rapsctl bench osu``: latency and bandwidth of RAPS against Open MPI over message
sizes, in the manner of the OSU micro-benchmarks' ``osu_latency``.

The ping-pong of :mod:`raps_slurm.bench.mpi_prog` (unchanged mpi4py code) runs for each
size of :data:`SIZES` between two ranks on this machine, four ways, one after the other
in each of ``--repeats`` rounds: RAPS over loopback TCP (``messagelog.same_node: tcp``)
and Open MPI's TCP transport (``--mca btl tcp,self``); RAPS's default path between ranks
of one host (a Unix socket) and Open MPI's default transports (shared memory). For each
size: half the round trip (``lat_us``), the bandwidth it gives (``MBps``: both
directions counted, as in ``rapsctl bench mpi``), and RAPS's ratios to Open MPI, each the
median of the rounds.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from raps_slurm.bench import mpi

SIZES = (8, 64, 512, 4096, 32 << 10, 256 << 10, 1 << 20, 4 << 20)
PAIRS = {"tcp": ("raps_tcp", "openmpi_tcp"), "host": ("raps_host", "openmpi_host")}


def half_trips(result: dict[str, Any]) -> dict[int, float]:
    """One launch's half round trips (microseconds) per size."""
    return {int(size): r["seconds"][0] / r["round_trips"] / 2 * 1e6
            for size, r in result.items()}


def table(runs: dict[str, list[dict[int, float]]], sizes: tuple[int, ...]
          ) -> dict[str, list[dict[str, float]]]:
    """Per pair of :data:`PAIRS`, one row per size: medians of the rounds and ratios
    (latency: RAPS over Open MPI; bandwidth: RAPS over Open MPI)."""
    out: dict[str, list[dict[str, float]]] = {}
    for pair, (mine, theirs) in PAIRS.items():
        rows = []
        for size in sizes:
            a = statistics.median(r[size] for r in runs[mine])
            b = statistics.median(r[size] for r in runs[theirs])
            rows.append({"bytes": size, "raps_lat_us": round(a, 2),
                         "openmpi_lat_us": round(b, 2), "lat_ratio": round(a / b, 3),
                         "raps_MBps": round(2 * size / a, 3),
                         "openmpi_MBps": round(2 * size / b, 3),
                         "bw_ratio": round(b / a, 3)})
        out[pair] = rows
    return out


def run_osu(iterations: int, repeats: int, warmup: int, sizes: tuple[int, ...] = SIZES,
            say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The benchmark; its JSON object."""
    load = os.getloadavg()
    version = mpi.check_openmpi()
    started = time.monotonic()
    extra = ("--sizes", ",".join(map(str, sizes)))
    runs: dict[str, list[dict[int, float]]] = {k: [] for p in PAIRS.values() for k in p}
    with mpi.tcp_config() as tcp:
        plan: list[tuple[str, list[str], str | None]] = [
            ("raps_tcp", mpi.raps_argv(2), tcp), ("openmpi_tcp", mpi.openmpi_argv(2), None),
            ("raps_host", mpi.raps_argv(2), None),
            ("openmpi_host", mpi.openmpi_default_argv(2), None)]
        for i in range(repeats):
            for who, argv, conf in plan:
                say(f"round {i + 1}/{repeats}: {who}")
                runs[who].append(half_trips(mpi.launch(who, argv, "pingpong", iterations,
                                                       warmup, conf, extra)))
    return {"benchmark": "osu", "iterations": iterations, "warmup": warmup,
            "repeats": repeats, "latency_factor": mpi.LATENCY_FACTOR,
            "small_below_bytes": 64 << 10, **table(runs, sizes), "openmpi": version,
            "cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in load],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "wall_s": round(time.monotonic() - started, 1)}
