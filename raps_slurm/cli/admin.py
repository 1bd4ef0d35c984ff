"""``rapsctl drain|resume``: admin verbs on nodes, for root or SlurmUser only.

RAPS itself only ever changes drains whose reason starts with ``raps:`` and never
resumes a node: a node RAPS drained comes back when an admin says so. Every admin
action is recorded (who, what, when) at ``audit/<time>-<host>-<pid>`` in etcd and in
syslog (``LOG_AUTH``); the action is not held back when etcd is unreachable (draining
a sick node matters more), the missing record is then reported on stderr.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import syslog
import time

import click

from raps_slurm import config as cfgmod
from raps_slurm.cli.output import table
from raps_slurm.cli.show import show
from raps_slurm.errors import RapsError
from raps_slurm.slurm import SlurmClient
from raps_slurm.slurm.parsers import expand
from raps_slurm.store import open_store


class PermissionDenied(RapsError):
    """The caller may not use an admin verb."""


def require_admin(verb: str, client: SlurmClient) -> str:
    """The caller's user name if it is root or SlurmUser; PermissionDenied otherwise."""
    uid = os.geteuid()
    name = pwd.getpwuid(uid).pw_name
    if uid == 0:
        return name
    slurm_name, slurm_uid = client.slurm_user()
    if uid == slurm_uid or (slurm_uid is None and name == slurm_name):
        return name
    raise PermissionDenied(f"permission denied: {verb!r} needs root or SlurmUser "
                           f"({slurm_name})")


def audit(ctx: click.Context, who: str, verb: str, nodes: tuple[str, ...],
          reason: str = "") -> None:
    """Record one admin action in etcd and syslog; a failure is one line on stderr."""
    now = time.time()
    record = {"who": who, "uid": os.geteuid(), "verb": verb, "nodes": list(nodes),
              "reason": reason, "at": now, "host": socket.gethostname()}
    syslog.openlog("rapsctl", 0, syslog.LOG_AUTH)
    syslog.syslog(syslog.LOG_NOTICE, f"{who} {verb} {','.join(nodes)}"
                  + (f": {reason}" if reason else ""))
    ident = f"{int(now * 1e9):020d}-{socket.gethostname()}-{os.getpid()}"
    try:
        store, keys = open_store(cfgmod.load_config(ctx.obj.get("config_path")).store)
        with store:
            store.put(keys.audit(ident), json.dumps(record).encode())
    except (RapsError, OSError) as exc:
        click.echo(f"rapsctl: warning: audit record not written to etcd: {exc}", err=True)


def _nodes(expr: str) -> tuple[str, ...]:
    nodes = expand(expr)
    if not nodes:
        raise click.BadParameter("expected a hostlist such as n[1-4]", param_hint="NODES")
    return nodes


@click.command("drain")
@click.argument("nodes_expr", metavar="NODES")
@click.option("--reason", required=True, help="Why (Slurm shows it; required, as for scontrol).")
@click.pass_context
def drain(ctx: click.Context, nodes_expr: str, reason: str) -> None:
    """Drain NODES in Slurm: running jobs go on, no new work lands there."""
    if not reason.strip():
        raise click.BadParameter("must not be empty", param_hint="--reason")
    client = SlurmClient()
    who = require_admin("drain", client)
    nodes = _nodes(nodes_expr)
    client.drain(nodes, reason)
    audit(ctx, who, "drain", nodes, reason)
    click.echo(f"drained {','.join(nodes)}: {reason}")


@click.command("resume")
@click.argument("nodes_expr", metavar="NODES")
@click.pass_context
def resume(ctx: click.Context, nodes_expr: str) -> None:
    """Return drained NODES to service (also the ones RAPS drained)."""
    client = SlurmClient()
    who = require_admin("resume", client)
    nodes = _nodes(nodes_expr)
    client.resume(nodes)
    audit(ctx, who, "resume", nodes)
    click.echo(f"resumed {','.join(nodes)}")


@show.command("audit")
@click.option("--last", default=50, show_default=True, type=click.IntRange(1, 100000),
              help="The newest N records.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def show_audit(ctx: click.Context, last: int, as_json: bool) -> None:
    """Admin actions recorded in etcd: when, who, what, on which nodes, why."""
    store, keys = open_store(cfgmod.load_config(ctx.obj.get("config_path")).store)
    rows = []
    with store:
        for kv in store.get_prefix(keys.audit_prefix())[-last:]:
            try:
                d = json.loads(kv.value)
                rows.append({"at": time.strftime("%Y-%m-%dT%H:%M:%S",
                                                 time.localtime(float(d["at"]))),
                             "who": str(d["who"]), "uid": int(d["uid"]), "verb": str(d["verb"]),
                             "nodes": ",".join(d["nodes"]), "reason": str(d.get("reason", "")),
                             "host": str(d.get("host", ""))})
            except (ValueError, KeyError, TypeError):
                click.echo(f"rapsctl: skipping malformed {kv.key}", err=True)
    table(rows, as_json, ["at", "who", "uid", "verb", "nodes", "reason", "host"])
