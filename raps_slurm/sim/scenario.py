"""Simulator scenarios: one typed, frozen description loaded from YAML and checked strictly.

A scenario file only needs the keys it changes; every key, its default, range and
meaning is below (``rapsctl simulate keys`` prints them). Sizes are GB (10^9 bytes),
bandwidths GB/s, times in the unit their name ends with.
"""

from __future__ import annotations

import dataclasses
import itertools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raps_slurm.config import _build, _f, read_yaml
from raps_slurm.errors import ScenarioError

STRATEGIES = ("raps", "global", "scr", "step")


@dataclass(frozen=True)
class RunSpec:
    """How long and how often to simulate."""

    horizon_days: float = _f(365.0, "simulated time per seed; every loop stops there (a trace "
                                    "job not done by then counts as unfinished)",
                             0.001, 1_000_000)
    seeds: int = _f(5, "independent failure traces; results are means over them", 1, 10_000)
    seed: int = _f(1, "first seed (seed, seed+1, ...)", 0, 2**31 - 1)
    half_width: float = _f(0.0, "target 95 % half-width of every strategy's useful-work "
                                "fraction: after run.seeds, more seeds until it is reached "
                                "or run.max_seeds (0 = exactly run.seeds)", 0.0, 1.0)
    max_seeds: int = _f(200, "most seeds run.half_width may use", 2, 10_000)
    strategies: tuple[str, ...] = _f(list(STRATEGIES), "strategies to compare: raps, global, "
                                                       "scr, step")


@dataclass(frozen=True)
class ClusterSpec:
    """Where the job runs."""

    racks: int = _f(8, "racks (leaf switches): a count (nodes spread evenly in order, sizes "
                       "differing by at most one) or a list of rack sizes ([4, 3, 2]), which "
                       "is then the whole cluster", 1, 100_000)
    power_domains: int = _f(0, "power domains, each a run of whole racks (0 = none known)",
                            0, 100_000)
    idle_nodes: int = _f(16, "nodes outside the job a requeued job may be given instead of "
                             "dead ones (with a list of rack sizes: what the list holds beyond "
                             "the job and its spares)", 0, 10_000_000)
    queue_wait_s: float = _f(1200.0, "queue wait of a requeued job, every strategy", 0.0, 1e8)
    mpi_latency_us: float = _f(7.1, "native MPI's one-way time of a small message, us, for "
                                    "job.msg_bytes (default measured: bench mpi "
                                    "lat_8B_openmpi_us, Open MPI over TCP on one machine)",
                               0.0, 1e6)
    mpi_gbps: float = _f(3.9121, "native MPI's bandwidth of large messages, GB/s, for "
                                 "job.msg_bytes (default measured: bench mpi "
                                 "bw_8MiB_openmpi_MBps)", 0.001, 1e6)
    # cluster.racks given as a list of sizes; ``racks`` is then its length.
    rack_sizes: tuple[int, ...] = field(default=(), metadata={"internal": True})


@dataclass(frozen=True)
class FailureSpec:
    """How nodes fail and come back."""

    mtbf_h: float = _f(43_800.0, "mean time between failures of one node, hours", 0.001, 1e9)
    distribution: str = _f("exponential", "time to failure of a node",
                           choices=("exponential", "weibull"))
    weibull_shape: float = _f(0.7, "Weibull shape k (<1: infant mortality); the mean stays "
                                   "mtbf_h", 0.05, 20)
    correlated_share: float = _f(0.0, "share of node failures caused by whole-domain events",
                                 0.0, 1.0)
    correlated_scope: str = _f("rack", "domain a correlated event hits",
                               choices=("rack", "power"))
    correlated_nodes: int = _f(0, "nodes lost per correlated event (0 = the whole domain)",
                               0, 1_000_000)
    repair_h: float = _f(24.0, "mean time to repair a failed node (exponential), hours",
                         0.0, 1e6)
    log: str = _f("", "node failure log (CSV: time,node,kind[,end]) replayed instead of "
                      "mtbf_h and the correlated events (or fitted: log_mode); relative to "
                      "the scenario file")
    log_kinds: tuple[str, ...] = _f([], "kinds of the log that count as node failures "
                                        "([] = every kind)")
    log_mode: str = _f("replay", "replay: the log's failures happen again as logged; fit: "
                                 "the log gives mtbf_h and, where a Weibull fits its uptimes "
                                 "better (lower AIC), distribution weibull with the fitted "
                                 "weibull_shape, and failures are drawn as without a log",
                       choices=("replay", "fit"))


