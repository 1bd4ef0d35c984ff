"""Real inputs of the simulator: an sacct job trace and a node failure log.

Job trace (``job.trace``): ``sacct --parsable2 -X -o JobID,NNodes,Start,End,State``. Each
job's End - Start is the work it is simulated with; its State decides whether it is
simulated (``job.trace_states``) and NODE_FAIL jobs also count the trace's own node
failures (:func:`trace_summary`).

Failure log (``failures.log``): CSV with a header naming at least ``time``, ``node`` and
``kind``, and optionally ``end``, one row per node failure (docs/simulator.md):

    time,node,kind,end
    2026-03-01T04:12:00,cn017,hardware,2026-03-01T09:40:00
    2026-03-02T22:05:31,cn101,software,

``time`` and ``end`` are ISO 8601 date-times or seconds (both forms may not be mixed);
``end`` empty means the repair time is drawn from ``failures.repair_h``.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.failstats import mtbf_interval
from raps_slurm.sim.scenario import Scenario

SACCT_FIELDS = ("JobID", "NNodes", "Start", "End", "State")
LOG_FIELDS = ("time", "node", "kind")


@dataclass(frozen=True)
class TraceJob:
    """One job of an sacct trace."""

    job_id: str
    nodes: int                # NNodes
    work_s: float             # End - Start: its failure-free work
    state: str = "COMPLETED"  # the first word of State


@dataclass(frozen=True)
class LoggedFailure:
    """One row of a failure log."""

    at: float                 # seconds from the log's first failure
    node: str                 # the name the log gives it
    kind: str                 # lower case
    down_s: float | None      # until the node was back; None: draw a repair time


def _time(value: str) -> datetime | None:
    if value in ("", "Unknown", "None"):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _read(path_text: str, scenario: Scenario, key: str) -> tuple[str, str]:
    path = Path(path_text)
    if not path.is_absolute() and scenario.source:
        path = Path(scenario.source).parent / path
    try:
        return path.read_text(), str(path)
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ScenarioError([f"{key}: cannot read {path}: {why or exc}"]) from None


def csv_header(rows: list[list[str]], source: str, needed: tuple[str, ...], empty: str,
               expected: str, lower: bool = False) -> list[str]:
    """The header row (stripped; ``lower``: lower case), or one line naming what it lacks:
    ``{source}: empty {empty}``, ``... header lacks X (expected {expected})``."""
    if not rows:
        raise ScenarioError([f"{source}: empty {empty}"])
    header = [h.strip().lower() if lower else h.strip() for h in rows[0]]
    missing = [f for f in needed if f not in header]
    if missing:
        raise ScenarioError([f"{source}: line 1: header lacks {', '.join(missing)} "
                             f"(expected {expected})"])
    return header


def data_rows(rows: list[list[str]], source: str, errors: list[str], comments: bool = False
              ) -> Iterator[tuple[int, list[str]]]:
    """The rows after the header with their line numbers, blank ones (and with ``comments``
    those starting with ``#``) skipped; a row shorter than the header is an error."""
    width = len(rows[0])
    for n, row in enumerate(rows[1:], start=2):
        if not row or all(not c.strip() for c in row) or \
                (comments and row[0].lstrip().startswith("#")):
            continue
        if len(row) < width:
            errors.append(f"{source}: line {n}: expected {width} fields, got {len(row)}")
            continue
        yield n, row


# ---------------------------------------------------------------------- sacct traces

def parse_trace(text: str, source: str = "trace") -> list[TraceJob]:
    """Jobs from ``sacct --parsable2 -X -o JobID,NNodes,Start,End,State`` output.

    Job steps (``123.batch``), jobs that never started or have not ended, and jobs that
    ran for no time are skipped; a malformed line is an error naming the line. The state
    is the first word of State (``CANCELLED by 0`` is CANCELLED).
    """
    rows = list(csv.reader(io.StringIO(text), delimiter="|"))
    header = csv_header(rows, source, SACCT_FIELDS,
                        f"trace, expected a header {'|'.join(SACCT_FIELDS)}",
                        f"sacct --parsable2 -o {','.join(SACCT_FIELDS)}")
    idx = {f: header.index(f) for f in SACCT_FIELDS}
    jobs: list[TraceJob] = []
    errors: list[str] = []
    for n, row in data_rows(rows, source, errors):
        job_id = row[idx["JobID"]].strip()
        if "." in job_id:
            continue
        nn = row[idx["NNodes"]].strip()
        if not nn.isdigit() or int(nn) < 1:
            errors.append(f"{source}: line {n}: NNodes: expected a positive integer, got {nn!r}")
            continue
        start, end = _time(row[idx["Start"]].strip()), _time(row[idx["End"]].strip())
        if start is None or end is None:
            for name, value in (("Start", start), ("End", end)):
                raw = row[idx[name]].strip()
                if value is None and raw not in ("", "Unknown", "None"):
                    errors.append(f"{source}: line {n}: {name}: expected "
                                  f"YYYY-MM-DDTHH:MM:SS, got {raw!r}")
                    break
            continue
        work = (end - start).total_seconds()
        if work <= 0:
            continue
        state = (row[idx["State"]].split() or ["UNKNOWN"])[0].upper()
        jobs.append(TraceJob(job_id, int(nn), work, state))
    if errors:
        raise ScenarioError(errors[:20])
    if not jobs:
        raise ScenarioError([f"{source}: no job with a start, an end and NNodes >= 1"])
    return jobs


def load_trace(scenario: Scenario) -> list[TraceJob] | None:
    """The scenario's simulated trace jobs (``job.trace_states``), None for one job."""
    every = load_trace_all(scenario)
    if every is None:
        return None
    keep = set(scenario.job.trace_states)
    jobs = [j for j in every if j.state in keep]
    if not jobs:
        states = sorted({j.state for j in every})
        raise ScenarioError([f"job.trace_states: no job of the trace is in "
                             f"{', '.join(sorted(keep)) or '[]'} (the trace has "
                             f"{', '.join(states)})"])
    return jobs


def load_trace_all(scenario: Scenario) -> list[TraceJob] | None:
    """Every job of the scenario's trace, whatever its state."""
    if not scenario.job.trace:
        return None
    text, where = _read(scenario.job.trace, scenario, "job.trace")
    return parse_trace(text, where)


def trace_summary(scenario: Scenario) -> dict[str, object] | None:
    """Jobs per state, which were simulated, and the node MTBF the trace itself shows:
    node-hours of every job over its NODE_FAIL jobs, with its 95 % chi-square interval
    (None without a NODE_FAIL)."""
    every = load_trace_all(scenario)
    if every is None:
        return None
    by_state: dict[str, int] = {}
    for j in every:
        by_state[j.state] = by_state.get(j.state, 0) + 1
    node_hours = sum(j.nodes * j.work_s for j in every) / 3600.0
    node_fails = by_state.get("NODE_FAIL", 0)
    return {"jobs": len(every), "by_state": dict(sorted(by_state.items())),
            "simulated_states": list(scenario.job.trace_states),
            "simulated_jobs": sum(1 for j in every if j.state in scenario.job.trace_states),
            "node_hours": round(node_hours, 1), "node_fail_jobs": node_fails,
            "node_mtbf_h_from_node_fail": round(node_hours / node_fails, 1)
            if node_fails else None,
            "node_mtbf_h_from_node_fail_ci95": [round(v, 1) for v in mtbf_interval(
                node_fails, node_hours)] if node_fails and node_hours > 0 else None}


# ---------------------------------------------------------------------- failure logs

def _seconds(value: str) -> float | datetime | None:
    try:
        return float(value)
    except ValueError:
        return _time(value)


def parse_failure_log(text: str, source: str = "log") -> list[LoggedFailure]:
    """Failures of a CSV log (see the module docstring), times from the first failure."""
    rows = list(csv.reader(io.StringIO(text)))
    header = csv_header(rows, source, LOG_FIELDS,
                        f"failure log, expected a header {','.join(LOG_FIELDS)}[,end]",
                        f"{','.join(LOG_FIELDS)}[,end]", lower=True)
    idx = {f: header.index(f) for f in (*LOG_FIELDS, "end") if f in header}
    raw: list[tuple[float | datetime, str, str, float | datetime | None]] = []
    errors: list[str] = []
    for n, row in data_rows(rows, source, errors, comments=True):
        at = _seconds(row[idx["time"]].strip())
        node = row[idx["node"]].strip()
        end_text = row[idx["end"]].strip() if "end" in idx else ""
        end = _seconds(end_text) if end_text else None
        if at is None:
            errors.append(f"{source}: line {n}: time: expected YYYY-MM-DDTHH:MM:SS or "
                          f"seconds, got {row[idx['time']].strip()!r}")
        elif not node:
            errors.append(f"{source}: line {n}: node: expected a node name, got ''")
        elif end_text and (end is None or type(end) is not type(at) or end < at):  # type: ignore[operator]
            errors.append(f"{source}: line {n}: end: expected a time of the same form as "
                          f"time and not before it, got {end_text!r}")
        else:
            raw.append((at, node, row[idx["kind"]].strip().lower(), end))
    if len({type(r[0]) for r in raw}) > 1:
        errors.append(f"{source}: time: date-times and seconds are mixed; use one form")
    if errors:
        raise ScenarioError(errors[:20])
    if not raw:
        raise ScenarioError([f"{source}: no failure in the log"])

    def secs(v: float | datetime) -> float:
        return v.timestamp() if isinstance(v, datetime) else v

    first = min(secs(r[0]) for r in raw)
    out = [LoggedFailure(secs(at) - first, node, kind,
                         None if end is None else secs(end) - secs(at))
           for at, node, kind, end in raw]
    out.sort(key=lambda f: (f.at, f.node))
    return out


def log_period(log: list[LoggedFailure]) -> float:
    """The replay period of a log: its span plus one mean gap between failures (at least
    an hour), so that its last failure and its first, replayed, are not simultaneous."""
    span = log[-1].at - log[0].at
    gap = span / (len(log) - 1) if len(log) > 1 else span
    return max(3600.0, span + gap)


def load_failure_log(scenario: Scenario) -> list[LoggedFailure] | None:
    """The failure log to replay (``failures.log`` filtered by ``failures.log_kinds``), None
    when there is none or ``failures.log_mode`` is fit (its figures drive the draws)."""
    if scenario.failures.log_mode == "fit":
        return None
    return read_failure_log(scenario)


def read_failure_log(scenario: Scenario) -> list[LoggedFailure] | None:
    """The scenario's failure log filtered by ``failures.log_kinds``, None when it has none."""
    if not scenario.failures.log:
        return None
    text, where = _read(scenario.failures.log, scenario, "failures.log")
    rows = parse_failure_log(text, where)
    kinds = {k.lower() for k in scenario.failures.log_kinds}
    if kinds:
        rows = [r for r in rows if r.kind in kinds]
        if not rows:
            raise ScenarioError([f"failures.log_kinds: no failure of {where} is of kind "
                                 f"{', '.join(sorted(kinds))}"])
    return rows
