"""``rapsctl etcd-roles``: the least-privilege etcd roles and users of RAPS.

Prints the ``etcdctl`` commands, or applies them with ``--apply`` (docs/store.md, Roles).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from raps_slurm import config as cfgmod
from raps_slurm.errors import RapsError, SlurmParseError
from raps_slurm.slurm.parsers import expand
from raps_slurm.store import EtcdStore, Keys, open_store
from raps_slurm.store.etcd_auth import apply_roles
from raps_slurm.store.roles import etcdctl_commands, roles
from raps_slurm.wire.heartbeat import is_node_name


@click.command("etcd-roles")
@click.option("--apply", "apply_", is_flag=True,
              help="Create or update the roles and users in etcd instead of printing etcdctl "
                   "commands (needs etcd's root user, or auth not enabled yet).")
@click.option("--user", metavar="NAME", default=None,
              help="etcd user for --apply, normally root (default: the config's store.user "
                   "or client certificate).")
@click.option("--password-file", metavar="FILE", default=None,
              help="File holding that user's password (with --user).")
@click.option("--password-dir", metavar="DIR", default=None,
              type=click.Path(file_okay=False, path_type=Path),
              help="With --apply: a new user's password is DIR/<user>.password, made there "
                   "(mode 0600) when missing. Without it new users get no password "
                   "(client certificates, CN = user name).")
@click.option("--no-password", is_flag=True,
              help="When printing: users without a password (client certificates).")
@click.option("--nodes", metavar="NODESET", default="",
              help="Also the role and user raps-agent-<node> of each of these compute nodes, "
                   "in hostlist form (e.g. 'n[001-128]'). Nodes not named are left as they "
                   "are.")
@click.pass_context
def etcd_roles(ctx: click.Context, apply_: bool, user: str | None, password_file: str | None,
               password_dir: Path | None, no_password: bool, nodes: str) -> None:
    """The etcd roles raps-coordinator, raps-hooks, raps-agent and raps-admin, a user of
    the same name for each but raps-agent, and a role and user raps-agent-<node> for each
    node of --nodes: print the etcdctl commands, or --apply them."""
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    keys = Keys(cfg.store.prefix)
    names = _node_names(nodes)
    if not apply_:
        if password_dir is not None:
            raise click.UsageError("--password-dir goes with --apply")
        for line in etcdctl_commands(keys, no_password, names):
            click.echo(line)
        return
    sc = cfg.store
    if (user is None) != (password_file is None):
        raise click.UsageError("--user and --password-file go together (for a client "
                               "certificate, the config's store.cert_file names the user)")
    if user is not None and password_file is not None:
        sc = dataclasses.replace(sc, user=user, password_file=password_file)
    store, _ = open_store(sc)
    if not isinstance(store, EtcdStore):
        raise RapsError("etcd-roles --apply needs etcd")
    with store:
        changes = apply_roles(store, roles(keys, names), password_dir)
    for line in changes or ["roles and users already as wanted: nothing changed"]:
        click.echo(line)


def _node_names(nodes: str) -> tuple[str, ...]:
    """The node names of ``--nodes``; a usage error naming what is wrong."""
    if not nodes:
        return ()
    try:
        names = expand(nodes)
    except SlurmParseError as exc:
        raise click.BadParameter(str(exc), param_hint="--nodes") from None
    bad = [n for n in names if not is_node_name(n)]
    if bad or not names:
        raise click.BadParameter(f"{bad[0] if bad else nodes!r} is no node name (letters, "
                                 "digits, '.', '-', '_')", param_hint="--nodes")
    return names
