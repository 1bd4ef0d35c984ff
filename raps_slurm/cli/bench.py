"""``rapsctl bench``: the options of each benchmark and its one JSON object on stdout.

The measuring code is in ``raps_slurm.bench`` (one module per benchmark); this module
only parses options and prints. ``detect``, ``loss``, ``recovery``, ``efficiency``, ``faults``
and ``launch`` bring up their own private 6-node cluster (scripts/cluster.sh wiring, ports
from ``--port``, run dir in /tmp) and take it down at the end; ``heartbeats`` and ``churn``
start a throw-away etcd; ``checkpoint``, ``messaging`` and ``simulate`` run on this
machine alone; ``mpi`` and ``osu`` run the same mpi4py program under RAPS and under
Open MPI here. docs/benchmarks.md says what each one measures and what it found.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from raps_slurm import config as cfgmod
from raps_slurm.bench import (
    checkpoint,
    churn,
    detect,
    heartbeats,
    loss,
    messaging,
    mpi,
    osu,
    recovery,
)
from raps_slurm.bench.faults import run_faults
from raps_slurm.bench.launch import run_launch
from raps_slurm.bench.simulate import run_simulate
from raps_slurm.checkpoint.codec import CodecParams

_JSON_HELP = "JSON only (the default prints it too)."
_F = TypeVar("_F", bound=Callable[..., Any])


def _echo(result: dict[str, Any]) -> None:
    click.echo(json.dumps(result))


def _say(as_json: bool) -> Callable[[str], None]:
    """Progress lines on stderr, none with ``--json``."""
    def say(line: str) -> None:
        if not as_json:
            print(line, file=sys.stderr, flush=True)
    return say


def _size(text: str, option: str) -> int:
    """A size option in bytes, or one line naming the option and what is allowed."""
    try:
        return checkpoint.parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


def _port(default: int, what: str = "Base port of the benchmark cluster.") -> Callable[[_F], _F]:
    """The --port option of a benchmark that brings up its own cluster."""
    return click.option("--port", default=default, show_default=True,
                        type=click.IntRange(1024, 60000), help=what)


def _interval(help_text: str = "Kernel heartbeat interval (seconds).") -> Callable[[_F], _F]:
    """The --interval option (detection of the benchmark cluster)."""
    return click.option("--interval", default=1.0, show_default=True,
                        type=click.FloatRange(0.05, 10), help=help_text)


@click.group()
def bench() -> None:
    """Benchmarks that print one JSON object (they are commands, not tests)."""


@bench.command("detect")
@click.option("--runs", default=5, show_default=True, type=click.IntRange(1, 100),
              help="Node crashes to measure.")
@_interval()
@_port(19000)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
def bench_detect(runs: int, interval: float, port: int, as_json: bool) -> None:
    """Crash nodes; time raps-slurm's DEAD verdict and Slurm's DOWN side by side."""
    _echo(detect.run_detect(runs, interval, port, quiet=as_json))


@bench.command("loss")
@click.option("--minutes", default=10.0, show_default=True, type=click.FloatRange(0.5, 1440),
              help="How long to watch for false verdicts and fences.")
@click.option("--loss", "share", default=0.3, show_default=True,
              type=click.FloatRange(0, 0.95),
              help="Share of heartbeats every agent drops (--heartbeat-loss).")
@click.option("--jitter", default=0.3, show_default=True, type=click.FloatRange(0, 5),
              help="Each heartbeat delayed by up to this many seconds (--heartbeat-jitter).")
@_port(19700)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
def bench_loss(minutes: float, share: float, jitter: float, port: int, as_json: bool) -> None:
    """Lossy, jittery heartbeats and no crash: count false DEAD verdicts and false fences."""
    _echo(loss.run_loss(minutes, share, jitter, port, quiet=as_json))


@bench.command("heartbeats")
@click.option("--nodes", default=50000, show_default=True,
              type=click.IntRange(heartbeats.STOPPED + 1, 10**6),
              help="Synthetic nodes, one heartbeat per second each.")
@click.option("--seconds", default=60, show_default=True, type=click.IntRange(5, 3600),
              help="Measurement window after the warm-up.")
@click.option("--port", default=19500, show_default=True, type=click.IntRange(1024, 65000),
              help="UDP port of the coordinator on 127.0.0.1.")
@click.option("--receivers", default=1, show_default=True, type=click.IntRange(1, 64),
              help="The coordinator's --heartbeat-receivers (processes on its UDP port).")
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
def bench_heartbeats(nodes: int, seconds: int, port: int, receivers: int, as_json: bool) -> None:
    """One raps-coordinator receiving N nodes' signed heartbeats at 1 Hz over loopback."""
    _echo(heartbeats.run_heartbeats(nodes, seconds, port, receivers, _say(as_json)))


