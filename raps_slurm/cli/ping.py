"""``rapsctl ping``: is etcd reachable and does a coordinator lead (like ``scontrol ping``)."""

from __future__ import annotations

import json
import time

import click

from raps_slurm import config as cfgmod
from raps_slurm.coordinator.election import read_leader
from raps_slurm.errors import RapsError, StoreError
from raps_slurm.store import open_store


@click.command("ping")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_context
def ping(ctx: click.Context, as_json: bool) -> None:
    """Report etcd and the coordinator leader; exit 1 when either is missing."""
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    store, keys = open_store(cfg.store)
    started = time.monotonic()
    result: dict[str, object] = {"etcd": ",".join(cfg.store.endpoints), "etcd_up": False,
                                 "leader": None}
    with store:
        try:
            # A read, not a status request: any member answers status alone, but a read
            # needs a majority, which is what RAPS needs to work.
            result["leader"] = read_leader(store, keys.leader())
            result["etcd_up"] = True
            result["etcd_ms"] = round((time.monotonic() - started) * 1000, 1)
        except StoreError as exc:
            result["error"] = str(exc)
            try:
                store.status()
                result["error"] = ("no quorum: a member answers but a majority of the cluster "
                                   f"is unreachable ({exc})")
            except StoreError:
                pass
    leader = result["leader"]
    if as_json:
        click.echo(json.dumps(result, indent=2))
    elif not result["etcd_up"]:
        click.echo(f"etcd at {result['etcd']} is DOWN: {result.get('error')}")
    else:
        click.echo(f"etcd at {result['etcd']} is UP ({result['etcd_ms']} ms)")
        if isinstance(leader, dict):
            click.echo(f"Coordinator leader {leader.get('name')} on {leader.get('host')} "
                       f"pid {leader.get('pid')} is UP (revision {leader.get('revision')})")
        else:
            click.echo("Coordinator leader: NONE (no raps-coordinator holds the leader key)")
    if not result["etcd_up"] or not isinstance(leader, dict):
        raise _Down()


class _Down(RapsError):
    """Exit 1 after the report, without another message line."""

    def __str__(self) -> str:
        return "ping: not all up"