@dataclass(frozen=True)
class JobSpec:
    """The application: its size and state (ignored per job when a trace is given)."""

    nodes: int = _f(128, "working nodes of the job", 1, 10_000_000)
    ranks_per_node: int = _f(1, "ranks per working node", 1, 1024)
    state_gb_per_node: float = _f(15.0, "checkpointed state per node, GB", 0.0, 1e6)
    change_rate: float = _f(0.13, "share of the state changed between two checkpoints",
                            0.0, 1.0)
    reinit_s: float = _f(300.0, "application start-up after a requeue, before it restores "
                                "(every strategy)", 0.0, 1e8)
    step_s: float = _f(0.0, "compute time of one step under native MPI, its communication "
                            "excluded; with job.msg_bytes it gives raps's messaging cost "
                            "(0 = raps.log_overhead as given)", 0.0, 1e8)
    msg_bytes: tuple[float, ...] = _f([], "sizes of the messages a rank sends each step, "
                                          "bytes", 0.0, 1e12)
    msg_per_step: tuple[float, ...] = _f([], "how many of each job.msg_bytes a rank sends "
                                             "each step", 0.0, 1e9)
    trace: str = _f("", "sacct --parsable2 file (JobID|NNodes|Start|End|State); "
                        "relative to the scenario file; '' = one job for the horizon")
    trace_states: tuple[str, ...] = _f(
        ["COMPLETED", "TIMEOUT", "NODE_FAIL"], "sacct states whose jobs are simulated (the "
        "others, e.g. FAILED or CANCELLED, end for reasons no checkpoint helps with)")


@dataclass(frozen=True)
class CheckpointSpec:
    """Checkpoint parameters shared by the strategies."""

    interval_s: float = _f(0.0, "compute time between two checkpoints, seconds, for every "
                                "strategy; 0 = each strategy's own best, chosen by the planner "
                                "(Daly's optimum for global, a bounded search for raps, scr and "
                                "step)",
                           0, 1e8)
    replicas: int = _f(2, "raps: copies besides the primary (checkpoint.replica_count)", 0, 8)
    generations: int = _f(2, "generations kept (storage estimate)", 1, 1000)


