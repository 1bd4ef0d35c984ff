"""Scenario parameters from benchmark outputs (``rapsctl simulate calibrate BENCH.json...``).

Each file is the JSON object one ``rapsctl bench`` command printed; its kind is recognised
from its fields. What each kind gives (docs/simulator.md, "Calibration"):

- ``bench checkpoint``: ``raps.incr_s_per_gb`` (incremental save time per GB of state),
  ``raps.restore_gbps`` (restore throughput), ``raps.storage_ratio`` (bytes written by a
  full save per state byte);
- ``bench mpi``: ``raps.log_overhead`` from RAPS's messaging speed against Open MPI's
  (what a user who turns RAPS on pays: the logged path against the MPI it replaces, not
  against RAPS unlogged) and an assumed share of time the application communicates
  (``comm_share``);
- ``bench messaging``: the same key from the logged/unlogged time ratio of small
  messages (logging alone; kept under ``also_measured`` when ``bench mpi`` is given);
- ``bench detect``: ``raps.detect_s`` (median crash -> DEAD verdict) and the detection
  settings it ran with;
- ``bench recovery``: ``raps.plan_s``, ``raps.launch_s``, ``raps.replay_speedup``
  (re-executed work over its time: timed steps with ``--program compute`` or ``sleep``,
  heat_ring's nominal step otherwise) and, without a checkpoint file, ``raps.restore_gbps``
  and ``raps.detect_s``;
- ``bench restart``: ``step.relaunch_s`` (DEAD verdict -> the new step launched) and
  ``step.restore_gbps`` (a node's state over the launch -> restored phase), and
  ``raps.detect_s`` when no bench detect or bench recovery gives it.

Every value records the file and fields it came from and how it was computed; a value two
files give is taken from the better source (the dedicated benchmark) and the other one is
kept under ``also_measured``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.detect import detection_delays
from raps_slurm.sim.scenario import RapsSpec, Scenario, override

GB = 1e9
KINDS = ("checkpoint", "mpi", "messaging", "detect", "recovery", "restart")

# Values no benchmark here measures, and why they stay assumed.
NOT_MEASURED = {
    "raps.node_net_gbps": "the local cluster's nodes share one machine (loopback): no "
                          "benchmark measures a real link between nodes",
    "raps.network_delay_s": "loopback again: a heartbeat's one-way delay on a real network "
                            "is not measured",
    "job.change_rate": "a property of the application (bench checkpoint takes it as --change)",
    "failures.*": "node failure rates and repair times come from the site's logs "
                  "(failures.log) or its records, not from a benchmark",
    "global.*, scr.*": "no parallel file system or node-local SSD to measure here",
    "step.incr_s_per_gb": "no benchmark times a libraps save alone: the default (-1) takes "
                          "raps.incr_s_per_gb, the Python runtime's save to the same agent",
}


@dataclass(frozen=True)
class Value:
    """One calibrated parameter and where it came from."""

    key: str
    value: float | tuple[float, ...]
    file: str
    fields: tuple[str, ...]
    how: str
    rank: int  # lower is the better source when two files give the key

    @property
    def number(self) -> float:
        """The value of a one-number key."""
        if isinstance(self.value, tuple):
            raise TypeError(f"{self.key} holds a list")
        return self.value

    def source(self) -> dict[str, Any]:
        """The provenance as JSON: file, fields, formula."""
        return {"file": self.file, "fields": list(self.fields), "how": self.how,
                "value": list(self.value) if isinstance(self.value, tuple) else self.value}


def kind_of(data: Any) -> str | None:
    """Which benchmark printed ``data`` (None: not one calibrate reads)."""
    if not isinstance(data, dict):
        return None
    if data.get("benchmark") in ("checkpoint", "mpi", "messaging", "detect", "restart"):
        return str(data["benchmark"])
    if {"restore_s", "replay_s", "detect_s", "plan_s"} <= set(data):
        return "recovery"  # bench recovery prints no "benchmark" field
    return None


def read_json(path: str | Path, expected: str) -> Any:
    """A benchmark's JSON output; ScenarioError naming the file and ``expected`` if it is
    unreadable or not JSON."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except OSError as exc:
        raise ScenarioError([f"{p}: cannot read ({exc.strerror or exc})"]) from None
    except json.JSONDecodeError as exc:
        raise ScenarioError([f"{p}: not JSON ({exc.msg}, line {exc.lineno}); expected "
                             f"{expected}"]) from None


