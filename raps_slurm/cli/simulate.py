"""``rapsctl simulate``: the capacity planner (discrete-event simulator, ``raps_slurm.sim``).

``run`` compares the strategies of one scenario; ``sweep`` varies scenario keys over a
grid; ``advise`` picks the best strategy for a job and cluster; ``recommend`` finds the
checkpoint interval, spares and replicas that maximise raps-slurm's useful work per
allocated node for a failure rate and state size; ``plots``
writes the three standard figures; ``calibrate`` turns benchmark outputs into scenario
parameters; ``validate`` compares a real run (``bench efficiency``) with its simulation;
``keys`` lists every scenario key. Pure computation: no cluster, no etcd.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.logfit import log_statistics, mtbf_uncertainty, with_log_fit
from raps_slurm.sim.results import to_csv
from raps_slurm.sim.runner import run_report
from raps_slurm.sim.scenario import Scenario, describe, load_scenario, override, parse_scenario
from raps_slurm.sim.sweep import daly_curve, parse_values, recommend, sweep

_ROWS = (("useful_work_fraction", "useful work (share of wall time)"),
         ("useful_work_fraction_ci95", "  95 % confidence half-width"),
         ("node_efficiency", "useful node-hours / allocated (spares too)"),
         ("checkpoint_overhead", "checkpoint writing"),
         ("logging_overhead", "message logging"),
         ("lost_work_fraction", "work lost and redone"),
         ("stall_fraction", "waiting (detection, restarts, queue)"),
         ("recovery_p50_s", "recovery p50 (s, fault to back where it was)"),
         ("recovery_p50_s_ci95", "  95 % bootstrap interval"),
         ("recovery_p90_s", "recovery p90 (s)"),
         ("recovery_p90_s_ci95", "  95 % bootstrap interval"),
         ("recovery_max_s", "recovery max (s)"),
         ("failures_per_seed", "node failures seen per seed"),
         ("job_failures_per_seed", "job stops per seed"),
         ("escalations_per_seed", "whole-job requeues per seed (raps, step)"),
         ("storage_gb", "checkpoint storage (GB)"),
         ("pfs_tb_per_seed", "PFS traffic per seed (TB)"),
         ("network_tb_per_seed", "node network traffic per seed (TB)"))


def _scenario(path: str, sets: tuple[str, ...], seeds: int | None,
              half_width: float | None = None) -> Scenario:
    s = load_scenario(path)
    return _apply(s, sets, seeds, half_width)


def _apply(s: Scenario, sets: tuple[str, ...], seeds: int | None,
           half_width: float | None = None, fit: bool = True) -> Scenario:
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ScenarioError([f"--set {item!r}: expected KEY=VALUE, e.g. "
                                 f"checkpoint.interval_s=900"])
        s = override(s, key.strip(), yaml.safe_load(value))
    if seeds is not None:
        s = override(s, "run.seeds", seeds)
    if half_width is not None:
        s = override(s, "run.half_width", half_width)
    return with_log_fit(s) if fit else s  # failures.log_mode: fit


@contextmanager
def _progress(label: str, quiet: bool) -> Iterator[Any]:
    """A progress bar on stderr (none when stderr is not a terminal or ``quiet``)."""
    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        yield None
        return
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _print_table(report: dict[str, Any]) -> None:
    names = list(report["strategies"])
    click.echo(f"scenario {report['scenario']}: {report['nodes']} nodes, {report['spares']} "
               f"spares, {report['replicas']} replicas, "
               f"{report['seeds']} seed(s) x {report['horizon_days']:g} days")
    width = max(len(t) for _, t in _ROWS) + 2
    click.echo(" " * width + "".join(f"{n:>14}" for n in names))
    for key, text in _ROWS:
        vals = [report["strategies"][n].get(key) for n in names]
        cells = "".join(f"{'-' if v is None else _fmt(v):>14}" for v in vals)
        click.echo(f"{text:<{width}}{cells}")
    for name, c in report.get("intervals", {}).items():
        click.echo(f"{name} checkpoints every {c['interval_s']:g} s: {c['why']}")
    m = report["models"]
    click.echo(f"global by Daly's model at {m['global_interval_s']:g} s: "
               f"{m['daly_global_fraction_at_interval']}"
               f"; Young {m['young_interval_s']:g} s, Daly {m['daly_interval_s']:g} s "
               f"(checkpoint {m['global_checkpoint_s']:g} s, job MTBF {m['job_mtbf_s']:g} s)")
    info = report.get("inputs", {})
    if "trace" in info:
        tr = info["trace"]
        states = ", ".join(f"{k} {v}" for k, v in tr["by_state"].items())
        mtbf = tr["node_mtbf_h_from_node_fail"]
        ci = tr.get("node_mtbf_h_from_node_fail_ci95")
        click.echo(f"trace: {tr['jobs']} jobs ({states}), {tr['simulated_jobs']} simulated"
                   + (f"; its NODE_FAIL jobs show a node MTBF of {mtbf:g} h" if mtbf else "")
                   + (f" (95 % interval {ci[0]:g}-{ci[1]:g} h)" if ci else ""))
    if "failure_log" in info:
        fl = info["failure_log"]
        click.echo(f"failure log: {fl['failures']} failures on {fl['nodes']} nodes over "
                   f"{fl['span_days']:g} days (node MTBF {fl['node_mtbf_h']:g} h), replayed")
    hw = report.get("half_width")
    if hw:
        click.echo(f"seeds for a useful-work half-width of {hw['target']:g}: {hw['seeds']}"
                   + ("" if hw["reached"] else f" (not reached, run.max_seeds "
                      f"{hw['max_seeds']})"))
    click.echo(f"simulated in {report['wall_s']} s")


def _fmt(v: Any) -> str:
    if isinstance(v, list):
        return "-".join(f"{x:.0f}" if abs(x) >= 10 else f"{x:.2f}" for x in v)
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


@click.group()
def simulate() -> None:
    """Capacity planner: simulate failures, checkpoints and recoveries (no cluster needed)."""


_set = click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                    help="Override a scenario key, e.g. --set raps.spares=8 (repeatable).")
_seeds = click.option("--seeds", type=click.IntRange(1, 10_000), default=None,
                      help="Override run.seeds.")
_half = click.option("--half-width", "half_width", type=click.FloatRange(0, 1), default=None,
                     metavar="H", help="Override run.half_width: more seeds until every "
                     "strategy's useful-work 95 % half-width is at most H (e.g. 0.001), up "
                     "to run.max_seeds.")


@simulate.command("run")
@click.argument("scenario", type=click.Path(dir_okay=False))
@_set
@_seeds
@_half
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Also write one CSV row per strategy to this file.")
@click.option("--plots", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="Write recovery-cdf.png into this directory.")
def run_cmd(scenario: str, sets: tuple[str, ...], seeds: int | None,
            half_width: float | None, as_json: bool, csv_path: str | None,
            plot_dir: str | None) -> None:
    """Compare the strategies of SCENARIO (YAML) on the same failure traces."""
    s = _scenario(scenario, sets, seeds, half_width)
    with _progress("simulating", as_json) as update:
        report, runs = run_report(s, update)
    stats = log_statistics(s)
    if stats is not None:
        report["failure_log_stats"] = stats
        report["mtbf_uncertainty"] = mtbf_uncertainty(report, stats)
    if csv_path:
        rows = [{"strategy": n, **v} for n, v in report["strategies"].items()]
        Path(csv_path).write_text(to_csv(rows))
    if plot_dir:
        from raps_slurm.sim import plots  # matplotlib only when plotting: it is slow to load

        out = plots.plot_recovery_cdf(
            {n: [x for r in rs for x in r.recoveries] for n, rs in runs.items()},
            Path(plot_dir) / "recovery-cdf.png", title=f"Recovery time, {s.name}")
        report["plots"] = [str(out)]
    for w in report["warnings"]:
        click.echo(f"warning: {w}", err=True)
    hw = report.get("half_width")
    if hw and not hw["reached"]:
        click.echo(f"warning: run.half_width {hw['target']:g} not reached within "
                   f"run.max_seeds = {hw['max_seeds']} seeds", err=True)
    if as_json:
        click.echo(json.dumps(report))
    else:
        _print_table(report)
        _print_log_stats(s, report)


def _print_log_stats(s: Scenario, report: dict[str, Any]) -> None:
    stats, unc = report.get("failure_log_stats"), report.get("mtbf_uncertainty")
    if not stats or not unc:
        return
    low, high = stats["node_mtbf_h_ci95"]
    used = "replayed" if s.failures.log_mode == "replay" else (
        f"fitted: {s.failures.distribution} draws at node MTBF {s.failures.mtbf_h:g} h"
        + (f", shape {s.failures.weibull_shape:g}" if s.failures.distribution == "weibull"
           else ""))
    click.echo(f"failure log ({used}): {stats['failures']} failures over "
               f"{stats['node_hours']:.0f} node-hours: node MTBF {stats['node_mtbf_h']:.1f} h, "
               f"95 % interval {low:.1f}-{'inf' if high is None else f'{high:.1f}'} h "
               f"(chi-square; the seed half-widths above leave it out)")
    fit = stats["fit"]
    if fit is None:
        click.echo(f"  no uptime fit: {stats['fit_why_not']}")
    else:
        w, e = fit["weibull"], fit["exponential"]
        click.echo(f"  uptimes ({fit['failures']} ended by a failure, "
                   f"{fit['uptimes'] - fit['failures']} still up): Weibull shape "
                   f"{w['shape']:g}, scale {w['scale_h']:g} h (AIC {w['aic']:g}) against "
                   f"exponential mean {e['mean_h']:g} h (AIC {e['aic']:g}): {fit['better']} "
                   f"fits better (likelihood ratio p {fit['lr_p_value']:g})")
    for name, r in unc["strategies"].items():
        uw = "-".join(f"{v:.4f}" for v in r["useful_work_fraction_at_ends"])
        iv = "-".join("inf" if v is None else f"{v:g}" for v in r.get("interval_s_at_ends", []))
        click.echo(f"  {name} at the interval's ends: useful work {uw} (first order)"
                   + (f", interval {iv} s instead of {r['interval_s']:g} s" if iv else ""))
    for end, d in zip(("low", "high"), unc.get("global_daly_at_ends") or [], strict=False):
        if d:
            click.echo(f"  global by Daly's model at the {end} end: {d['fraction_at_interval']}"
                       f" at its interval, {d['fraction_at_own_interval']} at that MTBF's own "
                       f"({d['daly_interval_s']:g} s)")


def _vary(items: tuple[str, ...]) -> list[tuple[str, list[Any]]]:
    out = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key.strip():
            raise ScenarioError([f"--vary {item!r}: expected KEY=V1,V2,... or "
                                 f"KEY=LOW:HIGH:COUNT"])
        out.append((key.strip(), parse_values(key.strip(), values)))
    return out


@simulate.command("sweep")
@click.argument("scenario", type=click.Path(dir_okay=False))
@click.option("--vary", "vary", multiple=True, required=True, metavar="KEY=V1,V2,...",
              help="A key and its values (or LOW:HIGH:COUNT, geometric); repeat for a grid.")
@_set
@_seeds
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write the rows as CSV to this file.")
@click.option("--plots", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="Write useful-vs-interval.png (when checkpoint.interval_s varies) and "
                   "storage-vs-replicas.png (when checkpoint.replicas varies) here.")
def sweep_cmd(scenario: str, vary: tuple[str, ...], sets: tuple[str, ...], seeds: int | None,
              as_json: bool, csv_path: str | None, plot_dir: str | None) -> None:
    """Simulate SCENARIO for every combination of the --vary values."""
    s = _scenario(scenario, sets, seeds)
    grid = _vary(vary)
    fitted = [k for k, _ in grid if k == "failures.log_mode" or
              (k == "failures.log" and s.failures.log_mode == "fit")]
    if fitted:
        raise ScenarioError([f"--vary {fitted[0]}: the log's fit (failures.log_mode: fit) is "
                             f"made once, before the sweep; run each log or mode on its own"])
    with _progress("sweeping", False) as update:
        rows = sweep(s, grid, update)
    keys = [k for k, _ in grid]
    if csv_path:
        Path(csv_path).write_text(to_csv(rows, keys))
    written = _sweep_plots(s, grid, rows, plot_dir) if plot_dir else []
    if as_json:
        click.echo(json.dumps({"scenario": s.name, "vary": dict(grid), "rows": rows,
                               "plots": written}))
        return
    click.echo(to_csv(rows, keys), nl=False)


def _sweep_plots(s: Scenario, grid: list[tuple[str, list[Any]]], rows: list[dict[str, Any]],
                 plot_dir: str) -> list[str]:
    from raps_slurm.sim import plots  # matplotlib only when plotting: it is slow to load

    keys = [k for k, _ in grid]
    written = []
    if "checkpoint.interval_s" in keys:
        sel = [dict(r, interval_s=r["checkpoint.interval_s"]) for r in rows]
        intervals = [float(v) for v in dict(grid)["checkpoint.interval_s"]]
        curve = daly_curve(s, sorted(intervals)) if "global" in s.run.strategies else []
        written.append(str(plots.plot_useful_vs_interval(
            sel, Path(plot_dir) / "useful-vs-interval.png", daly=curve,
            title=f"Useful work vs checkpoint interval, {s.name}")))
    if "checkpoint.replicas" in keys:
        sel = [dict(r, replicas=r["checkpoint.replicas"]) for r in rows
               if r["strategy"] == "raps"]
        if sel:
            written.append(str(plots.plot_storage_vs_replicas(
                sel, Path(plot_dir) / "storage-vs-replicas.png",
                title=f"raps-slurm storage vs replicas, {s.name}")))
    return written


@simulate.command("plots")
@click.argument("scenario", type=click.Path(dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@_set
@_seeds
@click.option("--intervals", default="120:7200:8", show_default=True, metavar="LIST",
              help="Checkpoint intervals (s) for the interval plot: V1,V2,... or LOW:HIGH:COUNT.")
def plots_cmd(scenario: str, out_dir: str, sets: tuple[str, ...], seeds: int | None,
              intervals: str) -> None:
    """Write useful-vs-interval.png, recovery-cdf.png and storage-vs-replicas.png."""
    s = _scenario(scenario, sets, seeds)
    grid_i = [("checkpoint.interval_s", parse_values("--intervals", intervals))]
    grid_r = [("checkpoint.replicas", [0, 1, 2, 3, 4])]
    with _progress("plotting", False) as update:
        rows_i = sweep(s, grid_i, update)
        rows_r = sweep(override(s, "run.strategies", ["raps"]), grid_r, update)
        _, runs = run_report(s)
    from raps_slurm.sim import plots  # matplotlib only when plotting: it is slow to load

    written = _sweep_plots(s, grid_i, rows_i, out_dir)
    written += _sweep_plots(s, grid_r, rows_r, out_dir)
    written.append(str(plots.plot_recovery_cdf(
        {n: [x for r in rs for x in r.recoveries] for n, rs in runs.items()},
        Path(out_dir) / "recovery-cdf.png", title=f"Recovery time, {s.name}")))
    for w in written:
        click.echo(w)


@simulate.command("recommend")
@click.option("--mtbf-h", type=click.FloatRange(0.001, 1e9), required=True,
              help="Mean time between failures of one node, hours.")
@click.option("--state-gb", type=click.FloatRange(0, 1e6), required=True,
              help="Checkpointed state per node, GB.")
@click.option("--nodes", type=click.IntRange(1, 10_000_000), required=True,
              help="Working nodes of the job.")
@click.option("--scenario", "scenario", type=click.Path(dir_okay=False), default=None,
              help="Start from this scenario's other parameters (default: built-in).")
@_set
@_seeds
@click.option("--days", type=click.FloatRange(0.01, 100_000), default=90.0, show_default=True,
              help="Simulated days per seed and candidate.")
@click.option("--json", "as_json", is_flag=True, help="Print the recommendation as JSON.")
def recommend_cmd(mtbf_h: float, state_gb: float, nodes: int, scenario: str | None,
                  sets: tuple[str, ...], seeds: int | None, days: float,
                  as_json: bool) -> None:
    """Checkpoint interval, spares and replicas that maximise raps-slurm's useful work per
    allocated node."""
    s = load_scenario(scenario) if scenario else parse_scenario({}, "built-in")
    s = override(s, "failures.mtbf_h", mtbf_h)
    s = override(s, "job.state_gb_per_node", state_gb)
    s = override(s, "job.nodes", nodes)
    s = override(s, "run.horizon_days", days)
    if seeds is None and not scenario:
        seeds = 3
    s = _apply(s, sets, seeds, fit=False)  # --mtbf-h is the failure rate
    with _progress("searching", as_json) as update:
        rec = recommend(s, update)
    if as_json:
        click.echo(json.dumps(rec))
        return
    r, g = rec["raps"], rec["global"]
    click.echo(f"{nodes} nodes, node MTBF {mtbf_h:g} h (job MTBF {rec['job_mtbf_s'] / 3600:.2f} h)"
               f", {state_gb:g} GB per node:")
    click.echo(f"  checkpoint.interval_s: {r['interval_s']}   (Young {r['young_interval_s']:g} s,"
               f" Daly {r['daly_interval_s']:g} s for a {r['checkpoint_s']:g} s save)")
    click.echo(f"  checkpoint.replica_count: {r['replicas']}")
    click.echo(f"  spares (sbatch --raps-spares): {r['spares']}")
    click.echo(f"  useful work per allocated node (the objective): "
               f"{r['node_efficiency'] * 100:.2f} % +- {r['node_efficiency_ci95'] * 100:.2f}")
    click.echo(f"  useful work (share of wall time): {r['useful_work_fraction'] * 100:.2f} % "
               f"+- {r['useful_work_fraction_ci95'] * 100:.2f}")
    if g["daly_useful_work_fraction"] is not None:
        click.echo(f"  global checkpoints instead: Daly interval {g['daly_interval_s']:g} s, "
                   f"useful work {g['daly_useful_work_fraction'] * 100:.2f} % by Daly's model")


_DEFAULT = " (default: the scenario's)"
_ADVISE_JOB = (("--nodes", click.IntRange(1, 10_000_000), "Working nodes of the job"),
               ("--state-gb", click.FloatRange(0, 1e6), "Checkpointed state per node, GB"),
               ("--mtbf-h", click.FloatRange(0.001, 1e9), "Node MTBF, hours"),
               ("--spares", click.IntRange(0, 1_000_000), "Spare nodes for raps, scr and step"))


def _advise_job(f: Any) -> Any:
    """The job and cluster options of ``advise``, each defaulting to the scenario."""
    for flag, kind, text in reversed(_ADVISE_JOB):
        f = click.option(flag, type=kind, default=None, help=text + _DEFAULT + ".")(f)
    return f


@simulate.command("advise")
@_advise_job
@click.option("--comm-share", type=click.FloatRange(0, 1), default=None,
              help="Share of its time the application communicates; with --mpi it sets "
                   "raps.log_overhead.")
@click.option("--mpi", "mpi_file", type=click.Path(dir_okay=False), default=None,
              help="A rapsctl bench mpi --json output: RAPS's message speed against Open "
                   "MPI, the cost of leaving it (needs --comm-share).")
@click.option("--scenario", "scenario", type=click.Path(dir_okay=False), default=None,
              help="The cluster and the rest of the job (default: built-in).")
@_set
@_seeds
@click.option("--days", type=click.FloatRange(0.01, 100_000), default=None,
              help="Simulated days per seed (default: the scenario's run.horizon_days).")
@click.option("--map", "map_dir", type=click.Path(file_okay=False), default=None,
              help="Instead: write advise-map.png, .csv and .json to this directory: the "
                   "best strategy for each job size of --map-nodes and node MTBF of "
                   "--map-mtbf-h (spares, idle nodes and racks scaled from the scenario).")
@click.option("--map-nodes", default="16,128,1024,8192", show_default=True, metavar="LIST",
              help="Job sizes of the map: N1,N2,...")
@click.option("--map-mtbf-h", default="2000,10000,50000", show_default=True, metavar="LIST",
              help="Node MTBFs of the map, hours: H1,H2,...")
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON.")
def advise_cmd(nodes: int | None, state_gb: float | None, mtbf_h: float | None,
               spares: int | None, comm_share: float | None, mpi_file: str | None,
               scenario: str | None, sets: tuple[str, ...], seeds: int | None,
               days: float | None, map_dir: str | None, map_nodes: str, map_mtbf_h: str,
               as_json: bool) -> None:
    """The best recovery strategy for a job on a cluster, with its settings, and every
    strategy's useful work at its own interval."""
    from raps_slurm.sim.advise import advise, messaging_cost

    if (mpi_file is None) != (comm_share is None):
        raise ScenarioError(["--mpi and --comm-share: give both (the application's "
                             "communication share turns bench mpi's speed into a cost) "
                             "or neither"])
    s = load_scenario(scenario) if scenario else parse_scenario({}, "built-in")
    for key, value in (("job.nodes", nodes), ("job.state_gb_per_node", state_gb),
                       ("failures.mtbf_h", mtbf_h), ("raps.spares", spares),
                       ("run.horizon_days", days)):
        if value is not None:
            s = override(s, key, value)
    s = _apply(s, sets, seeds, fit=mtbf_h is None)
    cost = ""
    if mpi_file is not None and comm_share is not None:
        s, cost = messaging_cost(s, mpi_file, comm_share)
    if map_dir is not None:
        _advice_map(s, map_dir, map_nodes, map_mtbf_h, cost, as_json)
        return
    with _progress("simulating", as_json) as update:
        out = advise(s, update)
    if cost:
        out["log_overhead_from"] = cost
    for w in out["warnings"]:
        click.echo(f"warning: {w}", err=True)
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"{out['nodes']} nodes, {out['state_gb_per_node']:g} GB each, job MTBF "
               f"{out['job_mtbf_s'] / 3600:.2f} h, {out['seeds']} seed(s) x "
               f"{out['horizon_days']:g} days; objective: {out['objective']}")
    for name, r in out["strategies"].items():
        extra = "".join(f", {k} {r[k]:g}" for k in ("spares", "replicas", "flush_every",
                                                    "log_overhead") if k in r)
        click.echo(f"  {name:<7} {r['node_efficiency'] * 100:6.2f} % per allocated node "
                   f"(+- {r['node_efficiency_ci95'] * 100:.2f}), every {r['interval_s']:g} s"
                   f"{extra}")
    tie = f" (within noise of {', '.join(out['within_noise'])})" if out["within_noise"] else ""
    click.echo(f"best: {out['best']}{tie}")


