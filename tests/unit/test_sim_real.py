"""The simulator against a real run on the local cluster (``rapsctl simulate validate``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.cli import main
from raps_slurm.errors import ScenarioError
from raps_slurm.sim.scenario import load_scenario, override
from raps_slurm.sim.validate import TOLERANCE_SHARE, load_efficiency, validate

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "examples" / "scenarios" / "validate-6.yaml"
MEASURED = ROOT / "examples" / "calibration" / "validation" / "efficiency.json"
LOADED = ROOT / "examples" / "calibration" / "loaded" / "efficiency.json"


def bench(raps_wall: float, free_wall: float = 100.0, crash: float = 20.0) -> dict[str, Any]:
    return {"steps": 1000, "step_sec": 0.05, "checkpoint_every_steps": 20,
            "raps": {"state": "COMPLETED", "wall_s": raps_wall, "crash_after_s": crash},
            "failure_free": {"state": "COMPLETED", "wall_s": free_wall}}


def test_the_simulated_crash_costs_what_the_recovery_model_says() -> None:
    s = load_scenario(SCENARIO)
    out = validate(bench(raps_wall=115.0), s)
    assert out["pace"] == pytest.approx(0.5) and out["work_s"] == 50.0
    assert out["real"]["useful_fraction"] == pytest.approx(50 / 115, abs=1e-4)
    assert out["real"]["crash_cost_s"] == 15.0
    sim = out["simulated"]
    # Detection, plan and launch at least; at most that plus the replay of one checkpoint
    # interval (1 s of work at half the pace = 2 s of compute, replayed at replay_speedup).
    fixed = s.raps.detect_s + s.raps.plan_s + s.raps.launch_s
    assert fixed <= sim["crash_cost_s"] <= fixed + 2.0 / s.raps.replay_speedup + 0.5
    assert sim["escalations"] == 0 and sim["unfinished"] == 0
    assert sim["useful_fraction"] == pytest.approx(50 / (100 + sim["crash_cost_s"]), abs=2e-3)
    assert out["difference_s"] == pytest.approx(sim["crash_cost_s"] - 15.0, abs=0.02)
    assert out["tolerance_s"] == pytest.approx(TOLERANCE_SHARE * 15.0)
    assert out["agree"] == (abs(out["difference_s"]) <= out["tolerance_s"])


def test_bad_outputs_are_one_line(tmp_path: Path) -> None:
    p = tmp_path / "e.json"
    old = bench(110.0)
    del old["failure_free"]
    p.write_text(json.dumps(old))
    with pytest.raises(ScenarioError) as exc:
        load_efficiency(p)
    assert exc.value.errors == [f"{p}: not the output of rapsctl bench efficiency with its "
                                f"failure_free run (needs steps, step_sec, raps, "
                                f"failure_free)"]
    failed = bench(110.0)
    failed["raps"]["state"] = "FAILED"
    p.write_text(json.dumps(failed))
    with pytest.raises(ScenarioError, match="the raps run did not complete"):
        load_efficiency(p)


def test_the_measured_run_agrees_with_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    """The committed `rapsctl bench efficiency` output of the nearly idle machine (its
    command in examples/calibration/README.md) through the command: the simulated
    crash cost is within TOLERANCE_SHARE of the real one."""
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "validate", str(MEASURED)])
    assert exc.value.code == 0
    out = json.loads(capsys.readouterr().out)
    data = json.loads(MEASURED.read_text())
    assert out["real"]["useful_fraction"] == pytest.approx(50 / data["raps"]["wall_s"],
                                                            abs=1e-4)
    assert out["agree"] and abs(out["difference_s"]) <= out["tolerance_s"], out
    # The tolerance is smaller than the effect it judges.
    assert 0 < out["tolerance_s"] < out["real"]["crash_cost_s"]
    s = load_scenario(SCENARIO)
    assert out["simulated"]["crash_cost_s"] >= s.raps.detect_s + s.raps.launch_s


def test_a_loaded_machine_cannot_validate() -> None:
    """The same benchmark under heavy load (examples/calibration/loaded): its failure-free
    run took longer than the crashed one (137.7 s against 116.1 s), the load's variance
    exceeds a crash's cost, and validate says they do not agree."""
    out = validate(load_efficiency(LOADED), load_scenario(SCENARIO))
    assert out["real"]["crash_cost_s"] < 0
    assert not out["agree"]


@pytest.mark.parametrize("model", [
    {"raps.detect_s": 0.0, "raps.plan_s": 0.0, "raps.launch_s": 0.0,
     "raps.restore_gbps": 1e6, "raps.replay_speedup": 1000},
    {"raps.replay_speedup": 1000, "raps.detect_s": 0.0},
])
def test_a_model_without_recovery_cost_does_not_validate(model: dict[str, float]) -> None:
    """The committed idle-machine run against a model whose recovery costs (next to)
    nothing: the simulated crash cost misses the real 4.3 s by more than the tolerance."""
    s = load_scenario(SCENARIO)
    for key, value in model.items():
        s = override(s, key, value)
    out = validate(load_efficiency(MEASURED), s)
    assert out["simulated"]["crash_cost_s"] < out["real"]["crash_cost_s"] - out["tolerance_s"]
    assert not out["agree"], out
