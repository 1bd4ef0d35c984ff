"""``rapsctl drain|resume|update|cancel-plan``: admin verbs, for root or SlurmUser only.

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
from raps_slurm.cli.output import echo, table
from raps_slurm.cli.show import show
from raps_slurm.core.planner import CANCELLED, Plan, PlanEvent
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
          reason: str = "", plan: str = "") -> None:
    """Record one admin action in etcd and syslog; a failure is one line on stderr."""
    now = time.time()
    record = {"who": who, "uid": os.geteuid(), "verb": verb, "nodes": list(nodes),
              "reason": reason, "at": now, "host": socket.gethostname()}
    if plan:
        record["plan"] = plan
    syslog.openlog("rapsctl", 0, syslog.LOG_AUTH)
    syslog.syslog(syslog.LOG_NOTICE, f"{who} {verb} {','.join(nodes) or plan}"
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


MAX_PIN = 65533  # Slurm's own ceiling for a node Weight is higher; this one is plenty


def _weight(text: str) -> int | None:
    """``weight=N`` or ``weight=auto`` (None)."""
    name, _, value = text.partition("=")
    if name.lower() != "weight" or not value:
        raise click.BadParameter(f"{text!r}: expected weight=N (1-{MAX_PIN}) or weight=auto",
                                 param_hint="SETTING")
    if value.lower() == "auto":
        return None
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_PIN:
        raise click.BadParameter(f"{text!r}: expected weight=N (1-{MAX_PIN}) or weight=auto",
                                 param_hint="SETTING")
    return int(value)


@click.command("update")
@click.argument("what", type=click.Choice(["node"]), metavar="node")
@click.argument("nodes_expr", metavar="NODES")
@click.argument("setting", metavar="weight=N|weight=auto")
@click.pass_context
def update(ctx: click.Context, what: str, nodes_expr: str, setting: str) -> None:
    """Pin the Slurm Weight of NODES (the coordinator then leaves it alone, whatever their
    failure history says), or give it back to the coordinator with weight=auto."""
    weight = _weight(setting)
    client = SlurmClient()
    who = require_admin("update", client)
    nodes = _nodes(nodes_expr)
    store, keys = open_store(cfgmod.load_config(ctx.obj.get("config_path")).store)
    with store:
        if weight is None:
            for n in nodes:
                store.delete(keys.weight_pin(n))
        else:
            # recorded first: a leader's pass between the two steps must not undo it
            for n in nodes:
                store.put(keys.weight_pin(n), json.dumps(
                    {"node": n, "weight": weight, "who": who, "at": time.time()}).encode())
            client.set_weight(nodes, weight)
    audit(ctx, who, "update", nodes, setting)
    click.echo(f"{','.join(nodes)}: " + (f"weight {weight}, pinned" if weight is not None
                                          else "weight managed by raps-slurm again"))


@click.command("cancel-plan")
@click.argument("plan_id", metavar="PLAN")
@click.option("--reason", required=True, help="Why (kept in the audit record and the plan).")
@click.pass_context
def cancel_plan(ctx: click.Context, plan_id: str, reason: str) -> None:
    """Give up a recovery plan that is queued or running: the leader escalates its job to
    a whole-job requeue (the job resumes from its checkpoints), as for a plan not done in
    recovery.recovery_timeout_sec."""
    if not reason.strip():
        raise click.BadParameter("must not be empty", param_hint="--reason")
    who = require_admin("cancel-plan", SlurmClient())
    store, keys = open_store(cfgmod.load_config(ctx.obj.get("config_path")).store)
    with store:
        try:
            key = keys.plan(plan_id)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="PLAN") from None
        kv = store.get(key)
        if kv is None:
            raise RapsError(f"cancel-plan: no plan {plan_id!r} (rapsctl show recoveries "
                            "lists them)")
        plan = Plan.from_json(kv.key, kv.value)
        if not plan.active:
            raise RapsError(f"cancel-plan: plan {plan_id} is {plan.state}, not queued or "
                            "running: nothing to cancel")
        event = PlanEvent(plan_id, CANCELLED, time.time(), socket.gethostname(),
                          {"who": who, "uid": os.geteuid(), "reason": reason})
        if not store.create(keys.plan_cancel(plan_id), event.to_json()):
            raise RapsError(f"cancel-plan: plan {plan_id} was already cancelled")
    audit(ctx, who, "cancel-plan", (), reason, plan=plan_id)
    click.echo(f"plan {plan_id} (job {plan.job}, rank {plan.rank}) cancelled: the leader "
               "escalates the job to a requeue")


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
                             "nodes": ",".join(d["nodes"]), "plan": str(d.get("plan", "")),
                             "reason": str(d.get("reason", "")), "host": str(d.get("host", ""))})
            except (ValueError, KeyError, TypeError):
                echo(f"rapsctl: skipping malformed {kv.key}", err=True)
    table(rows, as_json, ["at", "who", "uid", "verb", "nodes", "plan", "reason", "host"])