def load_bench(path: str | Path) -> tuple[str, dict[str, Any]]:
    """One benchmark output: its kind and data; ScenarioError naming the file otherwise."""
    p = Path(path)
    data = read_json(p, f"the output of rapsctl bench {'|'.join(KINDS)}")
    kind = kind_of(data)
    if kind is None:
        raise ScenarioError([f"{p}: not the output of rapsctl bench {'|'.join(KINDS)} (no "
                             f"\"benchmark\" field naming one, nor bench recovery's "
                             f"restore_s/replay_s)"])
    return kind, data


def _num(data: dict[str, Any], name: str, path: str) -> float:
    v = data.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ScenarioError([f"{path}: field {name!r} is missing or not a number (got {v!r})"])
    return float(v)


def from_checkpoint(d: dict[str, Any], path: str) -> list[Value]:
    """Save, restore and compression figures of ``bench checkpoint``."""
    size_gb = _num(d, "size_bytes", path) / GB
    change = d.get("change")
    return [
        Value("raps.incr_s_per_gb", round(_num(d, "incr_seconds", path) / size_gb, 4), path,
              ("incr_seconds", "size_bytes"),
              f"incremental save of {size_gb:.3g} GB with {change} of it changed: "
              f"incr_seconds / size_bytes in GB", 0),
        Value("raps.restore_gbps", round(_num(d, "restore_gbps", path), 4), path,
              ("restore_gbps",), "restore (read, decompress, verify) of the whole state, "
                                 "GB/s", 0),
        Value("raps.storage_ratio", round(_num(d, "full_bytes_written", path)
                                          / _num(d, "size_bytes", path), 4), path,
              ("full_bytes_written", "size_bytes"),
              "bytes a full save wrote per state byte (compression)", 0),
    ]


def log_overhead(ratio: float, comm_share: float) -> float:
    """Share of computation lost to logging for an application that spends ``comm_share``
    of its unlogged time communicating, when logged messages go at ``ratio`` of the
    unlogged speed: its time grows from 1 to 1 - c + c / ratio."""
    if ratio >= 1.0 or comm_share <= 0:
        return 0.0
    return 1.0 - 1.0 / (1.0 - comm_share + comm_share / ratio)


def from_messaging(d: dict[str, Any], path: str, comm_share: float) -> list[Value]:
    """Message logging overhead of ``bench messaging`` (logged against unlogged RAPS)."""
    ratio = _num(d, "ratio", path)
    size = d.get("size_bytes")
    return [Value("raps.log_overhead", round(log_overhead(ratio, comm_share), 4), path,
                  ("ratio",),
                  f"logged/unlogged speed of {size}-byte messages {ratio:g}; an application "
                  f"communicating {comm_share:g} of its time (assumed, --comm-share): "
                  f"1 - 1 / (1 - c + c / ratio)", 1)]


MPI_SPEEDS = ("bw_1MiB_ratio", "bw_8MiB_ratio", "allreduce_8MiB_ratio")


def from_mpi(d: dict[str, Any], path: str, comm_share: float) -> list[Value]:
    """Messaging cost of ``bench mpi``: RAPS's speed against Open MPI's over TCP, the
    geometric mean of the 8-byte latency's inverse ratio and the 1 MiB, 8 MiB and
    allreduce throughput ratios (an application's messages assumed spread over those
    sizes)."""
    speeds = [1.0 / _num(d, "lat_8B_ratio", path)] + [_num(d, k, path) for k in MPI_SPEEDS]
    if any(v <= 0 for v in speeds):
        raise ScenarioError([f"{path}: a ratio of bench mpi is not positive ({speeds})"])
    ratio = 1.0
    for v in speeds:
        ratio *= v
    ratio **= 1 / len(speeds)
    return [Value("raps.log_overhead", round(log_overhead(ratio, comm_share), 4), path,
                  ("lat_8B_ratio", *MPI_SPEEDS),
                  f"RAPS's speed against Open MPI's (TCP): geometric mean {ratio:.3g} of "
                  f"1/lat_8B_ratio and {', '.join(MPI_SPEEDS)}; an application "
                  f"communicating {comm_share:g} of its time (assumed, --comm-share): "
                  f"1 - 1 / (1 - c + c / ratio)", 0), *per_size(d, path)]


SIZED = (("lat_8B_ratio", 8), ("bw_1MiB_ratio", 1 << 20), ("bw_8MiB_ratio", 8 << 20))


