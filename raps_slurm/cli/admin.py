"""``rapsctl drain|resume``: admin verbs on nodes, for root or SlurmUser only.

RAPS itself only ever changes drains whose reason starts with ``raps:`` and never
resumes a node: a node RAPS drained comes back when an admin says so.
"""

from __future__ import annotations

import os
import pwd

import click

from raps_slurm.errors import RapsError
from raps_slurm.slurm import SlurmClient
from raps_slurm.slurm.parsers import expand


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


def _nodes(expr: str) -> tuple[str, ...]:
    nodes = expand(expr)
    if not nodes:
        raise click.BadParameter("expected a hostlist such as n[1-4]", param_hint="NODES")
    return nodes


@click.command("drain")
@click.argument("nodes_expr", metavar="NODES")
@click.option("--reason", required=True, help="Why (Slurm shows it; required, as for scontrol).")
def drain(nodes_expr: str, reason: str) -> None:
    """Drain NODES in Slurm: running jobs go on, no new work lands there."""
    if not reason.strip():
        raise click.BadParameter("must not be empty", param_hint="--reason")
    client = SlurmClient()
    require_admin("drain", client)
    nodes = _nodes(nodes_expr)
    client.drain(nodes, reason)
    click.echo(f"drained {','.join(nodes)}: {reason}")


@click.command("resume")
@click.argument("nodes_expr", metavar="NODES")
def resume(nodes_expr: str) -> None:
    """Return drained NODES to service (also the ones RAPS drained)."""
    client = SlurmClient()
    require_admin("resume", client)
    nodes = _nodes(nodes_expr)
    client.resume(nodes)
    click.echo(f"resumed {','.join(nodes)}")
