"""``rapsctl config``: check a config file and print the effective configuration."""

from __future__ import annotations

import json

import click
import yaml

from raps_slurm import config as cfgmod


@click.group()
def config() -> None:
    """Configuration commands."""


@config.command("check")
@click.argument("file", required=False, metavar="[FILE]")
@click.option("--json", "as_json", is_flag=True, help="Print the effective config as JSON.")
@click.pass_context
def check(ctx: click.Context, file: str | None, as_json: bool) -> None:
    """Check FILE (or the config found by the lookup order) and print the effective config.

    Exits 0 when valid; prints every error, one per line, and exits 2 otherwise.
    """
    path = cfgmod.find_config_path(file or ctx.obj.get("config_path"))
    cfg = cfgmod.load_file(path) if path is not None else cfgmod.Config()
    data = cfgmod.to_dict(cfg)
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=False))
    else:
        source = str(path) if path is not None else "built-in defaults"
        click.echo(f"# effective config from {source}")
        click.echo(yaml.safe_dump(data, sort_keys=False).rstrip())
