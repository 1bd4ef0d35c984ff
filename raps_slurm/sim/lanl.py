"""The public LANL failure data (Schroeder and Gibson, DSN 2006) as a simulator failure log.

LANL's release (``LA-UR-05-7318-failure-data-1996-2005.csv``) is one CSV row per node
outage of 22 systems, 1996-2005, with the header::

    System,machine type,nodes,procstot,procsinnode,nodenum,nodenumz,node install,
    node prod,node decom,fru type,mem,cputype,memtype,num intercon,purpose,
    Prob Started,Prob Fixed,Down Time,Facilities,Hardware,Human Error,Network,
    Undetermined,Software,Same Event

``nodes`` is the system's node count, ``nodenumz`` the node's number from 0, ``Prob
Started`` and ``Prob Fixed`` are ``m/d/yyyy h:mm`` (two-digit years are read too), and
the root cause is whichever of the six category columns is filled (its text the detail).
:func:`convert` writes the rows of one system in the simulator's own log format
(``time,node,kind,end``, :mod:`raps_slurm.sim.inputs`), its nodes mapped onto a cluster of
``nodes`` by a stated rule (docs/simulator.md, Failure logs).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import datetime

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.failstats import UptimeFit, fit_uptimes, mtbf_interval, node_uptimes
from raps_slurm.sim.inputs import (
    LoggedFailure,
    csv_header,
    data_rows,
    log_period,
    parse_failure_log,
)

NEEDED = ("System", "nodes", "nodenumz", "Prob Started", "Prob Fixed")
CAUSES = {"Facilities": "facilities", "Hardware": "hardware", "Human Error": "human",
          "Network": "network", "Undetermined": "undetermined", "Software": "software"}
MAPS = ("block", "first")
_FORMATS = ("%m/%d/%Y %H:%M", "%m/%d/%y %H:%M")


@dataclass(frozen=True)
class LanlRecord:
    """One outage of the LANL data."""

    system: str
    system_nodes: int      # the system's node count (column ``nodes``)
    node: int              # ``nodenumz``: from 0; -1 when the row names no node
    start: datetime
    end: datetime
    kind: str              # the category column that is filled, lower case; else unknown
    cause: str             # its text


def _when(text: str) -> datetime | None:
    for fmt in _FORMATS:
        try:
            return datetime.strptime(text.strip(), fmt)
        except ValueError:
            continue
    return None


def parse_lanl(text: str, source: str = "lanl") -> list[LanlRecord]:
    """The outages of a LANL failure data file; a bad row is an error naming its line."""
    rows = list(csv.reader(io.StringIO(text)))
    header = csv_header(rows, source, NEEDED, f"file, expected LANL's header "
                        f"({', '.join(NEEDED)}, ...)", "the LANL failure data layout: "
                        "System,...,nodenumz,...,Prob Started,Prob Fixed,...")
    idx = {c: i for i, c in enumerate(header)}
    out: list[LanlRecord] = []
    errors: list[str] = []
    for n, row in data_rows(rows, source, errors):
        cell = {c: row[i].strip() for c, i in idx.items()}
        start, end = _when(cell["Prob Started"]), _when(cell["Prob Fixed"])
        if start is not None and end is not None and end >= start and \
                not cell["nodes"] and not cell["nodenumz"]:  # LANL's system 17: no node
            out.append(LanlRecord(cell["System"], 0, -1, start, end, "unknown", ""))
        elif not cell["nodes"].isdigit() or int(cell["nodes"]) < 1:
            errors.append(f"{source}: line {n}: nodes: expected a positive integer, got "
                          f"{cell['nodes']!r}")
        elif not cell["nodenumz"].isdigit():
            errors.append(f"{source}: line {n}: nodenumz: expected a node number from 0, "
                          f"got {cell['nodenumz']!r}")
        elif start is None or end is None:
            bad = "Prob Started" if start is None else "Prob Fixed"
            errors.append(f"{source}: line {n}: {bad}: expected m/d/yyyy h:mm, got "
                          f"{cell[bad]!r}")
        elif end < start:
            errors.append(f"{source}: line {n}: Prob Fixed: before Prob Started")
        else:
            kind, cause = next(((k, cell[c]) for c, k in CAUSES.items() if cell.get(c)),
                               ("unknown", ""))
            out.append(LanlRecord(cell["System"], int(cell["nodes"]), int(cell["nodenumz"]),
                                  start, end, kind, cause))
        if len(errors) >= 20:
            break
    if errors:
        raise ScenarioError(errors)
    if not out:
        raise ScenarioError([f"{source}: no outage in the file"])
    return out


def systems(records: list[LanlRecord]) -> dict[str, tuple[int, int]]:
    """System -> (its node count, its outages), in numeric order."""
    out: dict[str, tuple[int, int]] = {}
    for r in records:
        nodes, count = out.get(r.system, (r.system_nodes, 0))
        out[r.system] = (max(nodes, r.system_nodes), count + 1)
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].isdigit(),
                                                   int(kv[0]) if kv[0].isdigit() else 0,
                                                   kv[0])))


@dataclass(frozen=True)
class Conversion:
    """A converted system: the failure log text and what the conversion did."""

    text: str
    system: str
    source_nodes: int        # the system's nodes (its ``nodes``, or beyond: the largest + 1)
    failing_nodes: int       # source nodes with at least one outage
    nodes: int               # the target cluster's nodes
    rule: str                # block or first
    per_node: int            # most source nodes folded onto one target node
    failures: int            # rows written
    dropped: int             # outages of source nodes beyond the cluster (rule first)
    merged: int              # outages that start while their target node is still down
    span_days: float
    node_mtbf_h: float       # of the source system: its node-hours over the period / outages
    node_mtbf_h_ci95: tuple[float, float]
    fit: UptimeFit | None    # per source node
    warnings: tuple[str, ...]

    def as_json(self) -> dict[str, object]:
        """What ``convert-lanl --json`` prints."""
        return {"system": self.system, "source_nodes": self.source_nodes,
                "failing_nodes": self.failing_nodes, "nodes": self.nodes, "map": self.rule,
                "source_nodes_per_node": self.per_node, "failures": self.failures,
                "dropped": self.dropped, "merged_by_replay": self.merged,
                "span_days": round(self.span_days, 3),
                "source_node_mtbf_h": round(self.node_mtbf_h, 1),
                "source_node_mtbf_h_ci95": [round(v, 1) for v in self.node_mtbf_h_ci95],
                "fit": self.fit.as_json() if self.fit else None,
                "warnings": list(self.warnings)}


def target_node(z: int, source_nodes: int, nodes: int, rule: str) -> int | None:
    """The cluster node (from 1) of source node ``z`` (from 0), None when it is dropped.

    ``block``: consecutive runs of source nodes fold onto one node, z * nodes // source
    + 1 (a machine no larger than the cluster keeps its numbers, z + 1); ``first``: the
    first ``nodes`` source nodes keep their numbers, the others are dropped.
    """
    if rule == "first" or source_nodes <= nodes:
        return z + 1 if z < nodes else None
    return z * nodes // source_nodes + 1


def convert(records: list[LanlRecord], system: str | None, nodes: int | None,
            rule: str = "block", source: str = "lanl") -> Conversion:
    """One system's outages as a failure log for a cluster of ``nodes`` (default: the
    system's own size), mapped by ``rule`` (:func:`target_node`)."""
    found = systems(records)
    if system is None:
        if len(found) > 1:
            listed = ", ".join(f"{s} ({n} nodes, {c} outages)" for s, (n, c) in found.items())
            raise ScenarioError([f"--system: {source} holds several systems; name one of "
                                 f"{listed}"])
        system = next(iter(found))
    if system not in found:
        raise ScenarioError([f"--system: {system!r} is not in {source}; it holds "
                             f"{', '.join(found)}"])
    if rule not in MAPS:
        raise ScenarioError([f"--map: {rule!r}, expected one of {', '.join(MAPS)}"])
    every = [r for r in records if r.system == system]
    rows = sorted((r for r in every if r.node >= 0), key=lambda r: (r.start, r.node))
    if not rows:
        raise ScenarioError([f"--system: system {system}'s rows name no node (nodes and "
                             f"nodenumz are empty); it cannot be mapped onto nodes"])
    source_nodes = max(found[system][0], max(r.node for r in rows) + 1)
    nodes = nodes or source_nodes
    width = max(4, len(str(nodes)))
    lines = ["time,node,kind,end,cause,source_node",
             f"# LANL system {system} ({source_nodes} nodes) from {source.replace(',', ' ')}; "
             f"rapsctl simulate convert-lanl --map {rule} onto {nodes} nodes"]
    written: list[tuple[int, datetime, datetime]] = []
    dropped = 0
    for r in rows:
        t = target_node(r.node, source_nodes, nodes, rule)
        if t is None:
            dropped += 1
            continue
        written.append((t, r.start, r.end))
        cause = r.cause.replace('"', "'")
        lines.append(f"{r.start.isoformat()},n{t:0{width}d},{r.kind},{r.end.isoformat()},"
                     f"\"{cause}\",{r.node}")
    if not written:
        raise ScenarioError([f"--nodes: no outage of system {system} falls on the first "
                             f"{nodes} nodes (--map first)"])
    merged, up_at = 0, dict[int, datetime]()  # outages a replay merges: node still down
    for t, start, end in sorted(written, key=lambda w: (w[1], w[0])):
        if up_at.get(t, datetime.min) > start:
            merged += 1
        up_at[t] = max(up_at.get(t, datetime.min), end)
    text = "\n".join(lines) + "\n"
    log = parse_failure_log(text, source)  # what the simulator will read
    per_node = 1 if rule == "first" or source_nodes <= nodes else -(-source_nodes // nodes)
    first = rows[0].start  # the system's period and MTBF count every outage, kept or not
    period_h = log_period([LoggedFailure((r.start - first).total_seconds(), str(r.node),
                                         r.kind, None) for r in rows]) / 3600.0
    outages = [(str(r.node), (r.start - first).total_seconds() / 3600.0,
                (r.end - first).total_seconds() / 3600.0) for r in rows]
    fit: UptimeFit | None
    try:
        fit = fit_uptimes(*node_uptimes(outages, period_h))
    except ValueError:
        fit = None
    warnings = _warnings(system, source_nodes, nodes, rule, per_node, dropped, merged)
    if len(every) > len(rows):
        warnings.append(f"{len(every) - len(rows)} rows of system {system} name no node and "
                        f"are left out")
    return Conversion(text, system, source_nodes, len({r.node for r in rows}), nodes, rule,
                      per_node, len(written), dropped, merged,
                      (log[-1].at - log[0].at) / 86400.0,
                      period_h * source_nodes / len(rows),
                      mtbf_interval(len(rows), period_h * source_nodes), fit, tuple(warnings))


def _warnings(system: str, source_nodes: int, nodes: int, rule: str, per_node: int,
              dropped: int, merged: int) -> list[str]:
    out = []
    if per_node > 1:
        out.append(f"--map block: system {system}'s {source_nodes} nodes are folded onto "
                   f"{nodes}, up to {per_node} source nodes on one: each node fails about "
                   f"{source_nodes / nodes:.3g} times as often as one of system {system}'s "
                   f"(--map first keeps the per-node rate, dropping the other nodes' outages)")
    if dropped:
        out.append(f"--map first: {dropped} outages of system {system}'s nodes beyond the "
                   f"first {nodes} are dropped")
    if merged:
        out.append(f"{merged} outages start while their node is still down; a replay counts "
                   f"each as part of the outage before it")
    return out
