"""``rapsctl show checkpoints``, ``rapsctl verify``, ``rapsctl restore``: checkpoints of a job.

They read etcd and talk to the agents' transfer servers with the cluster key, so they
are for root (or whoever holds the store credentials and the key) on a cluster node.

``show checkpoints JOBID [--rank R]``: every recorded generation: size, chunks,
holders, state (``committed`` or ``under_replicated``), cold copy, holders found bad.
``verify JOBID [--rank R]``: every holder re-reads and checks every chunk of every
generation it holds; exit 1 if any copy is bad or missing.
``restore JOBID --rank R --out FILE``: a verified restore into a scratch store, the
state written to FILE as raw bytes (the items in manifest order; ``--manifest`` saves
the manifest next to it); a progress bar on a terminal.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from raps_slurm import config as cfgmod
from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.restore_parts import RestoreError
from raps_slurm.checkpoint.service import CheckpointService, peers_from_store, read_commits
from raps_slurm.checkpoint.transfer import TransferClient, TransferError
from raps_slurm.cli.output import echo, table
from raps_slurm.cli.show import show
from raps_slurm.config import Config
from raps_slurm.core.checkpoints import CkptRecord, attested, restore_order, same_commit
from raps_slurm.core.jobs import RankEntry
from raps_slurm.errors import RapsError, RecordError
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.wire.heartbeat import load_key


@contextmanager
def _store(ctx: click.Context) -> Iterator[tuple[Config, StateStore, Keys]]:
    cfg = cfgmod.load_config(ctx.obj.get("config_path"))
    store, keys = open_store(cfg.store)
    with store:
        yield cfg, store, keys


def _job(job_id: str) -> str:
    if not (job_id.isascii() and job_id.isdigit() and len(job_id) <= 20):
        raise click.BadParameter(f"{job_id!r}: expected a numeric Slurm job id",
                                 param_hint="JOBID")
    return job_id


def _records(store: StateStore, keys: Keys, job: str, rank: int | None
             ) -> list[CkptRecord]:
    prefix = keys.job_ckpts_prefix(job)
    if rank is not None:
        prefix = keys.ckpt_prefix(job, rank)
    out = []
    for kv in store.get_prefix(prefix):
        try:
            out.append(CkptRecord.from_json(kv.key, kv.value))
        except RecordError as exc:
            echo(f"rapsctl: skipping malformed record: {exc}", err=True)
    return sorted(out, key=lambda r: (r.rank, r.generation))


@show.command("checkpoints")
@click.argument("job_id")
@click.option("--rank", type=click.IntRange(0), default=None, help="Only this rank.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def show_checkpoints(ctx: click.Context, job_id: str, rank: int | None, as_json: bool) -> None:
    """Generations of a job's ranks: sizes, holders, state."""
    job = _job(job_id)
    with _store(ctx) as (_, store, keys):
        recs = _records(store, keys, job, rank)
        backed = _backed(store, keys, job, recs)
    if not recs and not as_json:
        raise click.ClickException(f"job {job} has no committed checkpoint"
                                   + (f" for rank {rank}" if rank is not None else ""))
    rows: list[dict[str, Any]] = [{"rank": r.rank, "generation": r.generation, "epoch": r.epoch,
             "size": r.total_size, "stored": r.stored_size, "chunks": r.chunks,
             "state": r.state, "holders": ",".join(r.holders), "replicas": r.replicas,
             "cold": "yes" if r.cold else "no", "bad": ",".join(r.bad) or "-",
             "committed": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(r.committed_at)),
             "attested": backed.get((r.rank, r.generation, r.epoch), "no")}
            for r in recs]
    if as_json:
        for row, r in zip(rows, recs, strict=True):
            row.update(holders=list(r.holders), bad=list(r.bad), cold=r.cold,
                       committed=r.committed_at, primary=r.primary,
                       manifest_digest=r.manifest_digest)
    table(rows, as_json, ["rank", "generation", "epoch", "size", "stored", "chunks", "state",
                          "holders", "cold", "bad", "attested", "committed"])


def _backed(store: StateStore, keys: Keys, job: str, recs: list[CkptRecord]
            ) -> dict[tuple[int, int, int], str]:
    """(rank, generation, epoch) -> ``yes`` for each shared record that the commit of the
    node that ran the rank at its epoch backs (what a restore may take: attested), else
    ``no (why)``."""
    out: dict[tuple[int, int, int], str] = {}
    for r in sorted({x.rank for x in recs}):
        shared = [x for x in recs if x.rank == r]
        kv = store.get(keys.job_rank(job, r))
        try:
            entry = RankEntry.from_json(kv.key, kv.value) if kv is not None else None
        except RecordError as exc:
            entry = None
            echo(f"rapsctl: {exc}", err=True)
        if entry is None:
            for x in shared:
                out[(r, x.generation, x.epoch)] = "no (no rank entry)"
            continue
        commits = read_commits(store, keys, job, r, {entry.node, *(n for _, n in entry.placed)},
                               lambda exc: echo(f"rapsctl: skipping malformed commit: {exc}",
                                                err=True))
        found, _ = attested(r, shared, commits, entry.node_at)
        for x in shared:
            ok = any(same_commit(f, x) for f in found)
            out[(r, x.generation, x.epoch)] = "yes" if ok else "no (no matching commit)"
    return out


