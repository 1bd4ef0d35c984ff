"""``rapsctl bench mpi``: the figures and goals it assembles, a tiny real run of the same
program under RAPS and Open MPI, and its one-line answer when Open MPI is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from raps_slurm.bench import mpi, osu

KEYS = ["lat_8B_raps_us", "lat_8B_openmpi_us", "lat_8B_ratio", "bw_1MiB_raps_MBps",
        "bw_1MiB_openmpi_MBps", "bw_1MiB_ratio", "bw_8MiB_raps_MBps", "bw_8MiB_openmpi_MBps",
        "bw_8MiB_ratio", "allreduce_8MiB_raps_s", "allreduce_8MiB_openmpi_s",
        "allreduce_8MiB_ratio", "lat_8B_python_tcp_us", "lat_8B_python_tcp_ratio",
        "bw_1MiB_python_tcp_MBps", "bw_1MiB_python_tcp_ratio", "bw_8MiB_python_tcp_MBps",
        "bw_8MiB_python_tcp_ratio", "lat_8B_thread_python_tcp_us",
        "lat_8B_thread_python_tcp_ratio", "bw_1MiB_python_tcp_logged_MBps",
        "bw_1MiB_python_tcp_logged_ratio", "bw_8MiB_python_tcp_logged_MBps",
        "bw_8MiB_python_tcp_logged_ratio", "bw_4KiB_raps_MBps", "bw_4KiB_raps_unlogged_MBps",
        "bw_8MiB_raps_unlogged_MBps", "logged_vs_unlogged_4KiB", "logged_vs_unlogged_8MiB",
        "same_node_bw_1MiB_raps_MBps", "same_node_bw_1MiB_openmpi_MBps",
        "same_node_bw_1MiB_ratio"]


def _launch(lat_s: float, bw_s: float, ar_s: float) -> dict[str, float]:
    pp = {"8": {"round_trips": 100, "seconds": [lat_s]},
          "4096": {"round_trips": 100, "seconds": [lat_s * 4]},
          str(1 << 20): {"round_trips": 4, "seconds": [bw_s]},
          str(8 << 20): {"round_trips": 4, "seconds": [8 * bw_s]}}
    return mpi.figures(pp, {str(8 << 20): {"ranks": 4, "calls": 2, "seconds": [2 * ar_s]}})


def test_a_launch_counts_its_fastest_block() -> None:
    pp = {"8": {"round_trips": 100, "seconds": [0.009, 0.004, 0.005]},
          "4096": {"round_trips": 100, "seconds": [0.02, 0.016]},
          str(1 << 20): {"round_trips": 4, "seconds": [0.05, 0.02, 0.03]},
          str(8 << 20): {"round_trips": 4, "seconds": [0.16, 0.4]}}
    out = mpi.figures(pp, {str(8 << 20): {"ranks": 4, "calls": 2, "seconds": [0.9, 0.6]}})
    assert out == mpi.figures(
        {"8": {"round_trips": 100, "seconds": [0.004]},
         "4096": {"round_trips": 100, "seconds": [0.016]},
         str(1 << 20): {"round_trips": 4, "seconds": [0.02]},
         str(8 << 20): {"round_trips": 4, "seconds": [0.16]}},
        {str(8 << 20): {"ranks": 4, "calls": 2, "seconds": [0.6]}})
    assert out["lat_8B"] == 20.0 and out["allreduce_8MiB"] == 0.3


def test_medians_ratios_and_goals() -> None:
    # raps: 4x the latency, half the bandwidth, a third of the allreduce throughput
    raps = [_launch(0.004, 0.02, 0.3), _launch(0.004, 0.02, 0.3), _launch(1.0, 1.0, 9.0)]
    ompi = [_launch(0.001, 0.01, 0.1), _launch(0.001, 0.01, 0.1), _launch(0.001, 0.01, 0.1)]
    out = mpi.assemble(raps, ompi)
    assert out["lat_8B_raps_us"] == 20.0 and out["lat_8B_openmpi_us"] == 5.0  # half a trip
    assert out["bw_1MiB_openmpi_MBps"] == round(2 * 4 * (1 << 20) / 0.01 / 1e6, 1)
    assert out["lat_8B_ratio"] == 4.0 and out["bw_1MiB_ratio"] == 0.5  # the outlier ignored
    assert out["bw_8MiB_ratio"] == 0.5 and out["allreduce_8MiB_ratio"] == 0.333
    assert out["allreduce_8MiB_raps_s"] == 0.3
    # goals: latency at most 3x, bandwidth at least 0.7, allreduce at least 0.6
    assert out["goals_met"] == {"lat_8B": False, "bw_1MiB": False, "bw_8MiB": False,
                                "allreduce_8MiB": False}
    faster = [_launch(0.0025, 0.013, 0.15)] * 3  # 2.5x, 0.77, 0.67: every goal met
    assert all(mpi.assemble(faster, ompi)["goals_met"].values())


def test_logged_against_unlogged_and_one_node_against_open_mpis_default() -> None:
    raps = [_launch(0.004, 0.02, 0.3)] * 3
    unlogged = [_launch(0.0038, 0.0185, 0.3)] * 3  # 4 KiB: 0.95 of it; 8 MiB: 0.925
    shm = [_launch(0.001, 0.005, 0.1)] * 3  # Open MPI's shared memory
    unix = [_launch(0.004, 0.0125, 0.3)] * 3  # RAPS on one host: 0.4 of it at 1 MiB
    out, met = mpi.side_figures(raps, unlogged, shm, unix)
    assert out["logged_vs_unlogged_4KiB"] == 0.95 and out["logged_vs_unlogged_8MiB"] == 0.925
    assert out["same_node_bw_1MiB_ratio"] == 0.4  # from the same-host runs, not TCP's
    assert out["same_node_bw_1MiB_openmpi_MBps"] == round(2 * 4 * (1 << 20) / 0.005 / 1e6, 1)
    assert met == {"logged_vs_unlogged_4KiB": True, "logged_vs_unlogged_8MiB": False,
                   "same_node_bw_1MiB": False}


def test_python_tcp_floor_ratios_against_openmpi() -> None:
    tcp = [{"lat_8B": 30.0, "lat_8B_thread": 60.0, "bw_1MiB": 3000.0, "bw_8MiB": 2000.0},
           {"lat_8B": 50.0, "lat_8B_thread": 80.0, "bw_1MiB": 1000.0, "bw_8MiB": 1000.0},
           {"lat_8B": 40.0, "lat_8B_thread": 90.0, "bw_1MiB": 2000.0, "bw_8MiB": 9000.0}]
    for r, logged in zip(tcp, (1.0, 3.0, 2.0), strict=True):  # logged: slower, own medians
        r |= {"bw_1MiB_logged": 100 * logged, "bw_8MiB_logged": 400 * logged}
    ompi = [{"lat_8B": 4.0, "bw_1MiB": 4000.0, "bw_8MiB": 4000.0}] * 3
    out = mpi.floor_figures(tcp, ompi)
    assert out == {"lat_8B_python_tcp_us": 40.0, "lat_8B_python_tcp_ratio": 10.0,
                   "lat_8B_thread_python_tcp_us": 80.0, "lat_8B_thread_python_tcp_ratio": 20.0,
                   "bw_1MiB_python_tcp_MBps": 2000.0, "bw_1MiB_python_tcp_ratio": 0.5,
                   "bw_1MiB_python_tcp_logged_MBps": 200.0,
                   "bw_1MiB_python_tcp_logged_ratio": 0.05,
                   "bw_8MiB_python_tcp_MBps": 2000.0, "bw_8MiB_python_tcp_ratio": 0.5,
                   "bw_8MiB_python_tcp_logged_MBps": 800.0,
                   "bw_8MiB_python_tcp_logged_ratio": 0.2}


def test_the_tcp_floor_times_real_round_trips() -> None:
    from raps_slurm.bench import tcp_floor

    secs = tcp_floor.pingpong(1 << 20, 3, 1)
    assert 0 < secs < 30
    assert 0 < tcp_floor.pingpong(3 << 20, 2, 1, logged=True) < 30  # pieces and a tag
    out = tcp_floor.figures(1, 0, 2, {"bw_1MiB": 1 << 20})
    assert set(out) == {"lat_8B", "lat_8B_thread", "bw_1MiB", "bw_1MiB_logged"}
    assert all(v > 0 for v in out.values())


def test_the_logged_floor_checks_every_tag_and_keeps_every_message() -> None:
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from raps_slurm.bench import tcp_floor
    from raps_slurm.wire.framing import FrameError

    a, b = socket.socketpair()
    with a, b, ThreadPoolExecutor(1) as pool:
        key = os.urandom(32)
        sender, receiver = tcp_floor._Logged(a, key, b"s"), tcp_floor._Logged(b, key, b"e")
        msg = memoryview(bytearray(os.urandom(3 << 20)))  # pieces, the tag with the last
        got = memoryview(bytearray(len(msg)))
        reading = pool.submit(receiver.receive, got)
        sender.send(msg)
        reading.result(30)
        assert got == msg and len(sender.log) == 1 and bytes(sender.log[0]) == bytes(msg)
        msg[0] ^= 1  # the log keeps what was sent, not the buffer's later bytes
        assert bytes(sender.log[0]) != bytes(msg)
        reading = pool.submit(receiver.receive, got)
        tcp_floor._Logged(a, os.urandom(32), b"s").send(msg)  # another key
        with pytest.raises(FrameError, match="bad MAC"):
            reading.result(30)


def test_a_tiny_run_measures_both() -> None:
    # scripts/test.sh installs Open MPI and python3-mpi4py: no skip where CI runs
    assert shutil.which("mpirun"), "mpirun is missing: run scripts/test.sh"
    # One warm-up round: a rank's first large message populates its log's arena (up to
    # a second on a fresh virtual machine, whose memory the host backs at first touch);
    # timed, it made one 1 MiB round trip's ratio round to 0.000.
    out = mpi.run_mpi(iterations=1, repeats=1, warmup=1, blocks=2)
    assert out["benchmark"] == "mpi" and out["blocks"] == 2
    for key in KEYS:
        assert out[key] > 0, (key, out)
    assert set(out["goals_met"]) == set(mpi.GOALS)
    assert out["openmpi"].startswith("mpirun") and len(out["loadavg"]) == 3
    if (os.cpu_count() or 1) < mpi.ALLREDUCE_RANKS:  # more ranks than cores: no spinning
        assert out["spin_us_allreduce"] == 0, out


def test_without_mpirun_one_line_and_exit_1() -> None:
    # Only this interpreter's directory on PATH: no mpirun there.
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    p = subprocess.run([sys.executable, "-m", "raps_slurm.cli", "bench", "mpi", "--json"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "rapsctl: mpirun not found: install Open MPI (Debian: openmpi-bin)"], p.stderr


def test_osu_rows_per_size_and_pair() -> None:
    launch = {"8": {"round_trips": 100, "seconds": [0.002]},  # 10 us half round trip
              "4096": {"round_trips": 10, "seconds": [0.004]}}  # 200 us
    assert osu.half_trips(launch) == {8: 10.0, 4096: 200.0}
    fast = {8: 2.0, 4096: 20.0}
    runs = {"raps_tcp": [osu.half_trips(launch)] * 3, "openmpi_tcp": [fast] * 3,
            "raps_host": [{8: 4.0, 4096: 40.0}], "openmpi_host": [fast]}
    out = osu.table(runs, (8, 4096))
    assert out["tcp"][1] == {"bytes": 4096, "raps_lat_us": 200.0, "openmpi_lat_us": 20.0,
                             "lat_ratio": 10.0, "raps_MBps": 40.96,
                             "openmpi_MBps": 409.6, "bw_ratio": 0.1}
    assert [r["lat_ratio"] for r in out["host"]] == [2.0, 2.0]


def test_a_tiny_osu_run_measures_every_size_four_ways() -> None:
    out = osu.run_osu(iterations=1, repeats=1, warmup=0, sizes=(8, 1 << 20))
    assert out["benchmark"] == "osu"
    for pair in ("tcp", "host"):
        assert [r["bytes"] for r in out[pair]] == [8, 1 << 20]
        assert all(r["raps_lat_us"] > 0 and r["openmpi_lat_us"] > 0 for r in out[pair])
