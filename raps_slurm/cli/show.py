"""``rapsctl show``: nodes, racks and backup groups as raps-slurm sees them."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from raps_slurm import config as cfgmod
from raps_slurm.cli.output import table
from raps_slurm.core import placement
from raps_slurm.core.topology import with_power_domains
from raps_slurm.errors import StoreError
from raps_slurm.model import Topology
from raps_slurm.slurm import SlurmClient
from raps_slurm.slurm.parsers import expand
from raps_slurm.store import open_store


def _topology(ctx: click.Context, client: SlurmClient) -> Topology:
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    return with_power_domains(client.topology(), client.nodes(),
                              cfg.topology.power_domains, cfg.topology.power_feature_prefix)


@click.group()
def show() -> None:
    """Show cluster and job state."""


def _raps_view(ctx: click.Context) -> dict[str, dict[str, Any]] | None:
    """Per node: agent registration, last verdict, health verdict (None: etcd unreachable)."""
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    store, keys = open_store(cfg.store)
    view: dict[str, dict[str, Any]] = {}
    with store:
        try:
            kvs = store.get_prefix(keys.nodes_prefix())
        except StoreError:
            return None
    for kv in kvs:
        parts = keys.split(kv.key)
        entry = view.setdefault(parts[1], {})
        try:
            value = json.loads(kv.value)
        except ValueError:
            continue
        if len(parts) == 2:
            entry["agent"] = "up" if kv.lease_id else "?"
        elif parts[2] == "verdict" and isinstance(value, dict):
            entry["verdict"] = value.get("kind")
            entry["verdict_age"] = time.time() - float(value.get("at", 0))
        elif parts[2] == "health-verdict" and isinstance(value, dict):
            entry["health"] = f"{value.get('level')}({value.get('score')})"
    return view


@show.command("nodes")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_context
def show_nodes(ctx: click.Context, as_json: bool) -> None:
    """Every Slurm node with rack, power domain, Slurm state, weight, reason, and RAPS's view:
    agent (its membership lease), last detector verdict and its age, health level(score)."""
    client = SlurmClient()
    topo = _topology(ctx, client)
    raps = _raps_view(ctx)
    rows = []
    for n in client.nodes():
        mine = (raps or {}).get(n.name, {})
        age = mine.get("verdict_age")
        rows.append({"node": n.name, "rack": topo.rack_of(n.name) or "-",
                     "power": topo.power_domains.get(n.name, "-"), "state": n.state_text,
                     "weight": n.weight, "reason": n.reason or "-",
                     "agent": "?" if raps is None else mine.get("agent", "down"),
                     "verdict": (f"{mine['verdict']} {age:.0f}s ago" if age is not None
                                 else "-"),
                     "health": mine.get("health", "-")})
    table(rows, as_json, ["node", "rack", "power", "state", "weight", "agent", "verdict",
                          "health", "reason"])


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
