"""Table-driven parser tests on outputs captured from the real local cluster (tests/data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raps_slurm.errors import SlurmParseError
from raps_slurm.model import NodeState
from raps_slurm.slurm import parsers

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm"


def read(name: str) -> str:
    return (DATA / name).read_text()


@pytest.mark.parametrize(("sample", "parse"), [
    ("sinfo_idle.json", parsers.parse_sinfo_json),
    ("scontrol_show_node_idle.txt", parsers.parse_scontrol_nodes),
])
def test_idle_cluster(sample: str, parse: object) -> None:
    nodes = parse(read(sample))  # type: ignore[operator]
    assert [n.name for n in nodes] == [f"n{i}" for i in range(1, 7)]
    assert {n.state for n in nodes} == {NodeState.IDLE}
    assert all(not n.flags and n.reason == "" and n.weight == 1 and n.cpus == 2 for n in nodes)


@pytest.mark.parametrize(("sample", "parse"), [
    ("sinfo_drain.json", parsers.parse_sinfo_json),
    ("scontrol_show_node_mixed.txt", parsers.parse_scontrol_nodes),
])
def test_drained_and_weighted_nodes(sample: str, parse: object) -> None:
    by_name = {n.name: n for n in parse(read(sample))}  # type: ignore[operator]
    n6 = by_name["n6"]
    assert (n6.state, n6.flags, n6.reason) == (NodeState.IDLE, frozenset({"DRAIN"}),
                                               "raps test drain")
    assert n6.drained and n6.state_text == "IDLE+DRAIN"
    assert by_name["n5"].weight == 50
    assert by_name["n1"].state is NodeState.MIXED


@pytest.mark.parametrize(("sample", "parse"), [
    ("sinfo_down.json", parsers.parse_sinfo_json),
    ("scontrol_show_node_down.txt", parsers.parse_scontrol_nodes),
])
def test_dead_node(sample: str, parse: object) -> None:
    n6 = {n.name: n for n in parse(read(sample))}["n6"]  # type: ignore[operator]
    assert n6.state is NodeState.DOWN
    assert n6.flags == frozenset({"NOT_RESPONDING"})
    assert n6.reason == "Not responding"


def test_squeue_running_job() -> None:
    [job] = parsers.parse_squeue_json(read("squeue_running.json"))
    assert (job.job_id, job.name, job.user_id, job.state) == (1, "demo", 0, "RUNNING")
    assert job.nodes == ("n1", "n2", "n3", "n4")
    assert job.batch_host == "n1" and job.restart_count == 0 and job.start_time > 0


def test_squeue_empty() -> None:
    jobs = parsers.parse_squeue_json(read("squeue_empty.json"))
    assert all(j.state in ("CANCELLED", "COMPLETED", "COMPLETING") for j in jobs)


def test_scontrol_job() -> None:
    job = parsers.parse_scontrol_job(read("scontrol_show_job_running.txt"))
    assert (job.job_id, job.user_id, job.state, job.nodes, job.batch_host) == (
        1, 0, "RUNNING", ("n1", "n2", "n3", "n4"), "n1")


def test_topology() -> None:
    topo = parsers.parse_topology(read("topology.txt"))
    assert topo.racks() == {"r1": ("n1", "n2"), "r2": ("n3", "n4"), "r3": ("n5", "n6")}
    assert topo.switches["root"].switches == ("r1", "r2", "r3")
    assert topo.rack_of("n4") == "r2" and topo.rack_of("n9") is None
    assert (topo.distance("n1", "n1"), topo.distance("n1", "n2"), topo.distance("n1", "n5")) == (
        0, 1, 2)


@pytest.mark.parametrize(("line", "expected"), [
    ("NodeName=n1 State=IDLE Reason=disk a=b [root@2026-01-01T00:00:00]",
     {"NodeName": "n1", "State": "IDLE", "Reason": "disk a=b [root@2026-01-01T00:00:00]"}),
    ("A=1 OS=Linux 6.1 #1 SMP B=2", {"A": "1", "OS": "Linux 6.1 #1 SMP", "B": "2"}),
    ("AllocNode:Sid=localhost:1 CPUs/Task=1", {"AllocNode:Sid": "localhost:1", "CPUs/Task": "1"}),
    ("", {}),
])
def test_kv_line(line: str, expected: dict[str, str]) -> None:
    assert parsers.parse_kv_line(line, tail_key="Reason") == expected


@pytest.mark.parametrize(("text", "flags", "state", "out_flags"), [
    ("IDLE+DRAIN", None, NodeState.IDLE, {"DRAIN"}),
    ("DOWN+NOT_RESPONDING", None, NodeState.DOWN, {"NOT_RESPONDING"}),
    ("mixed", ["DRAIN"], NodeState.MIXED, {"DRAIN"}),
    ("alloc", [], NodeState.ALLOCATED, set()),
    ("idle*", [], NodeState.IDLE, set()),
    ("PLANNED", [], NodeState.UNKNOWN, set()),
])
def test_node_state(text: str, flags: list[str] | None, state: NodeState,
                    out_flags: set[str]) -> None:
    assert parsers.parse_node_state(text, flags) == (state, frozenset(out_flags))


@pytest.mark.parametrize(("call", "text", "needle"), [
    (parsers.parse_sinfo_json, "not json", "not JSON"),
    (parsers.parse_sinfo_json, "[]", "expected a JSON object"),
    (parsers.parse_sinfo_json, "{}", "missing field 'nodes'"),
    (parsers.parse_sinfo_json, '{"errors": ["boom"], "nodes": []}', "Slurm reported errors"),
    (parsers.parse_squeue_json, '{"jobs": [{"job_id": 1}]}', "missing field 'user_id'"),
    (parsers.parse_scontrol_job, "", "expected one job line, got 0"),
    (parsers.parse_scontrol_job, "JobId=x UserId=a(1) JobState=RUNNING", "JobId: expected an integer"),
    (parsers.parse_scontrol_job, "JobId=1 UserId=alice JobState=RUNNING", "UserId: expected name(uid)"),
    (parsers.parse_scontrol_nodes, "garbage line", "line without NodeName/State"),
    (parsers.parse_topology, "", "no switches"),
    (parsers.parse_topology, "SwitchName=r1 Nodes=n[1-", "bad hostlist"),
])
def test_unexpected_output_fails_loudly(call: object, text: str, needle: str) -> None:
    with pytest.raises(SlurmParseError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        call(text)  # type: ignore[operator]


def test_expand() -> None:
    assert parsers.expand("n[1-3,5]") == ("n1", "n2", "n3", "n5")
    assert parsers.expand("(null)") == () and parsers.expand("") == ()
