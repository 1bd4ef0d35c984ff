"""``rapsctl inspect --job J --message-log``: the message layer of a running job, per rank pair.

Ranks report their figures through their agents every ``messagelog.stats_interval_sec``
(``reports/ranks/<node>/<id>/msgstats/<rank>``); ``--local DIR`` reads those of a local run
(``python -m raps_slurm.runtime.local --dir DIR``). For each pair ``s->d``: messages
``s`` sent to ``d``, what ``d`` delivered from ``s``, the range ``s`` still has in its
log, up to where ``s`` collected (``d``'s oldest kept checkpoint covers it), and a gap
(``d`` holds later messages and waits for a missing one). Per rank: log buffer use
against the high watermark, bodies spilled, duplicates dropped, stale frames refused.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from raps_slurm import config as cfgmod
from raps_slurm.cli.output import echo, table
from raps_slurm.store import open_store


def _from_store(ctx: click.Context, job: str) -> dict[int, dict[str, Any]]:
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    store, keys = open_store(cfg.store)
    out: dict[int, dict[str, Any]] = {}
    with store:
        for kv in store.get_prefix(keys.rank_reports_root()):
            parts = keys.split(kv.key)[2:]  # <node>/<job>/msgstats/<rank>
            if len(parts) != 4 or parts[1] != job or parts[2] != "msgstats":
                continue
            rank = parts[3]
            try:
                value = json.loads(kv.value)
                age = time.time() - float(value["at"])
                if int(rank) not in out or age < out[int(rank)]["age"]:  # moved: the newest
                    out[int(rank)] = {**value["stats"], "age": age}
            except (ValueError, KeyError, TypeError):
                echo(f"rapsctl: skipping malformed {kv.key}", err=True)
    return out


def _from_dir(directory: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for p in sorted(Path(directory, "peers").glob("*.stats")):
        if p.stem.isdigit():
            try:
                out[int(p.stem)] = {**json.loads(p.read_text()),
                                    "age": time.time() - p.stat().st_mtime}
            except (OSError, ValueError):
                echo(f"rapsctl: skipping unreadable {p}", err=True)
    return out


def pairs(ranks: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per ordered pair that exchanged anything."""
    rows = []
    for s, st in sorted(ranks.items()):
        for d_text, p in sorted(st.get("peers", {}).items(), key=lambda x: int(x[0])):
            d = int(d_text)
            recv = ranks.get(d, {}).get("peers", {}).get(str(s), {})
            sent = int(p.get("sent", 0))
            delivered = recv.get("delivered")
            if not sent and not delivered:
                continue
            logged = p.get("logged")
            gap = recv.get("early") or []
            rows.append({"pair": f"{s}->{d}", "sent": sent,
                         "delivered": "?" if delivered is None else delivered,
                         "logged": f"{logged[0]}-{logged[1]}" if logged else "-",
                         "collected_upto": p.get("collected_upto", 0),
                         "gap": (f"waits {int(delivered) + 1}, holds {gap[0]}-{gap[-1]}"
                                 if gap and delivered is not None else "-")})
    return rows


@click.command("inspect")
@click.option("--job", "job", default=None, help="Slurm job id (reads etcd).")
@click.option("--local", "local_dir", default=None, metavar="DIR",
              help="A local run's directory instead of a job.")
@click.option("--message-log", "message_log", is_flag=True, required=True,
              help="Show the message layer (the only view so far).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def inspect(ctx: click.Context, job: str | None, local_dir: str | None, message_log: bool,
            as_json: bool) -> None:
    """Per rank pair: sent, delivered, logged and collected ranges, gaps; buffer use."""
    if (job is None) == (local_dir is None):
        raise click.UsageError("give exactly one of --job JOBID and --local DIR")
    if job is not None and not (job.isascii() and job.isdigit()):
        raise click.BadParameter(f"{job!r}: expected a numeric Slurm job id",
                                 param_hint="--job")
    ranks = _from_store(ctx, job) if job is not None else _from_dir(str(local_dir))
    if not ranks:
        raise click.ClickException("no message-log figures reported yet "
                                   f"for {'job ' + job if job else local_dir}")
    rows = pairs(ranks)
    per_rank = [{"rank": r, "epoch": st.get("epoch"), "generation": st.get("generation"),
                 "buffer": f"{st.get('buffer_bytes', 0)}/{st.get('high_watermark', 0)}",
                 "peak": st.get("buffer_peak", 0), "spilled": st.get("spilled", 0),
                 "duplicates": st.get("duplicates", 0),
                 "stale_refused": st.get("refused_stale_frames", 0)
                 + st.get("refused_hellos", 0),
                 "age_s": round(float(st.get("age", 0)), 1)} for r, st in sorted(ranks.items())]
    if as_json:
        click.echo(json.dumps({"pairs": rows, "ranks": per_rank}, indent=2))
        return
    table(rows, False, ["pair", "sent", "delivered", "logged", "collected_upto", "gap"])
    click.echo("")
    table(per_rank, False, ["rank", "epoch", "generation", "buffer", "peak", "spilled",
                            "duplicates", "stale_refused", "age_s"])