def per_size(d: dict[str, Any], path: str) -> list[Value]:
    """RAPS's speed against Open MPI's per message size (the point-to-point figures of
    ``bench mpi``) and Open MPI's own latency and bandwidth: with an application's
    messages per step (job.msg_bytes, job.step_s) they give its messaging cost."""
    speeds = tuple(round(1.0 / _num(d, k, path) if k.startswith("lat") else _num(d, k, path),
                         4) for k, _ in SIZED)
    fields = tuple(k for k, _ in SIZED)
    out = [Value("raps.msg_sizes_b", tuple(float(b) for _, b in SIZED), path, fields,
                 "the sizes bench mpi measures point to point", 0),
           Value("raps.msg_speed", speeds, path, fields,
                 "1/lat_8B_ratio, bw_1MiB_ratio, bw_8MiB_ratio: RAPS's speed against "
                 "Open MPI's (TCP) at 8 B, 1 MiB, 8 MiB", 0)]
    if "lat_8B_openmpi_us" not in d or "bw_8MiB_openmpi_MBps" not in d:
        return out  # an output without Open MPI's own figures: the defaults stay
    return [*out,
            Value("cluster.mpi_latency_us", round(_num(d, "lat_8B_openmpi_us", path), 3),
                  path, ("lat_8B_openmpi_us",), "Open MPI's 8-byte latency (TCP, the "
                                                "benchmark's machine)", 0),
            Value("cluster.mpi_gbps", round(_num(d, "bw_8MiB_openmpi_MBps", path) / 1000, 4),
                  path, ("bw_8MiB_openmpi_MBps",), "Open MPI's 8 MiB bandwidth (TCP, the "
                                                   "benchmark's machine), GB/s", 0)]


def from_detect(d: dict[str, Any], path: str) -> list[Value]:
    """The DEAD verdict delay of ``bench detect`` and the settings it ran with."""
    out = [Value("raps.detect_s", round(_num(d, "detect_p50_s", path), 3), path,
                 ("detect_p50_s",), f"median crash -> DEAD verdict over {d.get('runs')} "
                                    f"crashes", 0),
           Value("raps.heartbeat_interval_s", _num(d, "interval_s", path), path,
                 ("interval_s",), "the heartbeat interval the benchmark ran with", 0),
           Value("raps.miss_threshold", _num(d, "miss_threshold", path), path,
                 ("miss_threshold",), "the miss threshold the benchmark ran with", 0),
           Value("raps.fence_margin_s", _num(d, "fence_margin_s", path), path,
                 ("fence_margin_s",), "the fence margin the benchmark ran with", 0)]
    return out


def from_recovery(d: dict[str, Any], path: str, decode: Value | None = None
                  ) -> tuple[list[Value], list[str]]:
    """Phases of ``bench recovery``; the notes say what it could not give. ``decode`` is
    bench checkpoint's restore rate: with it, the fixed part of the restore phase (the
    relaunched rank's process start and runtime set-up, which the simulator counts in
    ``raps.launch_s``) is the phase less the time to restore the moved bytes."""
    out = [Value("raps.plan_s", round(_num(d, "plan_s", path), 3), path, ("plan_s",),
                 "DEAD verdict -> plan started", 0),
           Value("raps.detect_s", round(_num(d, "detect_s", path), 3), path, ("detect_s",),
                 "crash -> DEAD verdict of the one crash (bench detect's median is better)",
                 1)]
    notes: list[str] = []
    launch = d.get("launch_s")
    restore = _num(d, "restore_s", path)
    moved = _num(d, "moved_bytes", path) / GB
    if decode is not None and restore - moved / decode.number > 0:
        out.append(Value("raps.launch_s", round(restore - moved / decode.number, 3), path,
                         ("restore_s", "moved_bytes", f"{Path(decode.file).name}: "
                                                      f"restore_gbps"),
                         f"plan started -> state restored ({restore:g} s) less the moved "
                         f"{moved:.3g} GB at bench checkpoint's {decode.number:g} GB/s: the "
                         f"step launch, the rank's process start and runtime set-up", 0))
    if isinstance(launch, (int, float)):
        out.append(Value("raps.launch_s", round(float(launch), 3), path, ("launch_s",),
                         "plan started -> the step launched on the spare (the rank's start "
                         "after it is not included: restore_s less the decode is better)",
                         1))
        if restore > launch and moved > 0:
            out.append(Value("raps.restore_gbps", round(moved / (restore - launch), 4), path,
                             ("moved_bytes", "restore_s", "launch_s"),
                             "moved_bytes / (restore_s - launch_s): pull and restore on the "
                             "cluster (bench checkpoint's restore_gbps is better)", 1))
    else:
        notes.append(f"{path}: launch_s is null: raps.launch_s not calibrated")
    if d.get("program") in ("compute", "sleep"):
        return out + measured_speed(d, path, notes), notes
    needed = ("replayed_messages", "step_sec", "messages_per_step_per_rank", "ranks")
    if not all(d.get(k) is not None for k in needed):
        notes.append(f"{path}: no step_sec/messages_per_step_per_rank (an older bench "
                     f"recovery): raps.replay_speedup not calibrated")
        return out, notes
    # restored -> caught up: the replay served to the rank and the lost steps redone (an
    # older bench recovery reported both as replay_s; a newer one splits off reexecute_s)
    replay = _num(d, "replay_s", path) + (_num(d, "reexecute_s", path)
                                          if "reexecute_s" in d else 0.0)
    ranks = d["ranks"] if isinstance(d["ranks"], list) else []
    steps = _num(d, "replayed_messages", path) / _num(d, "messages_per_step_per_rank", path) \
        / max(1, len(ranks))
    if steps <= 0 or replay <= 0:
        notes.append(f"{path}: nothing was replayed (replayed_messages 0 or replay_s 0): "
                     f"raps.replay_speedup not calibrated")
        return out, notes
    work = steps * _num(d, "step_sec", path)
    out.append(Value("raps.replay_speedup", round(work / replay, 4), path,
                     ("replayed_messages", "messages_per_step_per_rank", "ranks", "step_sec",
                      "replay_s", "reexecute_s"),
                     f"replayed work / (replay_s + reexecute_s): {steps:g} steps of "
                     f"{d['step_sec']} s (nominal: heat_ring's sleep) "
                     f"re-executed in {replay:g} s", 2))
    return out, notes