def _client(cfg: Config, key: bytes, address: tuple[str, int], node: str) -> TransferClient:
    return TransferClient(key, f"rapsctl@{socket.gethostname()}", address, peer=node)


@click.command("verify")
@click.argument("job_id")
@click.option("--rank", type=click.IntRange(0), default=None, help="Only this rank.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def verify(ctx: click.Context, job_id: str, rank: int | None, as_json: bool) -> None:
    """Re-read and check every chunk of every generation on every holder."""
    job = _job(job_id)
    with _store(ctx) as (cfg, store, keys):
        key = load_key(cfg.detection.cluster_key_file)
        recs = _records(store, keys, job, rank)
        peers = peers_from_store(store, keys)()
    if not recs:
        raise click.ClickException(f"job {job} has no committed checkpoint")
    rows: list[dict[str, Any]] = []
    for r in recs:
        for holder in r.holders:
            row: dict[str, Any] = {"rank": r.rank, "generation": r.generation,
                                   "holder": holder, "chunks": 0, "result": "", "bad": []}
            if holder not in peers:
                row["result"] = "unreachable (no live agent)"
            else:
                try:
                    with _client(cfg, key, peers[holder], holder) as client:
                        got = client.verify(job, r.rank, r.generation)
                    row["chunks"] = got.get("chunks", 0)
                    row["bad"] = got.get("bad", [])
                    row["result"] = ("missing" if not got.get("found") else
                                     f"BAD ({len(row['bad'])} chunk(s))" if row["bad"]
                                     else "ok")
                except TransferError as exc:
                    row["result"] = f"error: {exc}"
            rows.append(row)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        table([{**x, "bad": ",".join(b["digest"][:16] for b in x["bad"]) or "-"} for x in rows],
              False, ["rank", "generation", "holder", "chunks", "result", "bad"])
    if any(x["result"] != "ok" for x in rows):
        ctx.exit(1)


@click.command("restore")
@click.argument("job_id")
@click.option("--rank", type=click.IntRange(0), required=True, help="The rank to restore.")
@click.option("--out", "out", type=click.Path(dir_okay=False, writable=True), required=True,
              help="File for the restored state (raw bytes of the items in order).")
@click.option("--manifest", "manifest_out", type=click.Path(dir_okay=False, writable=True),
              default=None, help="Also write the generation's manifest (JSON) here.")
@click.option("--scratch", default=None, metavar="DIR",
              help="Scratch dir for pulled chunks (default: $TMPDIR); removed at the end.")
@click.pass_context
def restore(ctx: click.Context, job_id: str, rank: int, out: str, manifest_out: str | None,
            scratch: str | None) -> None:
    """Restore a rank's newest verified generation from its holders into a file."""
    job = _job(job_id)
    tmp = Path(tempfile.mkdtemp(prefix="raps-restore-", dir=scratch))
    try:
        with _store(ctx) as (cfg, store, keys):
            key = load_key(cfg.detection.cluster_key_file)
            recs = restore_order(_records(store, keys, job, rank))
            total = recs[0].total_size if recs else 0
            svc = CheckpointService(cfg, store, keys, f"rapsctl@{socket.gethostname()}", key,
                                    ChunkStore(tmp))
            with _progress(total) as advance:
                svc.local.progress = advance
                try:
                    result = svc.restore(job, rank)
                except RestoreError as exc:
                    raise click.ClickException(str(exc)) from None
        if result is None:
            raise click.ClickException(f"rank {rank} of job {job} has no committed checkpoint")
        r = result.restored
        with open(out, "wb") as f:
            if r.buffer is not None:
                f.write(r.buffer)
        if manifest_out:
            Path(manifest_out).write_bytes(r.manifest.to_json())
        r.close()
        for fb in result.fallbacks:
            echo(f"rapsctl: generation {fb.generation} skipped: {fb.reason}", err=True)
        click.echo(f"restored rank {rank} of job {job} from generation {result.generation}: "
                   f"{r.manifest.total_size} bytes to {out}")
    except RapsError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _progress(total: int) -> Iterator[Any]:
    """A rich progress bar over restored bytes on a terminal; a no-op elsewhere."""
    if not sys.stderr.isatty() or total < (64 << 20) or os.environ.get("TERM") == "dumb":
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), transient=True) as bar:
        task = bar.add_task("restore", total=total)
        yield lambda n: bar.update(task, advance=n)
