"""``rapsctl show``: nodes, racks and backup groups as raps-slurm sees them."""

from __future__ import annotations

import click

from raps_slurm import config as cfgmod
from raps_slurm.cli.output import table
from raps_slurm.core import placement
from raps_slurm.core.topology import with_power_domains
from raps_slurm.model import Topology
from raps_slurm.slurm import SlurmClient
from raps_slurm.slurm.parsers import expand


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
    table(rows, as_json, ["node", "rack", "power", "state", "weight", "reason"])


@show.command("topology")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_context
def show_topology(ctx: click.Context, as_json: bool) -> None:
    """Racks (leaf switches) and their nodes, from Slurm's topology/tree."""
    topo = _topology(ctx, SlurmClient())
    rows = [{"rack": rack, "nodes": ",".join(nodes), "count": len(nodes)}
            for rack, nodes in sorted(topo.racks().items())]
    table(rows, as_json, ["rack", "count", "nodes"])


def groups_dry_run(ctx: click.Context, nodes_expr: str, spares_expr: str, ranks_per_node: int,
                   replicas: int | None, as_json: bool) -> None:
    """Backup groups and spare order a job on NODES with SPARES would get."""
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    topo = _topology(ctx, SlurmClient())
    nodes = expand(nodes_expr)
    if not nodes:
        raise click.BadParameter("expected a non-empty hostlist", param_hint="--nodes")
    ranks = {i * ranks_per_node + k: n for i, n in enumerate(nodes) for k in range(ranks_per_node)}
    result = placement.compute_placement(
        topo, ranks, expand(spares_expr),
        replicas=cfg.checkpoint.replica_count if replicas is None else replicas,
        prefer_original_rack=cfg.recovery.prefer_original_rack)
    rows = []
    for rank, p in sorted(result.items()):
        g = p.group
        rows.append({"rank": rank, "primary": g.primary, "log_backup": g.log_backup or "-",
                     "ckpt_mirrors": ",".join(g.ckpt_mirrors) or "-",
                     "racks": ",".join(topo.rack_of(m) or "-" for m in g.members),
                     "spares": ",".join(p.spares) or "-",
                     "degraded": g.reason if g.degraded else "no"})
    table(rows, as_json, ["rank", "primary", "log_backup", "ckpt_mirrors", "racks", "spares",
                          "degraded"])
