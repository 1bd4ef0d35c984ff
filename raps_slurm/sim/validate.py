"""The simulator against a real run: ``rapsctl simulate validate EFFICIENCY.json``.

``rapsctl bench efficiency`` runs heat_ring on the local cluster three times: with a node
crash recovered by raps-slurm, with the same crash recovered by a whole-job restart, and
without a failure. This module simulates the first of them (``examples/scenarios/
validate-6.yaml``: the same 6 nodes, racks, spares and the measured raps figures) and
compares what the model claims to predict: the crash's cost in seconds, the crashed run's
wall time less the failure-free run's, real against simulated. They agree when they
differ by at most ``TOLERANCE_SHARE`` of the real cost, a bound smaller than the effect
itself, so a model that leaves the recovery out (zero detection, plan, launch, restore
and replay) cannot agree; nor can a run whose crash cost nothing measurable (a loaded
machine whose failure-free run was the slower). The useful-work fractions are printed
too, for the record: on a 70 s run a 4 s crash moves them by only 0.04.

What is taken from the benchmark and why:
- the work: ``steps`` x ``step_sec``, the program's own compute;
- the machine's pace: the failure-free run's fraction f0 = work / its wall time. It holds
  the start-up, the checkpoints and the slower steps of a loaded machine, none of which
  the simulator models for a first start; the simulated job computes at that pace
  (``raps.log_overhead`` = 1 - f0, the one knob that slows computation uniformly), so a
  simulated run without a failure has the real one's fraction, and what is compared is
  what the crash costs: detection, plan, launch, restore and replay;
- the crash: the node of the last rank, ``crash_after_s`` after the job started running.

The requeue path (``validate_requeue``): the whole-job restart run of the same output,
where the crash finds no spare and the leader requeues the job, simulated with
``raps.spares`` 0 (the simulator's ``_escalate``: detection, the lost work since the last
checkpoint, ``cluster.queue_wait_s`` + ``job.reinit_s`` + restore) and compared the same
way: its crash cost within ``TOLERANCE_SHARE`` of the real one. The model's detection and
checkpoint figures are the calibrated ones, as above; what it has no figure for is the
requeue's relaunch on this cluster (Slurm's requeue delay, the leader's release, the new
allocation, prolog, raps-run and the ranks' start-up and restore), which dominates the
cost. That figure must not come from the run it validates (any cost would then agree):
the benchmark measures it on a run of its own, ``requeue_calibration``, the same crash
of the same job stopped once every rank of its requeued run has restored, from the
leader's escalation record (``jobs/<id>/escalation``: ``at``) to the last rank's
"resumed" line. It is set as ``job.reinit_s`` (``cluster.queue_wait_s`` 0: the measured
relaunch holds Slurm's own delay; the model's restore of heat_ring's 32 KiB is
subtracted, a few microseconds). The validated run's own relaunch is printed beside it,
for the record, and never used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.calibrate import read_json
from raps_slurm.sim.raps import RapsSim
from raps_slurm.sim.scenario import Scenario, override
from raps_slurm.sim.trace import FAIL, Layout, Outage, build_layout

# Share of the real crash cost the simulated one may miss by. A quarter: the crash cost
# of the committed idle-machine run (4.3 s) is detection, plan, launch, restore and
# replay, each about a second, so a model missing any one of them is off by more.
TOLERANCE_SHARE = 0.25
DEFAULT_SCENARIO = Path(__file__).resolve().parents[2] / "examples" / "scenarios" / \
    "validate-6.yaml"


def load_efficiency(path: str | Path) -> dict[str, Any]:
    """A ``bench efficiency`` output with its failure-free run; one line if not."""
    p = Path(path)
    data = read_json(p, "the output of rapsctl bench efficiency")
    need = ("steps", "step_sec", "raps", "failure_free")
    if not isinstance(data, dict) or not all(k in data for k in need):
        raise ScenarioError([f"{p}: not the output of rapsctl bench efficiency with its "
                             f"failure_free run (needs {', '.join(need)})"])
    for run in ("raps", "failure_free"):
        r = data[run]
        if not isinstance(r, dict) or r.get("state") != "COMPLETED" or \
                not isinstance(r.get("wall_s"), (int, float)) or r["wall_s"] <= 0:
            raise ScenarioError([f"{p}: the {run} run did not complete "
                                 f"(state {r.get('state') if isinstance(r, dict) else r!r})"])
    if not isinstance(data["raps"].get("crash_after_s"), (int, float)):
        raise ScenarioError([f"{p}: raps.crash_after_s is missing"])
    return data


def _machine(bench: dict[str, Any], s: Scenario) -> tuple[Scenario, float, float]:
    """The scenario at the failure-free run's pace, the work and the pace."""
    work = float(bench["steps"]) * float(bench["step_sec"])
    pace = min(1.0, work / float(bench["failure_free"]["wall_s"]))
    every = int(bench.get("checkpoint_every_steps", 20))
    s = override(s, "raps.log_overhead", round(1.0 - pace, 6))
    # heat_ring checkpoints every `every` steps: that much raw compute at this pace.
    s = override(s, "checkpoint.interval_s", every * float(bench["step_sec"]) / pace)
    return s, work, pace