@dataclass(frozen=True)
class RapsSpec:
    """raps-slurm: per-node incremental checkpoints, message logs, relaunch on spares."""

    interval_s: float = _f(0.0, "raps's checkpoint interval, seconds (0 = "
                                "checkpoint.interval_s)", 0, 1e8)
    spares: int = _f(4, "spare nodes allocated with the job (sbatch --raps-spares); scr "
                           "relaunches on the same spares", 0, 1_000_000)
    incr_s_per_gb: float = _f(0.8233, "blocking time of an incremental save per GB of state "
                                      "(default measured: bench checkpoint, "
                                      "examples/calibration)", 0.0, 1e6)
    restore_gbps: float = _f(0.5235, "decode and verify speed of a restore, GB/s per node "
                                     "(default measured: bench checkpoint)", 0.001, 1e6)
    node_net_gbps: float = _f(3.0, "per-node network for copies and restores, GB/s",
                              0.001, 1e6)
    storage_ratio: float = _f(0.6518, "stored bytes per state byte (zstd with byte shuffle; "
                                      "default measured: bench checkpoint)", 0.01, 10)
    log_overhead: float = _f(0.0943, "share of compute time lost to message logging (default "
                                     "measured: bench messaging, logged against unlogged "
                                     "RAPS, a quarter of the time communicating; against "
                                     "Open MPI, bench mpi, it is about 0.5); with job.step_s "
                                     "and job.msg_bytes, computed from them instead",
                              0.0, 0.99)
    msg_sizes_b: tuple[float, ...] = _f([8, 1048576, 8388608], "message sizes, bytes, at which "
                                        "raps.msg_speed is measured (increasing)", 1.0, 1e12)
    msg_speed: tuple[float, ...] = _f([0.0921, 0.22, 0.354], "RAPS's messaging speed against "
                                      "native MPI at each raps.msg_sizes_b (default measured: "
                                      "bench mpi 1/lat_8B_ratio, bw_1MiB_ratio, bw_8MiB_ratio, "
                                      "docs/runs/bench-mpi-2026-12-05-3.json); between sizes "
                                      "interpolated in log size, beyond them the nearest",
                                  0.0001, 100)
    replay_speedup: float = _f(0.932, "re-execution speed during replay vs normal (default "
                                      "measured: bench recovery --program compute, Jacobi "
                                      "sweeps, the failure-free step's CPU time over the "
                                      "re-executed one's, examples/calibration/"
                                      "replay-compute.json)", 0.1, 1000)
    max_concurrent_recoveries: int = _f(4, "recovery.max_concurrent_recoveries", 1, 10_000)
    recovery_timeout_s: float = _f(300.0, "recovery.recovery_timeout_sec", 1, 1e7)
    prefer_original_rack: bool = _f(False, "recovery.prefer_original_rack")
    plan_s: float = _f(0.078, "from the DEAD verdict to the plan started (default "
                              "measured: bench recovery)", 0.0, 3600)
    launch_s: float = _f(1.033, "srun step start and rank start on the target (default "
                                "measured: bench recovery)", 0.0, 3600)
    heartbeat_interval_s: float = _f(1.0, "detection.kernel_heartbeat_interval_sec",
                                     0.001, 3600)
    miss_threshold: int = _f(3, "detection.miss_threshold", 1, 100)
    fence_margin_s: float = _f(0.5, "detection.fence_margin_sec", 0.0, 3600)
    network_delay_s: float = _f(0.05, "one-way delay of a heartbeat", 0.0, 60)
    detect_s: float = _f(-1.0, "crash -> DEAD verdict, seconds (a measured median: rapsctl "
                               "simulate calibrate takes it from bench detect); -1 = the "
                               "coordinator's detector run at the heartbeat settings above",
                         -1.0, 3600)


@dataclass(frozen=True)
class GlobalSpec:
    """Coordinated checkpoints to a parallel file system, whole-job restart."""

    interval_s: float = _f(0.0, "global's checkpoint interval, seconds (0 = "
                                "checkpoint.interval_s)", 0, 1e8)
    pfs_write_gbps: float = _f(10.0, "aggregate PFS write bandwidth, GB/s", 0.001, 1e9)
    pfs_read_gbps: float = _f(10.0, "aggregate PFS read bandwidth, GB/s", 0.001, 1e9)
    checkpoint_s: float = _f(-1.0, "checkpoint time; -1 = state / pfs_write_gbps", -1, 1e8)
    restart_s: float = _f(-1.0, "whole restart time, all of it holding the job's nodes "
                                "(Daly's R); -1 = cluster.queue_wait_s, then job.reinit_s + "
                                "read", -1, 1e8)