@bench.command("checkpoint")
@click.option("--size", default="1GiB", show_default=True, help="State size (e.g. 1GiB, 256MiB).")
@click.option("--change", default=0.1, show_default=True, type=click.FloatRange(0, 1),
              help="Share of the state changed before the incremental save.")
@click.option("--seed", default=1, show_default=True, type=int, help="Data and change seed.")
@click.option("--avg-chunk-kb", default=None, type=click.IntRange(1, 4096),
              help="Override checkpoint.avg_chunk_kb.")
@click.option("--digest", type=click.Choice(["blake3", "sha256"]), default=None,
              help="Override checkpoint.digest.")
@click.option("--zstd-level", default=None, type=click.IntRange(1, 19),
              help="Override checkpoint.zstd_level.")
@click.option("--shuffle/--no-shuffle", default=None, help="Override checkpoint.shuffle.")
@click.option("--dir", "directory", default=None, metavar="DIR",
              help="Where the temporary store goes (default: $TMPDIR); removed at the end.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only (the default output).")
@click.pass_context
def bench_checkpoint(ctx: click.Context, size: str, change: float, seed: int,
                     avg_chunk_kb: int | None, digest: str | None, zstd_level: int | None,
                     shuffle: bool | None, directory: str | None, as_json: bool) -> None:
    """Full, incremental and restore throughput against this machine's limits."""
    cfg = cfgmod.load_config(ctx.obj.get("config_path")).checkpoint
    params = CodecParams(avg_chunk_kb=avg_chunk_kb or cfg.avg_chunk_kb,
                         digest=digest or cfg.digest,
                         zstd_level=zstd_level or cfg.zstd_level,
                         shuffle=cfg.shuffle if shuffle is None else shuffle)
    nbytes = _size(size, "--size")
    _echo(checkpoint.run_bench(nbytes, change, seed, params, directory))


@bench.command("messaging")
@click.option("--size", default="4KiB", show_default=True, help="Small message size.")
@click.option("--count", default=20000, show_default=True, type=click.IntRange(1),
              help="Small messages per run.")
@click.option("--large-size", default="8MiB", show_default=True,
              help="Large message size (above the large-message threshold).")
@click.option("--large-count", default=20, show_default=True, type=click.IntRange(1),
              help="Large messages per run (their bodies stay under the high watermark).")
@click.option("--repeat", default=5, show_default=True, type=click.IntRange(1, 20),
              help="Runs per figure; the fastest counts.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only (the default output).")
@click.pass_context
def bench_messaging(ctx: click.Context, size: str, count: int, large_size: str,
                    large_count: int, repeat: int, as_json: bool) -> None:
    """Logged against unlogged throughput of the runtime's send/recv."""
    base = messaging.settings(cfgmod.load_config(ctx.obj.get("config_path")))
    small, large = _size(size, "--size"), _size(large_size, "--large-size")
    if large <= base.large_threshold:
        raise click.BadParameter(f"{large_size} is not above the large-message threshold "
                                 f"({base.large_threshold} bytes)", param_hint="--large-size")
    _echo(messaging.run_messaging(base, small, count, large, large_count, repeat))