def measured_speed(d: dict[str, Any], path: str, notes: list[str]) -> list[Value]:
    """``raps.replay_speedup`` of a bench recovery on jacobi_prog, whose steps are timed in
    the same run: ``compute`` (Jacobi sweeps) gives ``replay_speed_core_p50``, the lost
    steps at the failure-free step's CPU time over the CPU time the moved rank took to
    redo them: the speed of a rank with a core of its own (on the bench machine four
    ranks share two cores with other work, which slows the failure-free steps, not the
    re-execution while its peers wait: wall against wall would flatter it); ``sleep``
    gives ``replay_speed_p50``, wall time against wall time. A compute run is the better
    source (rank 0), a sleeping one the lesser (1)."""
    compute = d.get("program") == "compute"
    key = "replay_speed_core_p50" if compute else "replay_speed_p50"
    speed = d.get(key)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or speed <= 0:
        notes.append(f"{path}: no {key} (nothing re-executed in any run): "
                     f"raps.replay_speedup not calibrated")
        return []
    what = ("the lost steps at the failure-free step's CPU time over the CPU time the "
            "moved rank took to redo them (a core of its own)" if compute else
            "the lost steps at the failure-free step's wall time over the wall time the "
            "moved rank took to redo them")
    return [Value("raps.replay_speedup", round(float(speed), 4), path,
                  (key, "failure_free_step_cpu_s" if compute else "failure_free_step_s",
                   "reexec_steps", "reexec_cpu_s" if compute else "reexec_s"),
                  f"bench recovery --program {d['program']} ({d.get('runs')} runs, median): "
                  f"{what}", 0 if compute else 1)]


def from_restart(d: dict[str, Any], path: str) -> tuple[list[Value], list[str]]:
    """Phases of ``bench restart`` (raps-run --restart-mode step on the C stencil, one rank
    per node); the notes say what it could not give."""
    out = [Value("raps.detect_s", round(_num(d, "detect_s", path), 3), path, ("detect_s",),
                 "crash -> DEAD verdict of the one crash (bench detect's median is better)",
                 2)]
    notes: list[str] = []
    if d.get("relaunch_s") is None or d.get("restore_s") is None:
        notes.append(f"{path}: relaunch_s or restore_s is null (no plan launched or "
                     f"restored): step.* not calibrated")
        return out, notes
    relaunch, restore = _num(d, "relaunch_s", path), _num(d, "restore_s", path)
    state_gb = _num(d, "state_per_rank_bytes", path) / GB
    out.append(Value("step.relaunch_s", round(relaunch, 3), path, ("relaunch_s",),
                     "DEAD verdict -> the new step launched (the old one ended)", 0))
    if restore > 0:
        out.append(Value("step.restore_gbps", round(state_gb / restore, 4), path,
                         ("state_per_rank_bytes", "restore_s"),
                         f"{state_gb:.3g} GB per node (one rank per node) over restore_s "
                         f"{restore:g} s: new step launched -> every moved rank restored",
                         0))
    else:
        notes.append(f"{path}: restore_s is 0: step.restore_gbps not calibrated")
    return out, notes