@dataclass(frozen=True)
class ScrSpec:
    """SCR-like: node-local checkpoint plus a copy on a partner node in another rack,
    whole-step relaunch on the job's spares, a periodic flush to the PFS."""

    interval_s: float = _f(0.0, "scr's checkpoint interval, seconds (0 = "
                                "checkpoint.interval_s)", 0, 1e8)
    local_gbps: float = _f(2.0, "node-local write speed, GB/s", 0.001, 1e6)
    partner_gbps: float = _f(3.0, "copy to the partner node, GB/s", 0.001, 1e6)
    relaunch_s: float = _f(120.0, "relaunch of the whole step inside the allocation, "
                                  "start-up included", 0.0, 1e8)
    flush_every: int = _f(-1, "every Nth checkpoint is also written to the PFS (at "
                              "global.pfs_write_gbps, blocking): the fallback when a node and "
                              "its partner are lost together; 0 = never (such a loss restarts "
                              "the job from its beginning); -1 = chosen by the planner",
                          -1, 1_000_000)


@dataclass(frozen=True)
class StepSpec:
    """raps-run --restart-mode step: RAPS's per-node incremental checkpoints with copies in
    the backup group, no message logging; a lost node ends the MPI step, a spare of the
    allocation takes its place and the whole step is relaunched from the newest common
    checkpoint (detection: the raps.* detection keys; spares: raps.spares; copies:
    checkpoint.replicas)."""

    interval_s: float = _f(0.0, "step's checkpoint interval, seconds (0 = "
                                "checkpoint.interval_s)", 0, 1e8)
    relaunch_s: float = _f(1.236, "DEAD verdict -> the new step launched: the old step "
                                  "ended, raps-run's srun of the whole step (default "
                                  "measured: bench restart relaunch_s, 4 ranks on 6 nodes, "
                                  "examples/calibration/restart.json)", 0.0, 1e8)
    incr_s_per_gb: float = _f(-1.0, "blocking time of a libraps incremental save per GB of "
                                    "state; -1 = raps.incr_s_per_gb (measured on the Python "
                                    "runtime's save, the same agent and store: libraps's own "
                                    "is not measured)", -1.0, 1e6)
    restore_gbps: float = _f(0.3477, "a node's whole restore after the launch (the ranks' "
                                     "start, the moved node's pull and decode, the others' "
                                     "decode), GB/s of state (default measured: bench restart, "
                                     "256 MiB per rank in 0.772 s, "
                                     "examples/calibration/restart.json); -1 = the compressed "
                                     "copy pulled at raps.node_net_gbps, then decoded at "
                                     "raps.restore_gbps", -1.0, 1e6)


