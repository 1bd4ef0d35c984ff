"""The simulator's requeue path against a real whole-job restart (``rapsctl simulate
validate``'s ``requeue``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.bench.recovery import requeue_phases
from raps_slurm.cli import main
from raps_slurm.errors import ScenarioError
from raps_slurm.sim.scenario import load_scenario
from raps_slurm.sim.validate import (
    TOLERANCE_SHARE,
    load_efficiency,
    validate,
    validate_requeue,
)

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "examples" / "scenarios" / "validate-6.yaml"
MEASURED = ROOT / "examples" / "calibration" / "validation" / "efficiency-2026-12-05-requeue.json"
SECOND = ROOT / "examples" / "calibration" / "validation" / \
    "efficiency-2026-12-05-requeue-b.json"
BEFORE = ROOT / "examples" / "calibration" / "validation" / "efficiency.json"


def bench(restart_wall: float, relaunch: float, free_wall: float = 100.0,
          crash: float = 20.0) -> dict[str, Any]:
    done = {"state": "COMPLETED", "crash_after_s": crash}
    return {"steps": 1000, "step_sec": 0.05, "checkpoint_every_steps": 20,
            "raps": {**done, "wall_s": 105.0},
            "whole_job_restart": {**done, "wall_s": restart_wall,
                                  "requeue": {"detect_s": 3.0, "relaunch_s": 99.0}},
            "requeue_calibration": {"detect_s": 3.0, "relaunch_s": relaunch},
            "failure_free": {"state": "COMPLETED", "wall_s": free_wall}}


def test_the_simulated_requeue_costs_detection_lost_work_and_relaunch() -> None:
    """Detection, the calibration run's relaunch and at most one checkpoint interval of
    lost work (1 s of work at half the pace); the validated run's own relaunch (99 s
    here) is not used."""
    s = load_scenario(SCENARIO)
    out = validate_requeue(bench(restart_wall=120.0, relaunch=15.0), s)
    sim = out["simulated"]
    assert sim["escalations"] == 1 and sim["unfinished"] == 0
    assert out["reinit_s"] == pytest.approx(15.0, abs=1e-3)
    fixed = s.raps.detect_s + 15.0
    assert fixed <= sim["crash_cost_s"] <= fixed + 2.0 + 0.01
    assert out["real"]["crash_cost_s"] == 20.0
    assert out["tolerance_s"] == pytest.approx(TOLERANCE_SHARE * 20.0)
    assert out["agree"] == (abs(sim["crash_cost_s"] - 20.0) <= out["tolerance_s"])
    assert out["real"]["relaunch_s"] == 99.0 and out["calibration"]["relaunch_s"] == 15.0
    other = bench(restart_wall=120.0, relaunch=15.0)
    other["whole_job_restart"]["requeue"]["relaunch_s"] = 1.0
    assert validate_requeue(other, s)["simulated"] == sim


def test_an_output_without_the_calibration_run_is_one_line(tmp_path: Path) -> None:
    old = bench(120.0, 15.0)
    del old["requeue_calibration"]
    with pytest.raises(ScenarioError) as exc:
        validate_requeue(old, load_scenario(SCENARIO), "e.json")
    assert exc.value.errors == ["e.json: requeue_calibration.relaunch_s is missing (a bench "
                                "efficiency output from before the requeue was measured)"]
    failed = bench(120.0, 15.0)
    failed["whole_job_restart"]["state"] = "FAILED"
    with pytest.raises(ScenarioError, match="the whole_job_restart run did not complete"):
        validate_requeue(failed, load_scenario(SCENARIO))


def test_the_measured_requeue_agrees_with_the_simulator(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The committed output through the command: the whole-job restart's crash cost
    within TOLERANCE_SHARE of the simulated requeue's (22.6 s real, 18.3 s simulated)."""
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "validate", str(MEASURED)])
    assert exc.value.code == 0
    out = json.loads(capsys.readouterr().out)
    req = out["requeue"]
    data = json.loads(MEASURED.read_text())
    assert req["reinit_s"] == pytest.approx(data["requeue_calibration"]["relaunch_s"],
                                            abs=1e-3)
    assert req["simulated"]["escalations"] == 1
    assert req["agree"] and abs(req["difference_s"]) <= req["tolerance_s"], req
    # The tolerance is smaller than the effect, and the requeue costs more than the
    # local recovery the same output measured.
    assert 0 < req["tolerance_s"] < req["real"]["crash_cost_s"]
    assert req["real"]["crash_cost_s"] > out["real"]["crash_cost_s"] + out["tolerance_s"]


def test_an_output_from_before_has_no_requeue(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "validate", str(BEFORE)])
    assert exc.value.code == 0
    assert json.loads(capsys.readouterr().out)["requeue"] is None


@pytest.mark.parametrize("relaunch", [0.001, 300.0])
def test_a_wrong_requeue_cost_does_not_validate(relaunch: float) -> None:
    """The committed run with the relaunch of a model that leaves it out (next to zero)
    or takes the scenario default (job.reinit_s 300 s): the simulated crash cost misses
    the real one by more than the tolerance."""
    data = copy.deepcopy(load_efficiency(MEASURED))
    data["requeue_calibration"]["relaunch_s"] = relaunch
    out = validate_requeue(data, load_scenario(SCENARIO))
    assert abs(out["difference_s"]) > out["tolerance_s"]
    assert not out["agree"], out


def test_the_requeue_phases_come_from_the_escalation_record_and_the_resumed_lines() -> None:
    """bench efficiency's ``requeue``: crash -> the leader's escalation, escalation ->
    requeued in Slurm (released: never here) and -> every rank restored; the steps the
    ranks resumed at, from their lines in the job's output."""
    text = ("rank 0 started on n1\nrank 3 epoch 2 resumed at step 40\n"
            "rank 1 epoch 2 resumed at step 40\nrank 2 epoch 2 resumed at step 20\n")
    rec = {"reason": "no usable spare", "at": 1003.5, "requeued_at": 1003.52,
           "released_at": None}
    out = requeue_phases(1000.0, rec, 1018.25, text)
    assert out == {"reason": "no usable spare", "detect_s": 3.5, "requeued_s": 0.02,
                   "released_s": None, "relaunch_s": 14.75, "resumed_steps": [20, 40]}
    assert requeue_phases(1000.0, rec, None, "")["relaunch_s"] is None


def test_the_second_run_agrees_and_either_calibration_serves_either_run() -> None:
    """A second benchmark the same afternoon: both of its crashes agree, and each output's
    whole-job restart still agrees with the other output's relaunch (14.7 s and 19.2 s):
    the figure is the cluster's, not one run's."""
    first, second = load_efficiency(MEASURED), load_efficiency(SECOND)
    s = load_scenario(SCENARIO)
    assert validate(second, s)["agree"]
    assert validate_requeue(second, s)["agree"]
    for run, other in ((first, second), (second, first)):
        crossed = {**run, "requeue_calibration": other["requeue_calibration"]}
        out = validate_requeue(crossed, s)
        assert out["reinit_s"] == pytest.approx(
            other["requeue_calibration"]["relaunch_s"], abs=1e-3)
        assert out["agree"], out
