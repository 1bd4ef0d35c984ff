"""``rapsctl show racks``: each fault domain's recent failures, score and applied weights."""

from __future__ import annotations

import time

import click

from raps_slurm import config as cfgmod
from raps_slurm.cli.output import table
from raps_slurm.cli.show import _topology, show
from raps_slurm.coordinator.weights import read_history, read_weights
from raps_slurm.core.history import domain_health
from raps_slurm.slurm import SlurmClient
from raps_slurm.slurm.commands import fold
from raps_slurm.store import open_store


@show.command("racks")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def show_racks(ctx: click.Context, as_json: bool) -> None:
    """Racks and power domains: failures in the history window (DEAD/HUNG/DRAIN), score
    (1 = clean, falls with recent failures), the Slurm weights raps-slurm applied."""
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    client = SlurmClient()
    topo = _topology(ctx, client)
    current = {n.name: n.weight for n in client.nodes()}
    store, keys = open_store(cfg.store)
    with store:
        events, _ = read_history(store, keys)
        owned, _ = read_weights(store, keys)
    now = time.time()
    window = cfg.system.history_window_h * 3600.0
    half = cfg.system.score_half_life_h * 3600.0
    domains: list[tuple[str, dict[str, tuple[str, ...]]]] = [("rack", topo.racks())]
    power: dict[str, list[str]] = {}
    for node, dom in topo.power_domains.items():
        power.setdefault(dom, []).append(node)
    if power:
        domains.append(("power", {d: tuple(sorted(ns)) for d, ns in power.items()}))
    rows = []
    for kind, members in domains:
        for name, h in domain_health(events, members, now, window, half).items():
            applied = {n: owned[n].applied for n in h.nodes
                       if n in owned and current.get(n) == owned[n].applied}
            last = max((e.at for e in events if e.node in h.nodes and now - e.at <= window),
                       default=None)
            rows.append({
                "domain": name, "kind": kind, "nodes": fold(h.nodes),
                "dead": h.failures["DEAD"], "hung": h.failures["HUNG"],
                "drain": h.failures["DRAIN"], "score": round(h.score, 3),
                "last_failure_age_s": None if last is None else round(now - last),
                "weights": ",".join(f"{n}={w}" for n, w in sorted(applied.items())) or "-"})
    table(rows, as_json, ["domain", "kind", "nodes", "dead", "hung", "drain", "score",
                          "last_failure_age_s", "weights"])