@dataclass(frozen=True)
class Scenario:
    """A whole scenario; ``source`` is the file it came from ('' for built ones)."""

    name: str = _f("scenario", "name shown in reports")
    run: RunSpec = field(default_factory=RunSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    failures: FailureSpec = field(default_factory=FailureSpec)
    job: JobSpec = field(default_factory=JobSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    raps: RapsSpec = field(default_factory=RapsSpec)
    global_: GlobalSpec = field(default_factory=GlobalSpec,
                                metadata={"key": "global"})
    scr: ScrSpec = field(default_factory=ScrSpec)
    step: StepSpec = field(default_factory=StepSpec)
    source: str = field(default="", metadata={"internal": True})


def _rename(data: Any) -> Any:
    """YAML ``global`` is the Python field ``global_`` (a keyword)."""
    if isinstance(data, dict) and "global" in data:
        data = dict(data)
        data["global_"] = data.pop("global")
    return data


def _take_rack_list(data: Any, errors: list[str]) -> tuple[Any, tuple[int, ...]]:
    """``cluster.racks`` given as a list of rack sizes: the data with the count instead."""
    if not isinstance(data, dict) or not isinstance(data.get("cluster"), dict):
        return data, ()
    cl = dict(data["cluster"])
    if "rack_sizes" in cl:
        errors.append("cluster.rack_sizes: unknown key (give cluster.racks a list of rack "
                      "sizes instead, e.g. racks: [4, 3, 2])")
        del cl["rack_sizes"]
    racks = cl.get("racks")
    sizes: tuple[int, ...] = ()
    if isinstance(racks, list):
        if racks and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                         for x in racks):
            sizes = tuple(racks)
            cl["racks"] = len(racks)
            if "idle_nodes" in cl:  # the list says it: what the racks hold beyond the job
                errors.append("cluster.idle_nodes: not with a list of rack sizes (the idle "
                              "nodes are what the racks hold beyond job.nodes and "
                              "raps.spares); leave it out or give a rack count")
                del cl["idle_nodes"]
        else:
            errors.append(f"cluster.racks: expected a rack count or a list of rack sizes "
                          f"(integers >= 1), got {racks!r}")
            del cl["racks"]
    return {**data, "cluster": cl}, sizes


def parse_scenario(data: Any, source: str = "scenario") -> Scenario:
    """Build a Scenario from parsed YAML; ScenarioError with one line per problem."""
    errors: list[str] = []
    if isinstance(data, dict) and "source" in data:
        errors.append("source: unknown key (allowed: " + ", ".join(_public_keys()) + ")")
        data = {k: v for k, v in data.items() if k != "source"}
    data, sizes = _take_rack_list(data, errors)
    scn = _build(Scenario, _rename(data), "", errors)
    errors = [e.replace("global_", "global").replace(", source)", ")") for e in errors]
    errors = [e.replace(", rack_sizes)", ")") for e in errors]
    errors = ["scenario:" + e[len("config:"):] if e.startswith("config:") else e
              for e in errors]
    if sizes and not errors:
        scn = dataclasses.replace(scn, cluster=dataclasses.replace(
            scn.cluster, rack_sizes=sizes,
            idle_nodes=max(0, sum(sizes) - scn.job.nodes - scn.raps.spares)))
    if not errors:
        _check(scn, errors)
    if errors:
        raise ScenarioError([f"{source}: {e}" for e in errors])
    return dataclasses.replace(typing.cast(Scenario, scn), source=source)


def _public_keys() -> list[str]:
    return [f.metadata.get("key", f.name) for f in dataclasses.fields(Scenario)
            if not f.metadata.get("internal")]


def cluster_check(s: Scenario, job_nodes: int, where: str = "") -> list[str]:
    """Why the cluster cannot hold a job of ``job_nodes`` plus its spares ([] if it can)."""
    c = s.cluster
    pool = job_nodes + s.raps.spares
    what = f"{where}job.nodes + raps.spares = {pool}"
    if c.rack_sizes:
        if sum(c.rack_sizes) < pool:
            return [f"cluster.racks: the racks hold {sum(c.rack_sizes)} nodes, fewer than "
                    f"{what}"]
        return []
    total = pool + c.idle_nodes
    if c.racks > total:
        return [f"cluster.racks: {c.racks} racks for {total} nodes ({what} + "
                f"cluster.idle_nodes): every rack needs a node; give fewer racks or a list "
                f"of rack sizes"]
    return []


def _check(s: Scenario, errors: list[str]) -> None:
    for name in s.run.strategies:
        if name not in STRATEGIES:
            errors.append(f"run.strategies: {name!r} is not a strategy, expected some of "
                          f"{', '.join(STRATEGIES)}")
    if not s.run.strategies:
        errors.append("run.strategies: expected at least one of " + ", ".join(STRATEGIES))
    if not s.job.trace:
        errors.extend(cluster_check(s, s.job.nodes))
    if s.step.restore_gbps != -1 and s.step.restore_gbps < 0.001:
        errors.append(f"step.restore_gbps: {s.step.restore_gbps:g} is not allowed, expected -1 "
                      f"(= raps.restore_gbps) or 0.001 to 1000000.0")
    if s.step.incr_s_per_gb != -1 and s.step.incr_s_per_gb < 0:
        errors.append(f"step.incr_s_per_gb: {s.step.incr_s_per_gb:g} is not allowed, expected "
                      f"-1 (= raps.incr_s_per_gb) or 0 to 1000000.0")
    errors.extend(_messaging_errors(s))
    if s.cluster.power_domains > s.cluster.racks:
        errors.append(f"cluster.power_domains: {s.cluster.power_domains} exceeds cluster.racks "
                      f"= {s.cluster.racks} (a power domain holds whole racks)")
    if s.failures.log_mode == "fit" and not s.failures.log:
        errors.append("failures.log_mode: 'fit' needs a failures.log to fit")
    if s.failures.correlated_scope == "power" and s.failures.correlated_share > 0 \
            and s.cluster.power_domains == 0:
        errors.append("failures.correlated_scope: 'power' needs cluster.power_domains > 0")


def _messaging_errors(s: Scenario) -> list[str]:
    out = []
    if len(s.job.msg_bytes) != len(s.job.msg_per_step):
        out.append(f"job.msg_per_step: {len(s.job.msg_per_step)} counts for "
                   f"{len(s.job.msg_bytes)} job.msg_bytes; give one count per size")
    if s.job.msg_bytes and s.job.step_s == 0:
        out.append("job.step_s: 0 with job.msg_bytes given; give the compute time of a step")
    sizes = s.raps.msg_sizes_b
    if not sizes or len(sizes) != len(s.raps.msg_speed):
        out.append(f"raps.msg_speed: {len(s.raps.msg_speed)} speeds for {len(sizes)} "
                   f"raps.msg_sizes_b; give one speed per size (at least one)")
    if any(b <= a for a, b in itertools.pairwise(sizes)):
        out.append(f"raps.msg_sizes_b: {list(sizes)} is not increasing")
    return out


def load_scenario(path: str | Path) -> Scenario:
    """Load and check one scenario file."""
    return parse_scenario(read_yaml(path, ScenarioError), str(Path(path)))


def override(s: Scenario, key: str, value: Any) -> Scenario:
    """The scenario with one dotted key (``checkpoint.interval_s``) set, checked again."""
    data = to_dict(s)
    parts = key.split(".")
    node: Any = data
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            raise ScenarioError([f"{key}: unknown key (sections: {', '.join(_public_keys())})"])
        node = node[part]
    if not isinstance(node, dict) or parts[-1] not in node:
        allowed = ", ".join(node) if isinstance(node, dict) else ""
        raise ScenarioError([f"{key}: unknown key (allowed: {allowed})"])
    node[parts[-1]] = value
    return dataclasses.replace(parse_scenario(data, s.source or "scenario"), source=s.source)


def to_dict(s: Any) -> dict[str, Any]:
    """The scenario as plain YAML/JSON data (``global`` spelled as in the file)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(s):
        if f.metadata.get("internal"):
            continue
        v = getattr(s, f.name)
        key = f.metadata.get("key", f.name)
        if isinstance(s, ClusterSpec) and f.name == "racks" and s.rack_sizes:
            out[key] = list(s.rack_sizes)
        elif isinstance(s, ClusterSpec) and f.name == "idle_nodes" and s.rack_sizes:
            continue  # the rack list implies it
        elif dataclasses.is_dataclass(v):
            out[key] = to_dict(v)
        elif isinstance(v, tuple):
            out[key] = list(v)
        else:
            out[key] = v
    return out


def describe() -> list[tuple[str, Any, str]]:
    """Every scenario key with its default and description."""
    rows: list[tuple[str, Any, str]] = []
    hints = typing.get_type_hints(Scenario)
    for sec in dataclasses.fields(Scenario):
        if sec.metadata.get("internal"):
            continue
        key = sec.metadata.get("key", sec.name)
        cls = hints[sec.name]
        if not dataclasses.is_dataclass(cls):
            rows.append((key, sec.default, sec.metadata["doc"]))
            continue
        instance = typing.cast(Any, cls)()
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal"):
                continue
            default = getattr(instance, f.name)
            rows.append((f"{key}.{f.name}", list(default) if isinstance(default, tuple)
                         else default, f.metadata["doc"]))
    return rows