def _advice_map(s: Scenario, out_dir: str, nodes: str, mtbf_h: str, cost: str,
                quiet: bool) -> None:
    from raps_slurm.sim import plots
    from raps_slurm.sim.advise import advice_map, map_title, messaging_used

    n_list = [int(v) for v in parse_values("--map-nodes", nodes)]
    m_list = [float(v) for v in parse_values("--map-mtbf-h", mtbf_h)]
    if any(n < 1 for n in n_list) or any(m <= 0 for m in m_list):
        raise ScenarioError(["--map-nodes, --map-mtbf-h: expected positive numbers"])
    with _progress("mapping", quiet) as update:
        rows = advice_map(s, tuple(n_list), tuple(m_list), update)
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    with (d / "advise-map.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    share, how = messaging_used(s, cost)
    (d / "advise-map.json").write_text(json.dumps(
        {"scenario": s.name, "log_overhead": round(share, 4), "log_overhead_from": how,
         "rows": rows}))
    png = plots.plot_advice_map(rows, d / "advise-map.png", title=map_title(s, cost))
    for p in (png, d / "advise-map.csv", d / "advise-map.json"):
        click.echo(str(p))


@simulate.command("calibrate")
@click.argument("bench_files", nargs=-1, type=click.Path(dir_okay=False), metavar="BENCH.json...")
@click.option("--comm-share", type=click.FloatRange(0, 1), default=0.25, show_default=True,
              help="Share of its time the application communicates (turns bench mpi's "
                   "RAPS/Open MPI speed, or bench messaging's logged/unlogged ratio, into "
                   "raps.log_overhead); an assumption, recorded.")
@click.option("--scenario", "scenario", type=click.Path(dir_okay=False), default=None,
              help="Check the values against this scenario (each set like --set).")
@click.option("--json", "as_json", is_flag=True,
              help="Print parameters, sources and checks as JSON (default: a YAML fragment "
                   "with one comment per value saying where it came from).")
def calibrate_cmd(bench_files: tuple[str, ...], comm_share: float, scenario: str | None,
                  as_json: bool) -> None:
    """Scenario parameters from the JSON outputs of rapsctl bench checkpoint, mpi,
    messaging, detect and recovery, each with the file and fields it came from."""
    from raps_slurm.sim import calibrate

    result = calibrate.calibrate(list(bench_files), comm_share)
    base = load_scenario(scenario) if scenario else parse_scenario({}, "built-in")
    calibrate.apply(base, result["parameters"])  # one line naming the key if out of range
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(calibrate.to_yaml(result), nl=False)


@simulate.command("validate")
@click.argument("efficiency", type=click.Path(dir_okay=False), metavar="EFFICIENCY.json")
@click.option("--scenario", "scenario", type=click.Path(dir_okay=False), default=None,
              help="The simulated cluster and raps figures (default: the repository's "
                   "examples/scenarios/validate-6.yaml).")
def validate_cmd(efficiency: str, scenario: str | None) -> None:
    """Simulate the crashed runs of a `rapsctl bench efficiency` output, the raps one and
    the whole-job restart's requeue (``requeue``, with its separately measured relaunch;
    null in an output without it), and print each crash's real and simulated cost, their
    difference and whether it is within the tolerance (JSON)."""
    from raps_slurm.sim import validate

    path = Path(scenario) if scenario else validate.DEFAULT_SCENARIO
    bench = validate.load_efficiency(efficiency)
    s = load_scenario(path)
    result = validate.validate(bench, s)
    result["requeue"] = validate.validate_requeue(bench, s, efficiency) \
        if "requeue_calibration" in bench else None
    click.echo(json.dumps(result))


@simulate.command("keys")
def keys_cmd() -> None:
    """Every scenario key with its default and meaning."""
    for key, default, doc in describe():
        click.echo(f"{key} = {json.dumps(default)}  # {doc}")



@simulate.command("convert-lanl")
@click.argument("lanl_csv", type=click.Path(dir_okay=False), metavar="IN")
@click.argument("out", type=click.Path(dir_okay=False), metavar="OUT")
@click.option("--system", default=None, help="The LANL system to convert (needed when IN "
              "holds several; the error lists them).")
@click.option("--nodes", type=click.IntRange(1, 10_000_000), default=None,
              help="Nodes of the cluster the log is mapped onto (default: the system's own).")
@click.option("--map", "rule", type=click.Choice(["block", "first"]), default="block",
              show_default=True, help="block: runs of consecutive source nodes fold onto one "
              "node (every outage kept); first: the first --nodes source nodes only.")
@click.option("--json", "as_json", is_flag=True, help="Print what was converted as JSON.")
def convert_lanl_cmd(lanl_csv: str, out: str, system: str | None, nodes: int | None,
                     rule: str, as_json: bool) -> None:
    """Write one system of LANL's public failure data (IN) as a failure log (OUT) for
    failures.log, with its node MTBF, its 95 % interval and the fit of its uptimes."""
    from raps_slurm.sim.lanl import convert, parse_lanl

    try:
        text = Path(lanl_csv).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ScenarioError([f"IN: cannot read {lanl_csv}: {exc.strerror}"]) from None
    conv = convert(parse_lanl(text, lanl_csv), system, nodes, rule, lanl_csv)
    Path(out).write_text(conv.text)
    for w in conv.warnings:
        click.echo(f"warning: {w}", err=True)
    if as_json:
        click.echo(json.dumps({"out": out, **conv.as_json()}))
        return
    low, high = conv.node_mtbf_h_ci95
    click.echo(f"{out}: {conv.failures} outages of LANL system {conv.system} "
               f"({conv.source_nodes} nodes, {conv.failing_nodes} with outages) over "
               f"{conv.span_days:.1f} days on {conv.nodes} nodes (--map {conv.rule})")
    click.echo(f"system {conv.system}: node MTBF {conv.node_mtbf_h:.1f} h, 95 % interval "
               f"{low:.1f}-{high:.1f} h")
    if conv.fit is not None:
        f = conv.fit
        click.echo(f"uptimes per source node: Weibull shape {f.weibull_shape:.3f}, scale "
                   f"{f.weibull_scale_h:.1f} h (AIC {f.weibull_aic:.1f}), exponential mean "
                   f"{f.exp_mean_h:.1f} h (AIC {f.exp_aic:.1f}): {f.better} fits better")
