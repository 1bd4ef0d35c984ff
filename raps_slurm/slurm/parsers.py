"""Pure parsers for Slurm output (sinfo/squeue --json, scontrol -o, scontrol show topology).

Each raises SlurmParseError naming the command when the output is not what Slurm 22.05
prints, so a format change fails loudly instead of yielding half-filled records.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ClusterShell.NodeSet import NodeSet, NodeSetParseError

from raps_slurm.errors import SlurmParseError
from raps_slurm.model import JobInfo, NodeInfo, NodeState, Switch, Topology

_KEY = re.compile(r"(?:(?<=\s)|^)([A-Za-z][A-Za-z0-9_:/.]*)=")
# Slurm appends "[user@time]" to a reason set through scontrol.
_REASON_STAMP = re.compile(r"\s*\[[^\]@]+@[^\]]+\]\s*$")


def expand(hostlist: str) -> tuple[str, ...]:
    """Expand a Slurm hostlist (``n[1-3,5]``) into sorted node names; '' or (null) → ()."""
    if hostlist in ("", "(null)", "None"):
        return ()
    try:
        return tuple(NodeSet(hostlist))
    except NodeSetParseError as exc:
        raise SlurmParseError(["hostlist"], f"bad hostlist {hostlist!r}: {exc}") from None


def parse_kv_line(line: str, tail_key: str | None = None) -> dict[str, str]:
    """Split one ``scontrol -o`` line into key/value pairs; values may contain spaces.

    ``tail_key`` names a key whose value runs to the end of the line (Slurm prints a node's
    free-text Reason last), so text like ``a=b`` inside it is not taken for a key.
    """
    fields: dict[str, str] = {}
    if tail_key:
        marker = f" {tail_key}="
        cut = line.find(marker)
        if cut >= 0:
            fields[tail_key] = line[cut + len(marker):].strip()
            line = line[:cut]
    matches = list(_KEY.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        fields[m.group(1)] = line[m.end():end].strip()
    return fields


def parse_node_state(text: str, flags: list[str] | None = None) -> tuple[NodeState, frozenset[str]]:
    """``IDLE+DRAIN`` or (``idle``, ``["DRAIN"]``) → base state and flag set."""
    parts = [p for p in text.upper().split("+") if p]
    base = parts[0] if parts else "UNKNOWN"
    aliases = {"ALLOC": "ALLOCATED", "MIX": "MIXED", "UNK": "UNKNOWN"}
    base = aliases.get(base.rstrip("*~#!%$@^-"), base.rstrip("*~#!%$@^-"))
    try:
        state = NodeState(base)
    except ValueError:
        state = NodeState.UNKNOWN
    return state, frozenset(p.upper() for p in [*parts[1:], *(flags or [])])


def _loads(text: str, cmd: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmParseError([cmd], f"not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(data, dict):
        raise SlurmParseError([cmd], "expected a JSON object")
    errs = data.get("errors") or []
    if errs:
        raise SlurmParseError([cmd], f"Slurm reported errors: {errs}")
    return data


def _need(obj: dict[str, Any], key: str, cmd: str) -> Any:
    if key not in obj:
        raise SlurmParseError([cmd], f"missing field {key!r}")
    return obj[key]


def _int(value: str, key: str, cmd: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SlurmParseError([cmd], f"{key}: expected an integer, got {value!r}") from None


def _features(text: str | None) -> frozenset[str]:
    if not text or text == "(null)":
        return frozenset()
    return frozenset(f for f in text.split(",") if f)


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    """``sinfo --json`` → one NodeInfo per node (sinfo repeats nodes per partition)."""
    cmd = "sinfo --json"
    data = _loads(text, cmd)
    out: dict[str, NodeInfo] = {}
    for n in _need(data, "nodes", cmd):
        name = _need(n, "name", cmd)
        state, flags = parse_node_state(str(_need(n, "state", cmd)),
                                        list(n.get("state_flags") or []))
        out[name] = NodeInfo(
            name=name, state=state, flags=flags,
            reason=str(n.get("reason") or ""),
            weight=int(n.get("weight", 1)),
            features=_features(n.get("active_features") or n.get("features")),
            cpus=int(n.get("cpus", 1)),
        )
    return [out[k] for k in sorted(out, key=_natural)]


def parse_scontrol_nodes(text: str) -> list[NodeInfo]:
    """``scontrol -o show node`` → NodeInfo per line."""
    cmd = "scontrol -o show node"
    nodes = []
    for line in text.splitlines():
        if not line.strip():
            continue
        kv = parse_kv_line(line, tail_key="Reason")
        name = kv.get("NodeName")
        if not name or "State" not in kv:
            raise SlurmParseError([cmd], f"line without NodeName/State: {line[:80]!r}")
        state, flags = parse_node_state(kv["State"])
        nodes.append(NodeInfo(
            name=name, state=state, flags=flags,
            reason=_REASON_STAMP.sub("", kv.get("Reason", "")),
            weight=_int(kv.get("Weight", "1"), "Weight", cmd),
            features=_features(kv.get("ActiveFeatures") or kv.get("AvailableFeatures")),
            cpus=_int(kv.get("CPUTot", "1"), "CPUTot", cmd),
        ))
    return nodes


def parse_squeue_json(text: str) -> list[JobInfo]:
    """``squeue --json`` → JobInfo per job with its current node list expanded."""
    cmd = "squeue --json"
    data = _loads(text, cmd)
    jobs = []
    for j in _need(data, "jobs", cmd):
        jobs.append(JobInfo(
            job_id=int(_need(j, "job_id", cmd)),
            name=str(j.get("name", "")),
            user_id=int(_need(j, "user_id", cmd)),
            state=str(_need(j, "job_state", cmd)),
            nodes=expand(str(j.get("nodes") or "")),
            restart_count=int(j.get("restart_cnt", 0)),
            start_time=int(j.get("start_time", 0)),
            batch_host=str(j.get("batch_host") or ""),
        ))
    return jobs


def parse_scontrol_job(text: str) -> JobInfo:
    """``scontrol -o show job ID`` (one line) → JobInfo."""
    cmd = "scontrol -o show job"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) != 1:
        raise SlurmParseError([cmd], f"expected one job line, got {len(lines)}")
    kv = parse_kv_line(lines[0])
    for key in ("JobId", "UserId", "JobState"):
        if key not in kv:
            raise SlurmParseError([cmd], f"missing field {key!r}")
    uid = re.search(r"\((\d+)\)", kv["UserId"])
    if not uid:
        raise SlurmParseError([cmd], f"UserId: expected name(uid), got {kv['UserId']!r}")
    return JobInfo(
        job_id=_int(kv["JobId"], "JobId", cmd),
        name=kv.get("JobName", ""),
        user_id=int(uid.group(1)),
        state=kv["JobState"],
        nodes=expand(kv.get("NodeList", "")),
        restart_count=_int(kv.get("Restarts", "0"), "Restarts", cmd),
        batch_host=kv.get("BatchHost", "") if kv.get("BatchHost") != "(null)" else "",
    )


def parse_topology(text: str) -> Topology:
    """``scontrol show topology`` → switch tree (a switch with no child switches is a rack)."""
    cmd = "scontrol show topology"
    switches: dict[str, Switch] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        kv = parse_kv_line(line)
        name = kv.get("SwitchName")
        if not name:
            raise SlurmParseError([cmd], f"line without SwitchName: {line[:80]!r}")
        switches[name] = Switch(
            name=name,
            level=_int(kv.get("Level", "0"), "Level", cmd),
            nodes=frozenset(expand(kv.get("Nodes", ""))),
            switches=expand(kv.get("Switches", "")),
        )
    if not switches:
        raise SlurmParseError([cmd], "no switches: is TopologyPlugin=topology/tree configured?")
    return Topology(switches=switches)


def _natural(name: str) -> tuple[Any, ...]:
    """Sort key that puts n2 before n10."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def parse_show_config(text: str) -> dict[str, str]:
    """``scontrol show config`` -> {key: value}; the header and blank lines are skipped."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    if "SlurmUser" not in out:
        raise SlurmParseError(["scontrol", "show", "config"], "no SlurmUser line in the output")
    return out


def slurm_user(config: dict[str, str]) -> tuple[str, int | None]:
    """SlurmUser as (name, uid) from ``SlurmUser = slurm(64030)``."""
    value = config["SlurmUser"]
    m = re.fullmatch(r"([^()\s]+)\((\d+)\)", value)
    return (m.group(1), int(m.group(2))) if m else (value, None)


def parse_steps(text: str, job_id: int) -> dict[str, int]:
    """``squeue --steps --format='%i %j'`` of one job -> step name -> step number (the
    job's own numbered steps only: not ``batch``, ``extern`` or another job's)."""
    out: dict[str, int] = {}
    prefix = f"{int(job_id)}."
    for line in text.splitlines():
        ident, _, name = line.strip().partition(" ")
        number = ident[len(prefix):] if ident.startswith(prefix) else ""
        if number.isdigit():
            out[name.strip()] = int(number)
    return out
