"""``rapsctl simulate advise``: which recovery strategy a job should use on a cluster.

Every strategy runs on the same failure traces at its own interval
(:mod:`raps_slurm.sim.intervals`); the advice is the one with the most useful work per
allocated node (``node_efficiency``: spares held idle count against a strategy), and it
says when the runner-up is within the two results' 95 % half-widths (no real winner).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raps_slurm.errors import ScenarioError
from raps_slurm.sim import calibrate
from raps_slurm.sim.runner import run_report
from raps_slurm.sim.scenario import Scenario, override

OBJECTIVE = "node_efficiency: useful node-hours / allocated node-hours (spares included)"


def messaging_cost(s: Scenario, mpi_file: str, comm_share: float) -> tuple[Scenario, str]:
    """The scenario with ``raps.log_overhead`` from a ``rapsctl bench mpi`` output (RAPS
    against Open MPI) for an application communicating ``comm_share`` of its time."""
    kind, data = calibrate.load_bench(mpi_file)
    if kind != "mpi":
        raise ScenarioError([f"--mpi {mpi_file}: expected the output of rapsctl bench mpi, "
                             f"got bench {kind}"])
    (value,) = calibrate.from_mpi(data, mpi_file, comm_share)
    return override(s, "raps.log_overhead", value.value), value.how


def advise(s: Scenario, progress: Callable[[int, int], None] | None = None
           ) -> dict[str, Any]:
    """The best strategy for scenario ``s`` and every strategy's settings and results."""
    rep, _ = run_report(s, progress)
    rows: dict[str, dict[str, Any]] = {}
    for name, summ in rep["strategies"].items():
        iv = rep["intervals"][name]
        row: dict[str, Any] = {
            "node_efficiency": summ["node_efficiency"],
            "node_efficiency_ci95": summ["node_efficiency_ci95"],
            "useful_work_fraction": summ["useful_work_fraction"],
            "useful_work_fraction_ci95": summ["useful_work_fraction_ci95"],
            "interval_s": iv["interval_s"], "why": iv["why"],
            "spares": s.raps.spares if name in ("raps", "scr") else 0}
        if name == "raps":
            row["replicas"] = s.checkpoint.replicas
            row["log_overhead"] = s.raps.log_overhead
        if "flush_every" in iv:
            row["flush_every"] = iv["flush_every"]
        rows[name] = row
    ranked = sorted(rows, key=lambda n: -rows[n]["node_efficiency"])
    best = ranked[0]
    close = [n for n in ranked[1:] if rows[best]["node_efficiency"]
             - rows[n]["node_efficiency"] <= rows[best]["node_efficiency_ci95"]
             + rows[n]["node_efficiency_ci95"]]
    return {"best": best, "within_noise": close, "objective": OBJECTIVE,
            "nodes": s.job.nodes, "state_gb_per_node": s.job.state_gb_per_node,
            "job_mtbf_s": rep["models"]["job_mtbf_s"], "seeds": rep["seeds"],
            "horizon_days": s.run.horizon_days, "strategies": rows,
            "warnings": rep["warnings"]}
