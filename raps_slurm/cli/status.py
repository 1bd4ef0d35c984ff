"""``rapsctl show status``: etcd's size against its quota, alarms, the leader, what RAPS
keeps in etcd."""

from __future__ import annotations

import json
from typing import Any

import click

from raps_slurm import config as cfgmod
from raps_slurm.cli.show import show
from raps_slurm.coordinator.election import read_leader
from raps_slurm.core.hygiene import WARN_SHARE
from raps_slurm.store import open_store


def _count(kvs: list[Any], keys: Any, depth: int) -> int:
    return sum(1 for kv in kvs if len(keys.split(kv.key)) == depth)


@show.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def show_status(ctx: click.Context, as_json: bool) -> None:
    """etcd (version, revision, database size and use against store.space_quota_bytes,
    alarms), the coordinator leader and the number of RAPS records by kind."""
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    store, keys = open_store(cfg.store)
    with store:
        st = store.status()
        leader = read_leader(store, keys.leader())
        nodes = store.get_prefix(keys.nodes_prefix())
        jobs = store.get_prefix(keys.jobs_prefix())
        plans = store.get_prefix(keys.plans_prefix())
        history = store.get_prefix(keys.history_prefix())
        weights = store.get_prefix(keys.weights_prefix())
    quota = cfg.store.space_quota_bytes
    out: dict[str, Any] = {
        "etcd": ",".join(cfg.store.endpoints), "etcd_version": st.version,
        "revision": st.revision, "db_size_bytes": st.db_size,
        "db_in_use_bytes": st.db_size_in_use, "quota_bytes": quota,
        "quota_used": round(st.db_size / quota, 6) if quota else None,
        "alarms": list(st.alarms),
        "leader": leader.get("name") if isinstance(leader, dict) else None,
        "nodes_registered": _count(nodes, keys, 2),
        "jobs": _count(jobs, keys, 2), "keys_under_jobs": len(jobs),
        "plans": sum(1 for kv in plans if len(keys.split(kv.key)) == 2),
        "history_events": len(history), "weights_set": len(weights),
    }
    if as_json:
        click.echo(json.dumps(out))
        return
    use = f" = {out['quota_used']:.1%} of the {quota / 2**20:.0f} MiB quota" if quota else ""
    warn = "  (above the warning level)" if quota and st.db_size >= WARN_SHARE * quota else ""
    click.echo(f"etcd {out['etcd']} version {st.version} revision {st.revision}")
    click.echo(f"  database {st.db_size / 2**20:.2f} MiB ({st.db_size_in_use / 2**20:.2f} MiB "
               f"in use){use}{warn}")
    click.echo(f"  alarms: {', '.join(st.alarms) if st.alarms else 'none'}")
    click.echo(f"coordinator leader: {out['leader'] or 'NONE'}")
    click.echo(f"records: {out['nodes_registered']} nodes registered, {out['jobs']} jobs "
               f"({out['keys_under_jobs']} keys), {out['plans']} plans, "
               f"{out['history_events']} history events, {out['weights_set']} weights set")
