"""``rapsctl simulate calibrate``: benchmark outputs -> scenario parameters with provenance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.cli import main
from raps_slurm.errors import ScenarioError
from raps_slurm.sim.calibrate import apply, calibrate, kind_of, log_overhead, to_yaml
from raps_slurm.sim.raps import RapsSim
from raps_slurm.sim.scenario import load_scenario, parse_scenario
from raps_slurm.sim.trace import build_layout

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = {"benchmark": "checkpoint", "size_bytes": 500_000_000, "change": 0.13,
              "incr_seconds": 1.5, "restore_gbps": 0.4, "full_bytes_written": 300_000_000}
MESSAGING = {"benchmark": "messaging", "size_bytes": 4096, "ratio": 0.5}
DETECT = {"benchmark": "detect", "runs": 5, "interval_s": 1.0, "miss_threshold": 3,
          "fence_margin_s": 0.5, "detect_p50_s": 2.9, "detect_max_s": 3.1,
          "detect_s": [2.8, 2.9, 3.1]}
RECOVERY = {"state_bytes": 64 << 20, "moved_bytes": 200_000_000, "ranks": [3],
            "detect_s": 3.4, "plan_s": 0.2, "launch_s": 1.0, "restore_s": 3.0,
            "replay_s": 2.0, "replayed_messages": 16, "step_sec": 0.05,
            "messages_per_step_per_rank": 2}


def write(tmp: Path, **files: dict[str, Any]) -> list[str]:
    out = []
    for name, data in files.items():
        p = tmp / f"{name}.json"
        p.write_text(json.dumps(data))
        out.append(str(p))
    return out


def test_each_value_is_computed_from_named_fields(tmp_path: Path) -> None:
    paths = write(tmp_path, checkpoint=CHECKPOINT, messaging=MESSAGING, detect=DETECT,
                  recovery=RECOVERY)
    r = calibrate(paths, comm_share=0.25)
    p = r["parameters"]
    assert p["raps.incr_s_per_gb"] == pytest.approx(1.5 / 0.5)
    assert p["raps.restore_gbps"] == 0.4          # bench checkpoint beats the recovery's
    assert p["raps.storage_ratio"] == pytest.approx(0.6)
    assert p["raps.log_overhead"] == pytest.approx(1 - 1 / (0.75 + 0.25 / 0.5), abs=1e-4)
    assert p["raps.detect_s"] == 2.9              # bench detect's median beats one crash
    assert p["raps.miss_threshold"] == 3 and isinstance(p["raps.miss_threshold"], int)
    assert p["raps.plan_s"] == 0.2
    # The restore phase (3 s) less 0.2 GB at bench checkpoint's 0.4 GB/s: launch and start.
    assert p["raps.launch_s"] == pytest.approx(2.5)
    assert [d["value"] for d in r["also_measured"]["raps.launch_s"]] == [1.0]
    # 16 replayed messages, 2 a step, one rank: 8 steps of 0.05 s re-executed in 2 s.
    assert p["raps.replay_speedup"] == pytest.approx(8 * 0.05 / 2.0)
    src = r["sources"]["raps.incr_s_per_gb"]
    assert src["file"] == paths[0] and src["fields"] == ["incr_seconds", "size_bytes"]
    assert r["sources"]["raps.replay_speedup"]["file"] == paths[3]
    (other,) = r["also_measured"]["raps.restore_gbps"]
    assert other["file"] == paths[3] and other["value"] == pytest.approx(0.2 / 2.0)
    assert [d["value"] for d in r["also_measured"]["raps.detect_s"]] == [3.4]
    assert r["assumed"] == {"comm_share": 0.25}
    check = r["checks"]["detect"]
    assert check["measured_p50_s"] == 2.9 and 2.0 < check["model_p50_s"] < 4.0
    # Every value is one a scenario accepts.
    s = apply(parse_scenario({}, "t"), p)
    assert s.raps.detect_s == 2.9 and s.raps.replay_speedup == p["raps.replay_speedup"]


def test_the_messaging_cost_is_against_open_mpi_when_bench_mpi_is_given(
        tmp_path: Path) -> None:
    """bench mpi (RAPS against Open MPI) gives raps.log_overhead; bench messaging (logged
    against unlogged RAPS, logging alone) is kept under also_measured."""
    mpi = {"benchmark": "mpi", "lat_8B_ratio": 8.0, "bw_1MiB_ratio": 0.25,
           "bw_8MiB_ratio": 0.5, "allreduce_8MiB_ratio": 0.5}
    paths = write(tmp_path, messaging=MESSAGING, mpi=mpi)
    r = calibrate(paths, comm_share=0.25)
    speed = (1 / 8 * 0.25 * 0.5 * 0.5) ** 0.25
    assert r["files"][paths[1]] == "mpi"
    assert r["parameters"]["raps.log_overhead"] == pytest.approx(
        1 - 1 / (0.75 + 0.25 / speed), abs=1e-4)
    assert r["sources"]["raps.log_overhead"]["file"] == paths[1]
    assert r["sources"]["raps.log_overhead"]["fields"] == [
        "lat_8B_ratio", "bw_1MiB_ratio", "bw_8MiB_ratio", "allreduce_8MiB_ratio"]
    (other,) = r["also_measured"]["raps.log_overhead"]
    assert other["file"] == paths[0]
    with pytest.raises(ScenarioError, match="lat_8B_ratio"):
        calibrate(write(tmp_path, bad={"benchmark": "mpi", "bw_1MiB_ratio": 0.2}))


def test_log_overhead_formula() -> None:
    assert log_overhead(1.0, 0.25) == 0.0
    assert log_overhead(1.08, 0.25) == 0.0       # logged faster is noise, not a gain
    assert log_overhead(0.5, 0.0) == 0.0
    assert log_overhead(0.5, 1.0) == pytest.approx(0.5)  # all communication, half the speed
    assert log_overhead(0.87, 0.25) == pytest.approx(1 - 1 / (0.75 + 0.25 / 0.87))


def test_recovery_without_replay_fields_says_why(tmp_path: Path) -> None:
    old = {k: v for k, v in RECOVERY.items() if k != "step_sec"}
    r = calibrate(write(tmp_path, recovery=old))
    assert "raps.replay_speedup" not in r["parameters"]
    assert any("raps.replay_speedup not calibrated" in n for n in r["notes"])
    assert r["parameters"]["raps.restore_gbps"] == pytest.approx(0.1)  # only source here
    assert r["parameters"]["raps.launch_s"] == 1.0  # no decode rate to split the phase
    assert "checks" not in r


def test_timed_steps_give_the_replay_speed_and_beat_heat_ring(tmp_path: Path) -> None:
    """bench recovery --program compute: the median over runs of the lost steps at the
    failure-free step's CPU time over the re-execution's CPU time; it wins over a sleeping
    run (wall against wall) and over heat_ring's nominal steps, kept under also_measured."""
    timed = {**RECOVERY, "step_sec": None, "runs": 3, "replay_speed_p50": 2.2,
             "replay_speed_cpu_p50": 0.6, "replay_speed_core_p50": 0.9}
    paths = write(tmp_path, heat=RECOVERY, compute={**timed, "program": "compute"},
                  sleep={**timed, "program": "sleep", "step_sec": 0.05})
    r = calibrate(paths)
    assert r["parameters"]["raps.replay_speedup"] == 0.9
    assert r["sources"]["raps.replay_speedup"]["file"] == paths[1]
    assert r["sources"]["raps.replay_speedup"]["fields"][0] == "replay_speed_core_p50"
    assert sorted(d["value"] for d in r["also_measured"]["raps.replay_speedup"]) == [
        pytest.approx(8 * 0.05 / 2.0), 2.2]
    assert not r["notes"]
    (none,) = write(tmp_path, none={**timed, "program": "compute",
                                    "replay_speed_core_p50": None})
    r = calibrate([none])
    assert "raps.replay_speedup" not in r["parameters"]
    assert any("no replay_speed_core_p50" in n for n in r["notes"])


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not JSON"),
    ('{"benchmark": "loss"}', "not the output of rapsctl bench checkpoint|mpi|messaging|"
                              "detect|recovery|restart"),
    ('{"benchmark": "checkpoint", "size_bytes": 1e9}', "field 'incr_seconds' is missing or "
                                                       "not a number (got None)"),
])
def test_bad_files_are_one_line(tmp_path: Path, content: str, message: str) -> None:
    p = tmp_path / "b.json"
    p.write_text(content)
    with pytest.raises(ScenarioError) as exc:
        calibrate([str(p)])
    (line,) = exc.value.errors
    assert line.startswith(f"{p}: ") and message in line


