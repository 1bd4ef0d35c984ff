"""``rapsctl show status``: etcd's size against its quota, alarms, the leader, what RAPS
keeps in etcd, and the jobs whose reports the leader paused (with their users)."""

from __future__ import annotations

import json
from typing import Any

import click

from raps_slurm import config as cfgmod
from raps_slurm.cli.show import show
from raps_slurm.coordinator.election import read_leader
from raps_slurm.core.hygiene import WARN_SHARE, ReportPause
from raps_slurm.errors import RecordError
from raps_slurm.store import open_store


def _count(kvs: list[Any], keys: Any, depth: int) -> int:
    return sum(1 for kv in kvs if len(keys.split(kv.key)) == depth)


def _paused(kvs: list[Any], keys: Any) -> list[dict[str, Any]]:
    """The leader's pauses of jobs' reports, by job."""
    out = []
    for kv in kvs:
        parts = keys.split(kv.key)
        if len(parts) == 3 and parts[2] == "paused":
            try:
                p = ReportPause.from_json(kv.key, kv.value)
            except RecordError as exc:
                out.append({"job": parts[1], "user": "", "line": str(exc)})
                continue
            out.append({"job": p.job, "user": p.user, "since": p.since, "in_use": p.in_use,
                        "written": p.written, "line": p.line()})
    return out


@show.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def show_status(ctx: click.Context, as_json: bool) -> None:
    """etcd (version, revision, database size and use against store.space_quota_bytes,
    alarms), the coordinator leader, the number of RAPS records by kind and the jobs whose
    reports the leader paused, with their users."""
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
        "reports_paused": _paused(jobs, keys),
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
    for p in out["reports_paused"]:
        click.echo(f"  {p['line']}")
    click.echo(f"coordinator leader: {out['leader'] or 'NONE'}")
    click.echo(f"records: {out['nodes_registered']} nodes registered, {out['jobs']} jobs "
               f"({out['keys_under_jobs']} keys), {out['plans']} plans, "
               f"{out['history_events']} history events, {out['weights_set']} weights set")
