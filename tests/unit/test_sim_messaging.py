"""RAPS's messaging cost per message size: an application's messages per step at the
speed ratios bench mpi measures per size (job.msg_bytes, raps.msg_speed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.calibrate import apply, calibrate
from raps_slurm.sim.models import messaging_overhead, speed_at
from raps_slurm.sim.raps import log_share
from raps_slurm.sim.runner import run_one
from raps_slurm.sim.scenario import parse_scenario

ROOT = Path(__file__).resolve().parents[2]
SIZES, SPEEDS = (8.0, 1024.0, 65536.0), (0.1, 0.4, 0.8)


def test_speed_is_measured_at_the_sizes_and_log_linear_between() -> None:
    for size, speed in zip(SIZES, SPEEDS, strict=True):
        assert speed_at(size, SIZES, SPEEDS) == pytest.approx(speed)
    assert speed_at(1.0, SIZES, SPEEDS) == SPEEDS[0]          # below: the smallest's
    assert speed_at(1e9, SIZES, SPEEDS) == SPEEDS[-1]         # above: the largest's
    mid = math.sqrt(SIZES[0] * SIZES[1])                        # halfway in log size
    assert speed_at(mid, SIZES, SPEEDS) == pytest.approx((SPEEDS[0] + SPEEDS[1]) / 2)


def test_overhead_is_the_step_time_grown_by_each_size_at_its_speed() -> None:
    lat, gbps, step = 1e-5, 1.0, 0.5
    msgs, counts = (8.0, 65536.0), (100.0, 10.0)
    native = [k * (lat + b / 1e9) for b, k in zip(msgs, counts, strict=True)]
    raps = [t / speed_at(b, SIZES, SPEEDS) for t, b in zip(native, msgs, strict=True)]
    want = 1 - (step + sum(native)) / (step + sum(raps))
    assert messaging_overhead(step, msgs, counts, lat, gbps, SIZES, SPEEDS) == \
        pytest.approx(want)
    assert messaging_overhead(step, (), (), lat, gbps, SIZES, SPEEDS) == 0.0
    assert messaging_overhead(step, msgs, counts, lat, gbps, SIZES, (1.0, 1.0, 1.0)) == 0.0


def test_the_same_communication_time_costs_less_in_large_messages() -> None:
    """Latency-bound small messages run at the worst measured speed: the same native
    communication time in large messages costs RAPS less."""
    lat, gbps = 1e-5, 1.0
    small = messaging_overhead(1.0, (8.0,), (1000.0,), lat, gbps, SIZES, SPEEDS)
    t_small = 1000 * (lat + 8 / 1e9)
    k = t_small / (lat + 65536 / 1e9)
    large = messaging_overhead(1.0, (65536.0,), (k,), lat, gbps, SIZES, SPEEDS)
    assert 0 < large < small


def _scenario(**job: object) -> dict[str, object]:
    return {"name": "m", "run": {"seeds": 1, "horizon_days": 60.0},
            "cluster": {"racks": 4, "idle_nodes": 4}, "failures": {"mtbf_h": 2000.0},
            "job": {"nodes": 32, **job}, "raps": {"spares": 4},
            "checkpoint": {"interval_s": 1800.0}}


def test_a_profile_slows_raps_as_the_log_overhead_it_amounts_to() -> None:
    """The profile is one more way to state raps's messaging cost: the simulation with it
    equals the one given the overhead it computes as raps.log_overhead."""
    data = _scenario(step_s=0.2, msg_bytes=[8, 1048576], msg_per_step=[200, 4])
    s = parse_scenario(data, "test")
    share = log_share(s)
    assert share != s.raps.log_overhead and 0 < share < 1
    plain = dict(data, raps={"spares": 4, "log_overhead": share}, job={"nodes": 32})
    a = run_one(s, "raps", 1)
    b = run_one(parse_scenario(plain, "test"), "raps", 1)
    assert a.useful_work_fraction == pytest.approx(b.useful_work_fraction)
    assert a.logging_s == pytest.approx(b.logging_s) and a.logging_s > 0


@pytest.mark.parametrize(("job", "raps", "says"), [
    ({"step_s": 0.1, "msg_bytes": [8, 64], "msg_per_step": [1]}, {},
     "job.msg_per_step: 1 counts for 2 job.msg_bytes"),
    ({"msg_bytes": [8], "msg_per_step": [1]}, {}, "job.step_s: 0 with job.msg_bytes given"),
    ({}, {"msg_sizes_b": [8, 8], "msg_speed": [0.1, 0.2]}, "raps.msg_sizes_b: [8.0, 8.0] is "
                                                           "not increasing"),
    ({}, {"msg_speed": [0.1]}, "raps.msg_speed: 1 speeds for 3 raps.msg_sizes_b"),
    ({"msg_bytes": ["big"], "msg_per_step": [1], "step_s": 1.0}, {},
     "job.msg_bytes: expected a list of numbers, got ['big']"),
])
def test_a_bad_profile_is_named(job: dict[str, object], raps: dict[str, object],
                                says: str) -> None:
    with pytest.raises(ScenarioError) as e:
        parse_scenario({"job": job, "raps": raps}, "test")
    assert says in str(e.value)


def test_calibrate_takes_the_per_size_speeds_from_bench_mpi(tmp_path: Path) -> None:
    src = ROOT / "docs/runs/bench-mpi-2026-12-05-3.json"
    d = json.loads(src.read_text())
    r = calibrate([str(src)])
    p = r["parameters"]
    assert p["raps.msg_sizes_b"] == [8.0, 1048576.0, 8388608.0]
    assert p["raps.msg_speed"] == pytest.approx(
        [1 / d["lat_8B_ratio"], d["bw_1MiB_ratio"], d["bw_8MiB_ratio"]], abs=1e-4)
    assert p["cluster.mpi_latency_us"] == d["lat_8B_openmpi_us"]
    assert p["cluster.mpi_gbps"] == pytest.approx(d["bw_8MiB_openmpi_MBps"] / 1000)
    assert r["sources"]["raps.msg_speed"]["fields"] == ["lat_8B_ratio", "bw_1MiB_ratio",
                                                        "bw_8MiB_ratio"]
    s = apply(parse_scenario({"job": {"step_s": 0.01, "msg_bytes": [4096],
                                      "msg_per_step": [16]}}, "test"), p)
    assert s.raps.msg_speed == tuple(p["raps.msg_speed"]) and 0 < log_share(s) < 1