@bench.command("mpi")
@click.option("--iterations", default=8, show_default=True, type=click.IntRange(1, 1000),
              help="Timed round trips (8-byte ones: 100 times as many) and allreduces "
                   "per launch.")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(0, 100),
              help="Untimed iterations before them.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50),
              help="Launches of each program per MPI; the median counts.")
@click.option("--blocks", default=mpi.BLOCKS, show_default=True, type=click.IntRange(1, 50),
              help="Timed blocks of each measure per launch; the fastest counts.")
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
def bench_mpi(iterations: int, warmup: int, repeats: int, blocks: int, as_json: bool) -> None:
    """The same mpi4py program under RAPS and Open MPI (TCP): bandwidth, latency,
    allreduce."""
    _echo(mpi.run_mpi(iterations, repeats, warmup, _say(as_json), blocks))


@bench.command("osu")
@click.option("--iterations", default=8, show_default=True, type=click.IntRange(1, 1000),
              help="Timed round trips per size (below 64 KiB: 100 times as many).")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(0, 100),
              help="Untimed round trips before them.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50),
              help="Launches of each of the four runs; the median counts.")
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
def bench_osu(iterations: int, warmup: int, repeats: int, as_json: bool) -> None:
    """Latency and bandwidth from 8 B to 4 MiB, RAPS beside Open MPI: over TCP, and on
    each one's default path between ranks of one host."""
    _echo(osu.run_osu(iterations, repeats, warmup, say=_say(as_json)))


@bench.command("recovery")
@click.option("--state", "state_text", default="1GiB", show_default=True,
              help="Extra state of the crashed rank (e.g. 256MiB, 1GiB).")
