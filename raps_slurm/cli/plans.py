"""``rapsctl show recoveries [JOBID]`` and ``rapsctl show plan ID``: what recovery did.

A plan relaunches one rank of one job on a target node with a new epoch; its timeline
runs from the fault verdict to the rank running again after its replay.
"""

from __future__ import annotations

import json
import time

import click

from raps_slurm import config as cfgmod
from raps_slurm.cli.jobs import _store
from raps_slurm.cli.output import echo, table
from raps_slurm.cli.show import show
from raps_slurm.cli.userdoor import as_user, ask
from raps_slurm.coordinator.recovery import plans_in_order, read_plans
from raps_slurm.core.planner import plan_dict


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"


@show.command("recoveries")
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_context
def show_recoveries(ctx: click.Context, job_id: str | None, as_json: bool) -> None:
    """Recovery plans of job JOBID (of every job without it), oldest first."""
    if job_id is not None and not (job_id.isascii() and job_id.isdigit()):
        raise click.BadParameter(f"{job_id!r} is not a job id", param_hint="JOBID")
    if as_user():
        if job_id is None:
            raise click.UsageError("name a job: users see their own jobs (show recoveries "
                                   "JOBID)")
        rows = ask(cfgmod.load_config(ctx.obj.get("config_path")), "recoveries", job_id)
    else:
        with _store(ctx) as (store, keys):
            book = read_plans(store, keys)
        plans = plans_in_order(p for p, _ in book.plans.values()
                               if job_id is None or p.job == job_id)
        rows = [plan_dict(p, book.events.get(p.plan_id, {})) for p in plans]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("No recovery plans" + (f" for job {job_id}." if job_id else "."))
        return
    table([{**r, "move": f"{r['source']}->{r['target']}",
            **{k: "-" if r[k] is None else f"{r[k]:.2f}" for k in ("running_s", "caught_up_s")},
            "created": _clock(r["timeline"][0]["at"]) if r["timeline"] else "-"}
           for r in rows], False,
          ["plan_id", "job", "rank", "move", "epoch", "state", "created", "running_s",
           "caught_up_s", "reason"])


@show.command("plan")
@click.argument("plan_id")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_context
def show_plan(ctx: click.Context, plan_id: str, as_json: bool) -> None:
    """One recovery plan and its timeline: verdict, plan, start, launch, restore, running
    again, caught up."""
    with _store(ctx) as (store, keys):
        book = read_plans(store, keys)
    if plan_id not in book.plans:
        raise click.ClickException(f"no plan {plan_id!r} (rapsctl show recoveries lists them)")
    plan = book.plans[plan_id][0]
    d = plan_dict(plan, book.events.get(plan_id, {}))
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    echo(f"Plan {plan.plan_id}: job {plan.job} run {plan.run} rank {plan.rank} "
         f"{plan.source} -> {plan.target} epoch {plan.epoch}: {plan.state}")
    for row in d["timeline"]:
        echo(f"  {_clock(row['at'])}  +{row['after_s']:7.3f}s  {row['phase']:<13}  "
             f"{row['what']}")