def test_kinds() -> None:
    assert kind_of(CHECKPOINT) == "checkpoint" and kind_of(RECOVERY) == "recovery"
    assert kind_of({"steps": 400, "raps": {}}) is None and kind_of([1]) is None


def test_measured_detection_time_drives_the_simulated_verdict() -> None:
    s = parse_scenario({"job": {"nodes": 8}, "raps": {"spares": 2, "detect_s": 7.5},
                        "checkpoint": {"interval_s": 600}}, "t")
    sim = RapsSim(s, build_layout(s), 1, 86400.0)
    assert sim.delays == [7.5]


def rapsctl(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """rapsctl simulate in this process (its real entry point and error handling)."""
    with pytest.raises(SystemExit) as exc:
        main(["simulate", *args])
    out = capsys.readouterr()
    return int(exc.value.code or 0), out.out, out.err


def test_cli_yaml_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = write(tmp_path, checkpoint=CHECKPOINT, messaging=MESSAGING)
    rc, out, err = rapsctl(capsys, "calibrate", *paths)
    assert rc == 0, err
    assert "  incr_s_per_gb: 3    # checkpoint.json: incremental save" in out
    assert "# assumed: comm_share = 0.25" in out
    rc, out, err = rapsctl(capsys, "calibrate", *paths, "--json", "--comm-share", "0.5")
    assert rc == 0, err
    assert json.loads(out)["parameters"]["raps.log_overhead"] == \
        pytest.approx(log_overhead(0.5, 0.5), abs=1e-4)
    bad = tmp_path / "x.json"
    bad.write_text("[]")
    rc, out, err = rapsctl(capsys, "calibrate", str(bad))
    assert rc == 2 and err.splitlines() == [f"rapsctl: {bad}: not the output of rapsctl "
                                            f"bench checkpoint|mpi|messaging|detect|recovery|"
                                            f"restart (no "
                                            f'"benchmark" field naming one, nor bench '
                                            f"recovery's restore_s/replay_s)"], err


def test_seed_128_uses_the_committed_measurements() -> None:
    """examples/scenarios/seed-128.yaml holds exactly what calibrate gives from the
    benchmark outputs in examples/calibration (so neither drifts from the other)."""
    files = sorted(str(p.relative_to(ROOT))
                   for p in (ROOT / "examples" / "calibration").glob("*.json"))
    assert {Path(f).name for f in files} >= {"checkpoint.json", "messaging.json",
                                              "detect.json", "recovery.json"}
    result = calibrate([str(ROOT / f) for f in files], comm_share=0.25)
    seed = load_scenario(ROOT / "examples" / "scenarios" / "seed-128.yaml")
    for key, value in result["parameters"].items():
        section, name = key.split(".")
        assert getattr(getattr(seed, section), name) == value, key
    assert not result["notes"]
    # The README names the command behind each file.
    readme = (ROOT / "examples" / "calibration" / "README.md").read_text()
    for f in files:
        assert Path(f).name in readme


RESTART = {"benchmark": "restart", "ranks": 4, "state_per_rank_bytes": 256 << 20,
           "detect_s": 3.3, "relaunch_s": 2.5, "restore_s": 1.6, "caught_up_s": 12.0,
           "raps": {}, "requeue": {}}


def test_bench_restart_calibrates_the_step_strategy(tmp_path: Path) -> None:
    (path,) = write(tmp_path, restart=RESTART)
    r = calibrate([path])
    p = r["parameters"]
    assert p["step.relaunch_s"] == 2.5
    assert p["step.restore_gbps"] == pytest.approx((256 << 20) / 1e9 / 1.6, abs=1e-4)
    assert p["raps.detect_s"] == 3.3  # the only source here
    assert r["sources"]["step.restore_gbps"]["fields"] == ["state_per_rank_bytes",
                                                           "restore_s"]
    s = apply(parse_scenario({}, "t"), p)
    assert (s.step.relaunch_s, s.raps.detect_s) == (2.5, 3.3)
    # bench detect's median and bench recovery's crash both beat the restart's one crash.
    both = calibrate(write(tmp_path, restart=RESTART, detect=DETECT, recovery=RECOVERY))
    assert both["parameters"]["raps.detect_s"] == 2.9
    assert [d["value"] for d in both["also_measured"]["raps.detect_s"]] == [3.4, 3.3]
    (path,) = write(tmp_path, restart={**RESTART, "relaunch_s": None})
    r = calibrate([path])
    assert "step.relaunch_s" not in r["parameters"]
    assert any("step.* not calibrated" in n for n in r["notes"])
    assert "step:" not in to_yaml(r) and "raps:" in to_yaml(r)
