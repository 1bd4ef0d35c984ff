"""``rapsctl show``: nodes, racks and backup groups as raps-slurm sees them."""

from __future__ import annotations

import json
from typing import Any

import click

from raps_slurm import config as cfgmod
from raps_slurm.core import placement
from raps_slurm.core.topology import with_power_domains
from raps_slurm.model import Topology
from raps_slurm.slurm import SlurmClient
from raps_slurm.slurm.parsers import expand


def _emit(rows: list[dict[str, Any]], as_json: bool, columns: list[str]) -> None:
    """Print rows as JSON or as an aligned table."""
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = [columns] + [[str(r[c]) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for row in table:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _topology(ctx: click.Context, client: SlurmClient) -> Topology:
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    return with_power_domains(client.topology(), client.nodes(),
                              cfg.topology.power_domains, cfg.topology.power_feature_prefix)


@click.group()
def show() -> None:
    """Show cluster and job state."""


@show.command("nodes")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_context
def show_nodes(ctx: click.Context, as_json: bool) -> None:
    """Every Slurm node with its rack, power domain, state, weight and reason."""
    client = SlurmClient()
    topo = _topology(ctx, client)
    rows = [{"node": n.name, "rack": topo.rack_of(n.name) or "-",
             "power": topo.power_domains.get(n.name, "-"), "state": n.state_text,
             "weight": n.weight, "reason": n.reason or "-"} for n in client.nodes()]
    _emit(rows, as_json, ["node", "rack", "power", "state", "weight", "reason"])


@show.command("topology")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_context
def show_topology(ctx: click.Context, as_json: bool) -> None:
    """Racks (leaf switches) and their nodes, from Slurm's topology/tree."""
    topo = _topology(ctx, SlurmClient())
    rows = [{"rack": rack, "nodes": ",".join(nodes), "count": len(nodes)}
            for rack, nodes in sorted(topo.racks().items())]
    _emit(rows, as_json, ["rack", "count", "nodes"])


@show.command("groups")
@click.option("--nodes", "nodes_expr", required=True, metavar="HOSTLIST",
              help="Nodes that run ranks, e.g. n[1-4].")
@click.option("--spares", "spares_expr", default="", metavar="HOSTLIST",
              help="Spare nodes of the job, e.g. n[5-6].")
@click.option("--ranks-per-node", default=1, type=click.IntRange(1, 1024), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_context
def show_groups(ctx: click.Context, nodes_expr: str, spares_expr: str, ranks_per_node: int,
                as_json: bool) -> None:
    """Backup groups and spare order a job on NODES with SPARES would get (a dry run)."""
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    topo = _topology(ctx, SlurmClient())
    nodes = expand(nodes_expr)
    if not nodes:
        raise click.BadParameter("expected a non-empty hostlist", param_hint="--nodes")
    ranks = {i * ranks_per_node + k: n for i, n in enumerate(nodes) for k in range(ranks_per_node)}
    result = placement.compute_placement(topo, ranks, expand(spares_expr),
                             prefer_original_rack=cfg.recovery.prefer_original_rack)
    rows = []
    for rank, p in sorted(result.items()):
        g = p.group
        rows.append({"rank": rank, "primary": g.primary, "log_backup": g.log_backup or "-",
                     "ckpt_mirror": g.ckpt_mirror or "-",
                     "racks": ",".join(topo.rack_of(m) or "-" for m in g.members),
                     "spares": ",".join(p.spares) or "-",
                     "degraded": g.reason if g.degraded else "no"})
    _emit(rows, as_json, ["rank", "primary", "log_backup", "ckpt_mirror", "racks", "spares",
                          "degraded"])
