"""``rapsctl config``: check a config file and print the effective configuration."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import click
import yaml

from raps_slurm import config as cfgmod

_HEADER = """\
# raps-slurm configuration: every key with its default.
# Lookup order: --config FILE, $RAPS_CONFIG, /etc/raps/raps.yaml, built-in defaults.
# A file needs only the keys it changes. Check one with: rapsctl config check FILE
"""


def _yaml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(f"'{v}'" for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value) if value else "{}"
    if value == "":
        return "''"
    return str(yaml.safe_dump(value, default_flow_style=True)).removesuffix("\n...\n").strip()


def reference() -> str:
    """Every key with its default and its one-line description: ``configs/raps.yaml``."""
    out = [_HEADER.rstrip("\n")]
    defaults = cfgmod.to_dict(cfgmod.Config())
    for sec in dataclasses.fields(cfgmod.Config):
        cls = typing.get_type_hints(cfgmod.Config)[sec.name]
        out += ["", f"# {(cls.__doc__ or '').strip()}", f"{sec.name}:"]
        for f in dataclasses.fields(cls):
            line = f"  {f.name}: {_yaml_value(defaults[sec.name][f.name])}"
            out.append(line.ljust(46) + "# " + f.metadata["doc"])
    return "\n".join(out) + "\n"


@click.group()
def config() -> None:
    """Configuration commands."""


@config.command("check")
@click.argument("file", required=False, metavar="[FILE]")
@click.option("--json", "as_json", is_flag=True, help="Print the effective config as JSON.")
@click.pass_context
def check(ctx: click.Context, file: str | None, as_json: bool) -> None:
    """Check FILE (or the config found by the lookup order) and print the effective config.

    Then the etcd budget, one term per line (as YAML comments): the most the agents'
    writes for ranks can hold in etcd against its allowed share of the quota. Exits 0
    when valid; prints every error, one per line, and exits 2 otherwise, also when the
    agents' writes could fill etcd (naming the keys to change).
    """
    from raps_slurm.core.budget import etcd_budget
    from raps_slurm.errors import ConfigError

    path = cfgmod.find_config_path(file or ctx.obj.get("config_path"))
    cfg = cfgmod.load_file(path) if path is not None else cfgmod.Config()
    data = cfgmod.to_dict(cfg)
    budget = etcd_budget(cfg)
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=False))
    else:
        source = str(path) if path is not None else "built-in defaults"
        click.echo(f"# effective config from {source}")
        click.echo(yaml.safe_dump(data, sort_keys=False).rstrip())
        click.echo("# etcd budget (docs/store.md, Budget):")
        for line in budget.lines():
            click.echo(f"#   {line}")
    if not budget.fits:
        raise ConfigError([f"etcd budget: {p}" for p in budget.problems])


@config.command("defaults")
def defaults() -> None:
    """Print every key with its default and description (the shipped configs/raps.yaml)."""
    click.echo(reference(), nl=False)


@config.command("create-key")
@click.argument("file", required=False, metavar="[FILE]")
@click.pass_context
def create_key_cmd(ctx: click.Context, file: str | None) -> None:
    """Create the cluster key that signs heartbeats (default: detection.cluster_key_file).

    64 random bytes, mode 0600; copy it to every node like munge.key. Refuses to
    overwrite an existing key.
    """
    from raps_slurm.wire.heartbeat import create_key

    path = file or cfgmod.load_config(ctx.obj.get("config_path")).detection.cluster_key_file
    create_key(path)
    click.echo(f"created {path}")


_F = typing.TypeVar("_F", bound=typing.Callable[..., typing.Any])


def _per_node_file(what: str) -> typing.Callable[[_F], _F]:
    """The NODE... argument and the --out and --cluster-key options of a command that
    writes one file per node, derived from the cluster key."""

    def wrap(f: _F) -> _F:
        f = click.option("--cluster-key", "cluster_key", default=None, metavar="FILE",
                         help="The cluster key to derive from (default: "
                              "detection.cluster_key_file; during a rollover, the new "
                              "key).")(f)
        f = click.option("--out", "out", required=True, metavar="FILE",
                         help=f"Where to write the {what} (mode 0600; never over an "
                              "existing file); %n becomes the node name (needed for more "
                              "than one node).")(f)
        return click.argument("nodes", nargs=-1, required=True, metavar="NODE...")(f)

    return wrap


@config.command("node-key")
@_per_node_file("key")
@click.pass_context
def node_key_cmd(ctx: click.Context, nodes: tuple[str, ...], out: str,
                 cluster_key: str | None) -> None:
    """Write each NODE's own heartbeat key, derived from the cluster key (on the head node).

    Install it on that node only, at its detection.node_key_file (mode 0600): the agent
    of NODE then signs with a key that no other node holds.
    """
    from raps_slurm.config import node_dir
    from raps_slurm.errors import ConfigError
    from raps_slurm.wire.heartbeat import create_node_key, load_key

    if len(nodes) > 1 and "%n" not in out:
        raise ConfigError([f"--out {out}: name the node with %n when writing "
                           f"{len(nodes)} keys"])
    path = cluster_key or cfgmod.load_config(ctx.obj.get("config_path")).detection.cluster_key_file
    key = load_key(path)
    for node in nodes:
        create_node_key(node_dir(out, node), key, node)
        click.echo(f"created {node_dir(out, node)} (the key of {node}; install it on "
                   f"{node} only)")


@config.command("transfer-tickets")
@_per_node_file("tickets")
@click.option("--peers", "peers", required=True, metavar="NODESET",
              help="Every node NODE may send chunks to or fetch them from, in Slurm's "
                   "hostlist form (e.g. 'n[001-128]'): usually all compute nodes.")
@click.pass_context
def transfer_tickets_cmd(ctx: click.Context, nodes: tuple[str, ...], peers: str, out: str,
                         cluster_key: str | None) -> None:
    """Write each NODE's chunk transfer tickets, derived from the cluster key (on the head
    node).

    Install the file on that node only, at its detection.transfer_tickets_file (mode 0600),
    next to its node key: its agent then reads no cluster key. Remake every node's tickets
    when nodes are added.
    """
    from raps_slurm.checkpoint.peer_keys import create_tickets
    from raps_slurm.config import node_dir
    from raps_slurm.errors import BadDatagram, ConfigError, SlurmParseError
    from raps_slurm.slurm.parsers import expand
    from raps_slurm.wire.heartbeat import load_key

    if len(nodes) > 1 and "%n" not in out:
        raise ConfigError([f"--out {out}: name the node with %n when writing "
                           f"{len(nodes)} ticket files"])
    try:
        servers = list(expand(peers))
    except SlurmParseError as exc:
        raise click.BadParameter(str(exc), param_hint="--peers") from None
    if not servers:
        raise click.BadParameter(f"{peers!r} names no node", param_hint="--peers")
    path = cluster_key or cfgmod.load_config(ctx.obj.get("config_path")).detection.cluster_key_file
    key = load_key(path)
    for node in nodes:
        try:
            n = create_tickets(node_dir(out, node), key, node, servers)
        except BadDatagram as exc:  # a name that is no node name
            raise click.BadParameter(str(exc), param_hint="NODE or --peers") from None
        click.echo(f"created {node_dir(out, node)} ({n} tickets of {node}; install it on "
                   f"{node} only)")
