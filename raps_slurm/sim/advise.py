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
from raps_slurm.sim.raps import log_share
from raps_slurm.sim.runner import run_report
from raps_slurm.sim.scenario import Scenario, override, parse_scenario, to_dict

OBJECTIVE = "node_efficiency: useful node-hours / allocated node-hours (spares included)"


def messaging_cost(s: Scenario, mpi_file: str, comm_share: float) -> tuple[Scenario, str]:
    """The scenario with ``raps.log_overhead`` from a ``rapsctl bench mpi`` output (RAPS
    against Open MPI) for an application communicating ``comm_share`` of its time."""
    kind, data = calibrate.load_bench(mpi_file)
    if kind != "mpi":
        raise ScenarioError([f"--mpi {mpi_file}: expected the output of rapsctl bench mpi, "
                             f"got bench {kind}"])
    values = calibrate.from_mpi(data, mpi_file, comm_share)
    for v in values:
        s = override(s, v.key, list(v.value) if isinstance(v.value, tuple) else v.value)
    how = next(v.how for v in values if v.key == "raps.log_overhead")
    if s.job.step_s > 0 and s.job.msg_bytes:
        how = (f"{log_share(s):.4g} from job.msg_bytes and job.step_s at bench mpi's "
               f"per-size speeds (raps.msg_speed)")
    return s, how


def messaging_used(s: Scenario, cost: str = "") -> tuple[float, str]:
    """The share of computation the raps strategy is charged for messaging (``log_share``:
    per message size from job.msg_bytes and job.step_s when given, else
    raps.log_overhead) and where it comes from (``cost``: messaging_cost's account, when
    --mpi set it)."""
    if s.job.step_s > 0 and s.job.msg_bytes:
        return log_share(s), cost or ("job.msg_bytes and job.step_s at raps.msg_speed "
                                      "(per message size)")
    return s.raps.log_overhead, cost or "raps.log_overhead"


def map_title(s: Scenario, cost: str = "") -> str:
    """The advice map's title: the scenario and the messaging cost raps is charged."""
    share, _ = messaging_used(s, cost)
    how = "per message size" if s.job.step_s > 0 and s.job.msg_bytes else "log_overhead"
    return f"Best strategy, {s.name}, raps messaging cost {share:.3g} ({how})"


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
            "spares": s.raps.spares if name in ("raps", "scr", "step") else 0}
        if name in ("raps", "step"):
            row["replicas"] = s.checkpoint.replicas
        if name == "raps":
            row["log_overhead"] = round(log_share(s), 4)
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


MAP_NODES = (16, 128, 1024, 8192)
MAP_MTBF_H = (2_000.0, 10_000.0, 50_000.0)


def scaled(s: Scenario, nodes: int, mtbf_h: float) -> Scenario:
    """Scenario ``s`` for a job of ``nodes`` at node MTBF ``mtbf_h``: spares and idle
    nodes in the same proportion to the job as in ``s`` (at least one each), racks of the
    same size."""
    pool = s.job.nodes + s.raps.spares + s.cluster.idle_nodes
    per_rack = max(1, pool // max(1, s.cluster.racks))
    spares = max(1, round(nodes * s.raps.spares / s.job.nodes))
    idle = max(1, round(nodes * s.cluster.idle_nodes / s.job.nodes))
    racks = max(1, (nodes + spares + idle) // per_rack)
    if s.cluster.rack_sizes:
        raise ScenarioError(["--map: the scenario gives a list of rack sizes; the map needs "
                             "a rack count (cluster.racks) to scale the cluster"])
    data = to_dict(s)
    data["job"]["nodes"] = nodes
    data["failures"]["mtbf_h"] = mtbf_h
    data["raps"]["spares"] = spares
    data["cluster"].update(idle_nodes=idle, racks=racks)
    return parse_scenario(data, s.source or "scenario")


def advice_map(s: Scenario, nodes: tuple[int, ...] = MAP_NODES,
               mtbf_h: tuple[float, ...] = MAP_MTBF_H,
               progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """One row per (nodes, node MTBF): the best strategy and each one's useful work per
    allocated node and interval, every point on the scenario's seeds and horizon."""
    rows: list[dict[str, Any]] = []
    total = len(nodes) * len(mtbf_h)
    for n in nodes:
        for m in mtbf_h:
            out = advise(scaled(s, n, m))
            row: dict[str, Any] = {"nodes": n, "node_mtbf_h": m, "best": out["best"],
                                   "within_noise": ",".join(out["within_noise"])}
            for name, r in out["strategies"].items():
                row[f"{name}_node_efficiency"] = r["node_efficiency"]
                row[f"{name}_interval_s"] = r["interval_s"]
            rows.append(row)
            if progress is not None:
                progress(len(rows), total)
    return rows