def calibrate(paths: list[str], comm_share: float = 0.25) -> dict[str, Any]:
    """Scenario parameters from benchmark outputs, each with its provenance."""
    if not paths:
        raise ScenarioError(["calibrate: give at least one benchmark JSON file (the output "
                             f"of rapsctl bench {'|'.join(KINDS)})"])
    values: list[Value] = []
    notes: list[str] = []
    files: dict[str, str] = {}
    detect: dict[str, Any] | None = None
    loaded = [(path, *load_bench(path)) for path in paths]
    # bench checkpoint first: the recovery's launch time needs its restore rate.
    loaded.sort(key=lambda x: x[1] != "checkpoint")
    for path, kind, d in loaded:
        files[str(path)] = kind
        if kind == "checkpoint":
            values += from_checkpoint(d, str(path))
        elif kind == "messaging":
            values += from_messaging(d, str(path), comm_share)
        elif kind == "mpi":
            values += from_mpi(d, str(path), comm_share)
        elif kind == "detect":
            values += from_detect(d, str(path))
            detect = d
        elif kind == "restart":
            got, why = from_restart(d, str(path))
            values += got
            notes += why
        else:
            decode = next((v for v in values if v.key == "raps.restore_gbps"), None)
            got, why = from_recovery(d, str(path), decode)
            values += got
            notes += why
    chosen: dict[str, Value] = {}
    also: dict[str, list[dict[str, Any]]] = {}
    for v in sorted(values, key=lambda v: v.rank):
        if v.key in chosen:
            also.setdefault(v.key, []).append(v.source())
        else:
            chosen[v.key] = v
    params: dict[str, Any] = {k: chosen[k].source()["value"] for k in sorted(chosen)}
    for k in ("raps.miss_threshold",):
        if k in params:
            params[k] = int(params[k])
    out: dict[str, Any] = {
        "files": files,
        "parameters": params,
        "sources": {k: chosen[k].source() for k in sorted(chosen)},
        "also_measured": also,
        "assumed": {"comm_share": comm_share} if "raps.log_overhead" in chosen else {},
        "not_measured": NOT_MEASURED,
        "notes": notes,
    }
    if detect is not None:
        out["checks"] = {"detect": detection_check(detect)}
    return out


def detection_check(d: dict[str, Any]) -> dict[str, Any]:
    """The measured DEAD-verdict delays beside the simulator's detector at the same
    settings (the simulator's own model when ``raps.detect_s`` is not set)."""
    spec = RapsSpec(heartbeat_interval_s=float(d["interval_s"]),
                    miss_threshold=int(d["miss_threshold"]),
                    fence_margin_s=float(d["fence_margin_s"]))
    model = sorted(detection_delays(spec))
    return {"measured_p50_s": d["detect_p50_s"], "measured_max_s": d.get("detect_max_s"),
            "model_p50_s": round(model[len(model) // 2], 3),
            "model_range_s": [round(model[0], 3), round(model[-1], 3)]}


def apply(s: Scenario, params: dict[str, Any]) -> Scenario:
    """The scenario with the calibrated parameters set (each checked like ``--set``)."""
    for key, value in params.items():
        s = override(s, key, value)
    return s


def to_yaml(result: dict[str, Any]) -> str:
    """The parameters as a scenario fragment, each with a comment saying where it came from."""
    lines = ["# rapsctl simulate calibrate " + " ".join(result["files"])]
    by_section: dict[str, list[str]] = {}
    for key, value in result["parameters"].items():
        section, name = key.split(".", 1)
        src = result["sources"][key]
        shown = f"[{', '.join(f'{v:.12g}' for v in value)}]" if isinstance(value, (list, tuple)) \
            else f"{value:g}"
        by_section.setdefault(section, []).append(
            f"  {name}: {shown}    # {Path(src['file']).name}: {src['how']}")
    for section, rows in by_section.items():
        lines.append(f"{section}:")
        lines.extend(rows)
    for key, why in result["assumed"].items():
        lines.append(f"# assumed: {key} = {why}")
    for key, why in result["not_measured"].items():
        lines.append(f"# not measured: {key}: {why}")
    lines.extend(f"# note: {n}" for n in result["notes"])
    return "\n".join(lines) + "\n"