def _compare(bench: dict[str, Any], run: dict[str, Any], s: Scenario, layout: Layout,
             work: float, pace: float) -> dict[str, Any]:
    """``run``'s crash (the last rank's node) simulated on ``layout``: both crash costs,
    their difference, the tolerance and whether they agree."""
    free_wall = float(bench["failure_free"]["wall_s"])
    victim = layout.working[-1]  # the last rank's node, as the benchmark crashes
    crash = float(run["crash_after_s"])
    horizon = s.run.horizon_days * 86400.0
    sim = RapsSim(s, layout, s.run.seed, horizon, work, [Outage(crash, FAIL, victim)])
    r = sim.simulate()
    sim_fraction = r.useful_s / r.wall_s
    real_fraction = work / float(run["wall_s"])
    real_cost = float(run["wall_s"]) - free_wall
    sim_cost = r.wall_s - work / pace
    tolerance = TOLERANCE_SHARE * real_cost
    diff = sim_cost - real_cost
    return {
        "scenario": s.name, "work_s": round(work, 3), "pace": round(pace, 4),
        "crash_after_s": crash, "crashed_node": victim,
        "compared": "crash_cost_s: crashed wall time less failure-free wall time",
        "tolerance_s": round(tolerance, 2), "tolerance_share": TOLERANCE_SHARE,
        "real": {"useful_fraction": round(real_fraction, 4), "wall_s": run["wall_s"],
                 "failure_free_wall_s": free_wall,
                 "crash_cost_s": round(real_cost, 2)},
        "simulated": {"useful_fraction": round(sim_fraction, 4),
                      "wall_s": round(r.wall_s, 2),
                      "crash_cost_s": round(sim_cost, 2),
                      "recovery_s": [round(x, 2) for x in r.recoveries],
                      "escalations": r.escalations, "unfinished": r.unfinished},
        "difference_s": round(diff, 2),
        "fraction_difference": round(sim_fraction - real_fraction, 4),
        "agree": real_cost > 0 and abs(diff) <= tolerance and not r.unfinished,
    }


def validate(bench: dict[str, Any], s: Scenario) -> dict[str, Any]:
    """The real raps run's crash cost beside the simulated one."""
    s, work, pace = _machine(bench, s)
    out = _compare(bench, bench["raps"], s, build_layout(s), work, pace)
    out["whole_job_restart_real_fraction"] = (bench.get("whole_job_restart") or {}) \
        .get("useful_fraction")
    return out


def validate_requeue(bench: dict[str, Any], s: Scenario, path: str | Path = "the output"
                     ) -> dict[str, Any]:
    """The real whole-job restart's crash cost beside the simulated requeue's, the
    requeue's relaunch taken from the output's separate calibration run."""
    run = bench.get("whole_job_restart")
    calib = bench.get("requeue_calibration")
    calib = calib if isinstance(calib, dict) else {}
    relaunch = calib.get("relaunch_s")
    if not isinstance(relaunch, (int, float)) or relaunch <= 0:
        raise ScenarioError([f"{path}: requeue_calibration.relaunch_s is missing (a bench "
                             f"efficiency output from before the requeue was measured)"])
    if not isinstance(run, dict) or run.get("state") != "COMPLETED" or \
            not isinstance(run.get("wall_s"), (int, float)) or \
            not isinstance(run.get("crash_after_s"), (int, float)):
        raise ScenarioError([f"{path}: the whole_job_restart run did not complete "
                             f"(state {run.get('state') if isinstance(run, dict) else run!r})"])
    s, work, pace = _machine(bench, s)
    restore = s.job.state_gb_per_node / s.raps.restore_gbps
    s = override(s, "cluster.queue_wait_s", 0.0)
    s = override(s, "job.reinit_s", round(max(0.0, float(relaunch) - restore), 3))
    out = _compare(bench, run, s, build_layout(s, spares=0), work, pace)
    own = run.get("requeue") or {}
    out["reinit_s"] = s.job.reinit_s
    out["calibration"] = {k: calib.get(k) for k in ("detect_s", "relaunch_s")}
    out["real"].update({k: own.get(k) for k in ("detect_s", "relaunch_s")})
    out["agree"] = out["agree"] and out["simulated"]["escalations"] == 1
    return out
