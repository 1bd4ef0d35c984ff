"""The simulator against a real run: ``rapsctl simulate validate EFFICIENCY.json``.

``rapsctl bench efficiency`` runs heat_ring on the local cluster three times: with a node
crash recovered by raps-slurm, with the same crash recovered by a whole-job restart, and
without a failure. This module simulates the first of them (``examples/scenarios/
validate-6.yaml``: the same 6 nodes, racks, spares and the measured raps figures) and puts
the two useful-work fractions side by side.

What is taken from the benchmark and why:
- the work: ``steps`` x ``step_sec``, the program's own compute;
- the machine's pace: the failure-free run's fraction f0 = work / its wall time. It holds
  the start-up, the checkpoints and the slower steps of a loaded machine, none of which
  the simulator models for a first start; the simulated job computes at that pace
  (``raps.log_overhead`` = 1 - f0, the one knob that slows computation uniformly), so a
  simulated run without a failure has the real one's fraction, and what is compared is
  what the crash costs: detection, plan, launch, restore and replay;
- the crash: the node of the last rank, ``crash_after_s`` after the job started running.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.calibrate import read_json
from raps_slurm.sim.raps import RapsSim
from raps_slurm.sim.scenario import Scenario, override
from raps_slurm.sim.trace import FAIL, Outage, build_layout

TOLERANCE = 0.05  # absolute, on the useful-work fraction (stated before the first run)
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


def validate(bench: dict[str, Any], s: Scenario) -> dict[str, Any]:
    """The real raps run's useful-work fraction beside the simulated one."""
    work = float(bench["steps"]) * float(bench["step_sec"])
    free_wall = float(bench["failure_free"]["wall_s"])
    real = bench["raps"]
    pace = min(1.0, work / free_wall)
    every = int(bench.get("checkpoint_every_steps", 20))
    s = override(s, "raps.log_overhead", round(1.0 - pace, 6))
    # heat_ring checkpoints every `every` steps: that much raw compute at this pace.
    s = override(s, "checkpoint.interval_s", every * float(bench["step_sec"]) / pace)
    layout = build_layout(s)
    victim = layout.working[-1]  # the last rank's node, as the benchmark crashes
    crash = float(real["crash_after_s"])
    horizon = s.run.horizon_days * 86400.0
    sim = RapsSim(s, layout, s.run.seed, horizon, work, [Outage(crash, FAIL, victim)])
    r = sim.simulate()
    sim_fraction = r.useful_s / r.wall_s
    real_fraction = work / float(real["wall_s"])
    diff = sim_fraction - real_fraction
    return {
        "scenario": s.name, "work_s": round(work, 3), "pace": round(pace, 4),
        "crash_after_s": crash, "crashed_node": victim, "tolerance": TOLERANCE,
        "real": {"useful_fraction": round(real_fraction, 4), "wall_s": real["wall_s"],
                 "failure_free_wall_s": free_wall,
                 "crash_cost_s": round(float(real["wall_s"]) - free_wall, 2)},
        "simulated": {"useful_fraction": round(sim_fraction, 4),
                      "wall_s": round(r.wall_s, 2),
                      "crash_cost_s": round(r.wall_s - work / pace, 2),
                      "recovery_s": [round(x, 2) for x in r.recoveries],
                      "escalations": r.escalations, "unfinished": r.unfinished},
        "difference": round(diff, 4),
        "agree": abs(diff) <= TOLERANCE and not r.unfinished,
        "whole_job_restart_real_fraction": (bench.get("whole_job_restart") or {})
        .get("useful_fraction"),
    }