@click.option("--ranks-per-node", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Ranks on each node; every rank of the crashed node holds --state.")
@click.option("--runs", default=5, show_default=True, type=click.IntRange(1, 100),
              help="Jobs, one crash each; p50 and p90 over them.")
@click.option("--checkpoint-sec", default=1, show_default=True,
              type=click.IntRange(1, 3600),
              help="Seconds between checkpoints (production: 600, configs/raps.yaml).")
@click.option("--seed", default=1, show_default=True, type=int,
              help="Draws each crash's point in the checkpoint interval.")
@click.option("--program", default="heat_ring", show_default=True,
              type=click.Choice(recovery.PROGRAMS),
              help="heat_ring (sleeping steps); compute: Jacobi sweeps, or sleep: the same "
                   "program sleeping, both timing each step (replay_speed).")
@_interval("Kernel heartbeat interval (seconds); 3 misses + 0.5 s make a DEAD verdict.")
@_port(19200)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
def bench_recovery(state_text: str, ranks_per_node: int, runs: int, checkpoint_sec: int,
                   seed: int, program: str, interval: float, port: int,
                   as_json: bool) -> None:
    """Crash a node whose ranks each hold --state bytes at a random point of the
    checkpoint interval; time each phase of their move."""
    _echo(recovery.run_recovery(_size(state_text, "--state"), interval, port, ranks_per_node,
                                runs, checkpoint_sec, seed, quiet=as_json, program=program))


@bench.command("efficiency")
@click.option("--steps", default=400, show_default=True, type=click.IntRange(100, 100000),
              help="Steps of the application (each --step-sec of work).")
@click.option("--step-sec", default=0.05, show_default=True, type=click.FloatRange(0.001, 10))
@_interval()
@_port(19300)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
def bench_efficiency(steps: int, step_sec: float, interval: float, port: int,
                     as_json: bool) -> None:
    """The same failure, recovered by raps-slurm and by a whole-job restart: useful work."""
    _echo(recovery.run_efficiency(steps, step_sec, interval, port))


@bench.command("restart")
@click.option("--state", "state_text", default="256MiB", show_default=True,
              help="Plate held by each of the 4 ranks (e.g. 64MiB, 256MiB).")
@click.option("--steps", default=60, show_default=True, type=click.IntRange(4, 100000),
              help="Steps of the stencil.")
@click.option("--every", default=10, show_default=True, type=click.IntRange(1, 100000),
              help="Steps between checkpoints.")
@click.option("--crash-after", default=2, show_default=True, type=click.IntRange(1, 1000),
              help="Checkpoints committed before the crash (half-way to the next).")
@_interval("Kernel heartbeat interval (seconds) of RAPS's detection.")
@_port(19500)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
def bench_restart(state_text: str, steps: int, every: int, crash_after: int, interval: float,
                  port: int, as_json: bool) -> None:
    """The C stencil loses a node: restarted by RAPS within the allocation, then by a
    plain Slurm requeue; the time each takes to get back to the pre-fault step."""
    from raps_slurm.bench import restart  # here: this command's hunk stays in one place
    if (crash_after + 1) * every > steps:
        raise click.BadParameter(f"the crash at checkpoint {crash_after} + half an interval "
                                 f"needs more than {steps} steps", param_hint="--steps")
    _echo(restart.run_restart(_size(state_text, "--state"), steps, every, crash_after,
                              interval, port, _say(as_json)))


@bench.command("launch")
@click.option("--nodes", default=6, show_default=True, type=click.IntRange(1, 6),
              help="Nodes of each job (the benchmark cluster has 6).")
@click.option("--ranks-per-node", default=16, show_default=True, type=click.IntRange(1, 64),
              help="Ranks on each node.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 20),
              help="Jobs of each kind; the medians count.")
@_port(19900)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
def bench_launch(nodes: int, ranks_per_node: int, repeats: int, port: int,
                 as_json: bool) -> None:
    """raps-run against plain srun: seconds until every rank runs, batch-host processes."""
    _echo(run_launch(nodes, ranks_per_node, repeats, port, quiet=as_json))


@bench.command("faults")
@click.option("--runs", default=30, show_default=True, type=click.IntRange(1, 1000),
              help="Jobs, each with 1-3 nodes crashed, frozen or (--net ns) partitioned.")
@click.option("--seed", default=1, show_default=True, type=int,
              help="Draws the programs, the nodes, the kinds and the times.")
@click.option("--net", type=click.Choice(["lo", "ns"]), default="lo", show_default=True,
              help="lo: the cluster on loopback; ns: each node in a network namespace, "
                   "and partitions among the faults.")
@_port(20800)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
def bench_faults(runs: int, seed: int, net: str, port: int, as_json: bool) -> None:
    """A seeded fault campaign: heat_ring and random programs under node faults, judged
    against their failure-free results."""
    _echo(run_faults(runs, seed, port, quiet=as_json, net=net))


@bench.command("simulate")
@click.option("--nodes", type=click.IntRange(10, 10_000_000), default=10_000, show_default=True,
              help="Nodes in the cluster: 97 % working, 2 % spares, 1 % idle.")
@click.option("--years", type=click.FloatRange(0.01, 100), default=1.0, show_default=True,
              help="Simulated years.")
@click.option("--mtbf-h", type=click.FloatRange(1, 1e9), default=43_800.0, show_default=True,
              help="Node MTBF, hours (5 years: a failure every 4.4 h at 10,000 nodes).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--sizes", default="", metavar="N,N,...",
              help="Node counts to time besides --nodes, listed under sizes (default: "
                   "1000 and 10000 below --nodes), e.g. 1000,10000,100000.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the default output too).")
def bench_simulate(nodes: int, years: float, mtbf_h: float, seed: int, sizes: str,
                   as_json: bool) -> None:
    """Simulate every strategy once on one core and print nodes, sim_years, wall_s, events."""
    counts = []
    for part in filter(None, (x.strip() for x in sizes.split(","))):
        if not part.isdigit() or not 10 <= int(part) <= 10_000_000:
            raise click.BadParameter(f"{part!r} is not a node count (integers 10 to "
                                     f"10000000, comma-separated)", param_hint="--sizes")
        counts.append(int(part))
    _echo(run_simulate(nodes, years, mtbf_h, seed, counts))


@bench.command("churn")
@click.option("--days", type=click.FloatRange(0.01, 365), default=7.0, show_default=True)
@click.option("--nodes", type=click.IntRange(2, 100_000), default=128, show_default=True)
@click.option("--jobs-per-day", type=click.FloatRange(0, 10_000), default=24.0,
              show_default=True)
@click.option("--job-nodes", type=click.IntRange(1, 100_000), default=16, show_default=True)
@click.option("--job-hours", type=click.FloatRange(0.01, 10_000), default=8.0,
              show_default=True)
@click.option("--failures-per-day", type=click.FloatRange(0, 10_000), default=4.0,
              show_default=True)
@click.option("--quota", default="256MiB", show_default=True,
              help="etcd --quota-backend-bytes (store.space_quota_bytes).")
@click.option("--retention-sec", type=click.FloatRange(0, 1e7), default=3600.0,
              show_default=True, help="store.compaction_retention_sec (0: never compact).")
@click.option("--interval-sec", type=click.FloatRange(1, 1e6), default=300.0,
              show_default=True, help="store.compaction_interval_sec.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the default output too).")
def bench_churn(days: float, nodes: int, jobs_per_day: float, job_nodes: int, job_hours: float,
                failures_per_day: float, quota: str, retention_sec: float, interval_sec: float,
                as_json: bool) -> None:
    """A simulated week of RAPS's etcd writes against a quota; prints the sizes seen."""
    try:
        quota_bytes = churn.parse_quota(quota)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--quota") from None
    _echo(churn.run_churn(days, nodes, jobs_per_day, job_nodes, job_hours, failures_per_day,
                          quota_bytes, retention_sec, interval_sec))


@bench.command("busy")
@click.option("--settings", "which", type=click.Choice(["both", "production", "test"]),
              default="both", show_default=True,
              help="production: configs/raps.yaml (with the local cluster's wiring); "
                   "test: configs/test.yaml; both: one after the other.")
@click.option("--steps", default=300, show_default=True, type=click.IntRange(40, 100000),
              help="Steps of each heat_ring job (longer runs: more steps).")
@click.option("--step-sec", default=0.05, show_default=True, type=click.FloatRange(0.001, 10),
              help="Sleep of each step (the pace; the result does not depend on it).")
@click.option("--every", default=20, show_default=True, type=click.IntRange(1, 10000),
              help="Steps between checkpoints.")
@click.option("--spin-at", default=100, show_default=True, type=click.IntRange(1),
              help="Step at which the last rank spins in the hang runs (a multiple of "
                   "--every below --steps).")
@click.option("--hogs-per-core", default=2, show_default=True, type=click.IntRange(0, 64),
              help="CPU hogs per usable core in the loaded runs, at the ranks' nice and "
                   "CPU cgroups.")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1, 50),
              help="Rounds of the three runs (idle hang, loaded, loaded hang) per setting; "
                   "the hang figures are medians.")
@click.option("--windows", default=2.0, show_default=True, type=click.FloatRange(0, 1000),
              help="The loaded run without a fault lasts at least this many of the "
                   "setting's verdict windows at the job's pace (more steps if needed).")
@_port(21000)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
def bench_busy(which: str, steps: int, step_sec: float, every: int, spin_at: int,
               hogs_per_core: int, repeats: int, windows: float, port: int,
               as_json: bool) -> None:
    """A 4-node job among CPU hogs: false HUNG/DEAD verdicts, healthy ranks restarted or
    moved, and the time to find a real hang against the idle figure."""
    from raps_slurm.bench import busy  # here: this command's hunk stays at the file's end
    settings = busy.SETTINGS if which == "both" else (which,)
    _echo(busy.run_busy(settings, steps, step_sec, every, spin_at, hogs_per_core, repeats,
                        windows, port, quiet=as_json))
