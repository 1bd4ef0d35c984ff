"""``rapsctl``: scontrol-style verbs for admins and job authors.

Every error a user can cause ends as one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import sys

import click

from raps_slurm.cli import (
    admin,
    bench,
    ckpt,
    config_cmd,
    etcd_roles,
    inspect_cmd,
    ping,
    show,
    simulate,
)
from raps_slurm.cli import jobs as _jobs  # noqa: F401  (adds show job, show groups)
from raps_slurm.cli import plans as _plans  # noqa: F401  (adds show plan, show recoveries)
from raps_slurm.cli import racks as _racks  # noqa: F401  (adds show racks)
from raps_slurm.cli import status as _status  # noqa: F401  (adds show status)
from raps_slurm.cli.output import echo
from raps_slurm.errors import ConfigError, RapsError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="FILE", envvar=None,
              help="Config file (default: $RAPS_CONFIG, then /etc/raps/raps.yaml, then built-in).")
@click.version_option(package_name="raps-slurm", prog_name="rapsctl")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None) -> None:
    """Inspect and steer raps-slurm."""
    ctx.obj = {"config_path": config_path}


cli.add_command(config_cmd.config)
cli.add_command(show.show)
cli.add_command(ping.ping)
cli.add_command(bench.bench)
cli.add_command(admin.drain)
cli.add_command(admin.resume)
cli.add_command(admin.cancel_plan)
cli.add_command(admin.update)
cli.add_command(etcd_roles.etcd_roles)
cli.add_command(ckpt.verify)
cli.add_command(ckpt.restore)
cli.add_command(inspect_cmd.inspect)
cli.add_command(simulate.simulate)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the click group and turn every error into one line."""
    try:
        rc = cli.main(args=argv, prog_name="rapsctl", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc), err=True)
        sys.exit(2)
    except click.UsageError as exc:
        where = f" {exc.ctx.command_path.removeprefix('rapsctl').strip()}" if exc.ctx else ""
        echo(f"rapsctl{where}: {exc.format_message()} (see --help)", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        echo(f"rapsctl: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("rapsctl: aborted", err=True)
        sys.exit(1)
    except ConfigError as exc:
        for line in exc.errors:
            echo(f"rapsctl: {line}", err=True)
        sys.exit(2)
    except RapsError as exc:
        echo(f"rapsctl: {exc}", err=True)
        sys.exit(1)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    sys.exit(rc if isinstance(rc, int) else 0)
