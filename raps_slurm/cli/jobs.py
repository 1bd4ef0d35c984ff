"""``rapsctl show job [JOBID]``, ``rapsctl show groups JOBID``: jobs as the leader mapped them.

These read etcd, so they need the store credentials (admins, on a node with the
config). ``--json`` prints the shape documented in ``raps_slurm.registry``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from raps_slurm import config as cfgmod
from raps_slurm.cli.output import records, table
from raps_slurm.cli.show import groups_dry_run, show
from raps_slurm.cli.userdoor import as_user, ask
from raps_slurm.registry import job_ids, job_view
from raps_slurm.store import Keys, StateStore, open_store


@contextmanager
def _store(ctx: click.Context) -> Iterator[tuple[StateStore, Keys]]:
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    store, keys = open_store(cfg.store)
    with store:
        yield store, keys


def _when(ts: float | None) -> str | None:
    return None if ts is None else time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts))


def _job_block(job: dict[str, Any]) -> list[list[tuple[str, Any]]]:
    spec = job["spec"]
    lines: list[list[tuple[str, Any]]] = [
        [("JobId", job["job_id"]), ("RestartCount", job["restart_count"]),
         ("UserId", f"{job['user'] or '?'}({job['owner_uid']})"), ("JobName", job["name"]),
         ("State", job["state"])],
        [("NodeList", job["nodes"]), ("Spares", job["spares"]), ("Ranks", len(job["ranks"])),
         ("Replicas", job["replicas"]), ("RanksPerNode", spec["ranks_per_node"]),
         ("CkptInterval", spec["ckpt_interval_sec"])],
        [("Registered", _when(job["registered_at"])), ("Ended", _when(job["ended_at"])),
         ("ExitCode", job["exit_code"]), ("MappedBy", job["built_by"])],
    ]
    if job["map_error"]:
        lines.append([("MapError", job["map_error"])])
    esc = job.get("escalation")
    if esc and esc.get("gave_up"):
        lines.append([("GaveUp", esc["gave_up"])])
    elif esc and "error" not in esc:
        lines.append([("Requeued", f"run {esc['run']}: {esc['reason']}"),
                      ("RequeuesInWindow", esc["requeues"]),
                      ("Excluded", ",".join(esc["exclude"]) or "-")])
    for r in job["ranks"]:
        g = r["group"]
        lines.append([("Rank", r["rank"]), ("Node", r["node"]), ("Epoch", r["epoch"]),
                      ("Status", r["status"]), ("LogBackup", g["log_backup"]),
                      ("CkptMirrors", g["ckpt_mirrors"]), ("SpareOrder", r["spares"]),
                      ("Degraded", g["degraded"] or "no")])
    return lines


@show.command("job")
@click.argument("job_id", required=False)
@click.option("-o", "--oneliner", is_flag=True, help="One line per job.")
@click.option("--json", "as_json", is_flag=True, help="JSON (the documented contract).")
@click.pass_context
def show_job(ctx: click.Context, job_id: str | None, oneliner: bool, as_json: bool) -> None:
    """A RAPS job's registration, rank map and backup groups (all jobs without JOBID).
    A user (not root) names a job of theirs; it is asked of the coordinators."""
    if as_user():
        if job_id is None:
            raise click.UsageError("name a job: users see their own jobs (show job JOBID)")
        jobs = [ask(cfgmod.load_config(ctx.obj.get("config_path")), "job", job_id)]
    else:
        with _store(ctx) as (store, keys):
            if job_id is not None:
                jobs = [job_view(store, keys, job_id)]
            else:
                jobs = [job_view(store, keys, j) for j in job_ids(store, keys)]
    if as_json:
        click.echo(json.dumps(jobs[0] if job_id is not None else jobs, indent=2))
        return
    if not jobs:
        click.echo("No RAPS jobs registered.")
        return
    records([_job_block(j) for j in jobs], oneliner)


@show.command("groups")
@click.argument("job_id", required=False)
@click.option("--nodes", "nodes_expr", metavar="HOSTLIST",
              help="Dry run instead of a job: nodes that would run ranks, e.g. n[1-4].")
@click.option("--spares", "spares_expr", default="", metavar="HOSTLIST",
              help="Dry run: spare nodes, e.g. n[5-6].")
@click.option("--ranks-per-node", default=1, type=click.IntRange(1, 1024), show_default=True,
              help="Dry run: ranks on each node.")
@click.option("--replicas", default=None, type=click.IntRange(0, 8),
              help="Dry run: copies besides the primary (default checkpoint.replica_count).")
@click.option("-o", "--oneliner", is_flag=True, help="One line per rank.")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_context
def show_groups(ctx: click.Context, job_id: str | None, nodes_expr: str | None,
                spares_expr: str, ranks_per_node: int, replicas: int | None, oneliner: bool,
                as_json: bool) -> None:
    """Backup groups of job JOBID, or with --nodes those a job would get (dry run)."""
    if (job_id is None) == (nodes_expr is None):
        raise click.UsageError("give a JOBID or --nodes HOSTLIST (dry run), not both")
    if nodes_expr is not None:
        groups_dry_run(ctx, nodes_expr, spares_expr, ranks_per_node, replicas, as_json)
        return
    assert job_id is not None
    with _store(ctx) as (store, keys):
        job = job_view(store, keys, job_id)
    rows = [{"rank": r["rank"], **r["group"], "spares": r["spares"]} for r in job["ranks"]]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif not rows:
        click.echo(f"Job {job_id} has no backup groups yet (state {job['state']}).")
    elif oneliner:
        records([[[("Rank", r["rank"]), ("Primary", r["primary"]),
                   ("LogBackup", r["log_backup"]), ("CkptMirrors", r["ckpt_mirrors"]),
                   ("SpareOrder", r["spares"]), ("Degraded", r["degraded"] or "no")]]
                 for r in rows], True)
    else:
        table([{**r, "ckpt_mirrors": ",".join(r["ckpt_mirrors"]) or "-",
                "log_backup": r["log_backup"] or "-", "spares": ",".join(r["spares"]) or "-",
                "degraded": r["degraded"] or "no"} for r in rows], False,
              ["rank", "primary", "log_backup", "ckpt_mirrors", "spares", "degraded"])
