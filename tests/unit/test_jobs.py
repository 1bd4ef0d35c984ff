"""Job records, rank maps and their lifecycle (raps_slurm.core.jobs): pure, no store."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from raps_slurm.core.jobs import (
    SPEC_RANGES,
    JobRecord,
    JobSpec,
    RankEntry,
    RankMap,
    build_map,
    choose_spares,
    group_from_json,
    group_to_json,
    purge_due,
    record_from_env,
    registration,
)
from raps_slurm.errors import PlacementError, RecordError
from raps_slurm.model import BackupGroup, Switch, Topology

# ---------------------------------------------------------------- helpers


def make_topology(racks: Mapping[str, Sequence[str]]) -> Topology:
    """Leaf switches (level 0, the racks) under one root switch."""
    switches = {r: Switch(r, 0, frozenset(nodes)) for r, nodes in racks.items()}
    every = frozenset(n for nodes in racks.values() for n in nodes)
    switches["root"] = Switch("root", 1, every, tuple(racks))
    return Topology(switches)


# 3 racks of 2: n1 n2 | n3 n4 | n5 n6
SIX = make_topology({"r1": ["n1", "n2"], "r2": ["n3", "n4"], "r3": ["n5", "n6"]})
# 3 racks of 3: n1-n3 | n4-n6 | n7-n9
NINE = make_topology({"r1": ["n1", "n2", "n3"], "r2": ["n4", "n5", "n6"],
                      "r3": ["n7", "n8", "n9"]})
SIX_NODES = ("n1", "n2", "n3", "n4", "n5", "n6")


def record(job_id: str = "12", restart_count: int = 0, owner_uid: int = 1000,
           nodes: Sequence[str] = SIX_NODES, spec: JobSpec | None = None,
           **kw: Any) -> JobRecord:
    return JobRecord(job_id, restart_count, owner_uid, tuple(nodes), spec or JobSpec(), **kw)


def raps_env(**extra: str) -> dict[str, str]:
    """The PrologSlurmctld environment of a ``--raps`` job on n[1-3,5]."""
    env = {"SPANK_RAPS_ENABLED": "1", "SLURM_JOB_ID": "42", "SLURM_JOB_UID": "1000",
           "SLURM_JOB_NODELIST": "n[1-3,5]"}
    env.update(extra)
    return env


def rack_of(topo: Topology, node: str) -> str:
    rack = topo.rack_of(node)
    assert rack is not None
    return rack


# ---------------------------------------------------------------- JobSpec.from_env


def test_spec_is_none_without_raps() -> None:
    assert JobSpec.from_env({}) is None
    # Only "1" enables: the shim exports exactly that, anything else is not --raps.
    assert JobSpec.from_env({"SPANK_RAPS_ENABLED": "0", "SPANK_RAPS_SPARES": "2"}) is None
    assert JobSpec.from_env({"SPANK_RAPS_ENABLED": "yes"}) is None


def test_spec_defaults_when_only_enabled() -> None:
    spec = JobSpec.from_env({"SPANK_RAPS_ENABLED": "1"})
    assert spec == JobSpec(spares=0, replicas=None, ckpt_interval_sec=None, ranks_per_node=1)


def test_spec_values_parsed() -> None:
    spec = JobSpec.from_env({"SPANK_RAPS_ENABLED": "1", "SPANK_RAPS_SPARES": "2",
                             "SPANK_RAPS_REPLICAS": "3", "SPANK_RAPS_CKPT_INTERVAL": "600",
                             "SPANK_RAPS_RANKS_PER_NODE": "4"})
    assert spec == JobSpec(spares=2, replicas=3, ckpt_interval_sec=600, ranks_per_node=4)
    assert spec.to_dict() == {"spares": 2, "replicas": 3, "ckpt_interval_sec": 600,
                              "ranks_per_node": 4}


def test_spec_empty_value_means_default() -> None:
    # The shim exports an empty variable for an option the user did not give.
    spec = JobSpec.from_env({"SPANK_RAPS_ENABLED": "1", "SPANK_RAPS_REPLICAS": "",
                             "SPANK_RAPS_SPARES": ""})
    assert spec == JobSpec()


def test_spec_bounds_are_inclusive() -> None:
    env = {"SPANK_RAPS_ENABLED": "1", "SPANK_RAPS_SPARES": "64", "SPANK_RAPS_REPLICAS": "0",
           "SPANK_RAPS_CKPT_INTERVAL": "604800", "SPANK_RAPS_RANKS_PER_NODE": "1024"}
    assert JobSpec.from_env(env) == JobSpec(64, 0, 604800, 1024)


@pytest.mark.parametrize(("var", "field", "value"), [
    ("SPANK_RAPS_SPARES", "spares", "65"),
    ("SPANK_RAPS_SPARES", "spares", "-1"),
    ("SPANK_RAPS_SPARES", "spares", "two"),
    ("SPANK_RAPS_REPLICAS", "replicas", "9"),
    ("SPANK_RAPS_REPLICAS", "replicas", "1.5"),
    ("SPANK_RAPS_CKPT_INTERVAL", "ckpt_interval_sec", "0"),
    ("SPANK_RAPS_CKPT_INTERVAL", "ckpt_interval_sec", "604801"),
    ("SPANK_RAPS_CKPT_INTERVAL", "ckpt_interval_sec", " 60"),
    ("SPANK_RAPS_RANKS_PER_NODE", "ranks_per_node", "0"),
    ("SPANK_RAPS_RANKS_PER_NODE", "ranks_per_node", "1025"),
    ("SPANK_RAPS_RANKS_PER_NODE", "ranks_per_node", "0x10"),
])
def test_spec_bad_value_names_variable_and_range(var: str, field: str, value: str) -> None:
    lo, hi = SPEC_RANGES[field]
    with pytest.raises(ValueError, match=var) as info:
        JobSpec.from_env({"SPANK_RAPS_ENABLED": "1", var: value})
    assert f"{lo}-{hi}" in str(info.value)
    assert repr(value) in str(info.value)


def test_spec_unicode_digit_names_variable() -> None:
    with pytest.raises(ValueError, match="SPANK_RAPS_SPARES"):
        JobSpec.from_env({"SPANK_RAPS_ENABLED": "1", "SPANK_RAPS_SPARES": "²"})


# ---------------------------------------------------------------- record_from_env


def test_record_from_full_env() -> None:
    env = raps_env(SPANK_RAPS_SPARES="1", SPANK_RAPS_REPLICAS="2",
                   SLURM_JOB_RESTART_COUNT="3", SLURM_JOB_USER="alice",
                   SLURM_JOB_NAME="train")
    rec = record_from_env(env, 1234.5)
    assert rec == JobRecord("42", 3, 1000, ("n1", "n2", "n3", "n5"),
                            JobSpec(spares=1, replicas=2), "running", 1234.5,
                            user="alice", name="train")


def test_record_from_env_defaults() -> None:
    rec = record_from_env(raps_env(SLURM_JOB_RESTART_COUNT=""), 1.0)
    assert rec is not None
    assert rec.restart_count == 0  # a first run has no (or an empty) restart count
    assert rec.user == "" and rec.name == "" and rec.ended_at is None
    assert rec.nodes == ("n1", "n2", "n3", "n5")


def test_record_from_env_is_none_without_raps() -> None:
    env = raps_env()
    del env["SPANK_RAPS_ENABLED"]
    assert record_from_env(env, 1.0) is None


def test_record_nodes_in_natural_order() -> None:
    rec = record_from_env(raps_env(SLURM_JOB_NODELIST="n[10,2],n1"), 1.0)
    assert rec is not None and rec.nodes == ("n1", "n2", "n10")


@pytest.mark.parametrize(("change", "var"), [
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID"),
    ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID"),
    ({"SLURM_JOB_ID": "42_1"}, "SLURM_JOB_ID"),
    ({"SLURM_JOB_UID": None}, "SLURM_JOB_UID"),
    ({"SLURM_JOB_UID": "-1"}, "SLURM_JOB_UID"),
    ({"SLURM_JOB_UID": "alice"}, "SLURM_JOB_UID"),
    ({"SLURM_JOB_RESTART_COUNT": "x"}, "SLURM_JOB_RESTART_COUNT"),
    ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST"),
    ({"SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST"),
    ({"SLURM_JOB_NODELIST": "n[3-1]"}, "SLURM_JOB_NODELIST"),
    ({"SLURM_JOB_NODELIST": "n1,,n2"}, "SLURM_JOB_NODELIST"),
    ({"SPANK_RAPS_SPARES": "100"}, "SPANK_RAPS_SPARES"),
])
def test_record_from_env_bad_value_names_variable(change: dict[str, str | None],
                                                  var: str) -> None:
    env = raps_env()
    for k, v in change.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    with pytest.raises(ValueError, match=var):
        record_from_env(env, 1.0)


# ---------------------------------------------------------------- JSON round trips


def test_record_round_trip() -> None:
    full = record("7", 2, 1001, ("n1", "n10", "n2"),
                  JobSpec(spares=2, replicas=3, ckpt_interval_sec=900, ranks_per_node=4),
                  registered_at=100.25, user="bob", name="sim")
    ended = full.ended(200.5, -9)
    for rec in (record(), full, ended):
        assert JobRecord.from_json("k", rec.to_json()) == rec
    assert ended.state == "ended" and ended.ended_at == 200.5 and ended.exit_code == -9
    assert ended.registered_at == full.registered_at and ended.nodes == full.nodes


def test_a_requeued_run_keeps_the_nodes_of_the_earlier_runs() -> None:
    """A requeued run may restore from copies on nodes it no longer has: they stay nodes
    of the job for its checkpoint records (``all_nodes``), not for its ranks."""
    first = record("7", 0, 1001, ("n1", "n2", "n3"))
    second = record("7", 1, 1001, ("n2", "n4", "n5")).after(first)
    third = record("7", 2, 1001, ("n1", "n4", "n6")).after(second)
    assert second.earlier_nodes == ("n1", "n3")
    assert third.earlier_nodes == ("n2", "n3", "n5")
    assert third.all_nodes == {"n1", "n2", "n3", "n4", "n5", "n6"}
    assert third.nodes == ("n1", "n4", "n6")
    for rec in (second, third, third.ended(5.0, 0)):
        assert JobRecord.from_json("k", rec.to_json()) == rec
    # a record written before the field: no earlier nodes; a malformed one is refused
    raw = json.loads(first.to_json())
    del raw["earlier_nodes"]
    assert JobRecord.from_json("k", json.dumps(raw).encode()).earlier_nodes == ()
    raw["earlier_nodes"] = "n1"
    with pytest.raises(RecordError, match="k: field 'earlier_nodes'"):
        JobRecord.from_json("k", json.dumps(raw).encode())


def test_record_json_is_canonical() -> None:
    # Sorted keys, no spaces: byte-equal values for equal records (compare-and-swap friendly).
    raw = record().to_json()
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()


def test_rank_map_round_trip() -> None:
    for m in (RankMap("12", 1, ("n1", "n1", "n3"), ("n6",), 2, 5.0, built_by="c1"),
              RankMap("12", 0, built_at=3.0, replicas=2, error="2 nodes allocated and 2 spares"),
              RankMap("12", 0)):
        assert RankMap.from_json("k", m.to_json()) == m


def test_rank_entry_round_trip() -> None:
    for e in (RankEntry(3, "n4", 2, "assigned", ("n6", "n5")),
              RankEntry(0, "n1", 1, "assigned", ())):
        assert RankEntry.from_json("k", e.to_json()) == e


@pytest.mark.parametrize("group", [
    BackupGroup(0, "n1", "n3", ("n5", "n6")),
    BackupGroup(1, "n2", "n4", (), degraded=True, reason="job spans 2 racks (r1, r2)"),
    BackupGroup(2, "n1", None, (), degraded=True, reason="job has 1 node: no backup possible"),
    BackupGroup(3, "n1", None),  # replicas=0: primary alone, not degraded
])
def test_group_round_trip(group: BackupGroup) -> None:
    raw = group_to_json(group)
    assert group_from_json("k", raw, group.rank) == group
    shape = json.loads(raw)
    assert set(shape) == {"primary", "log_backup", "ckpt_mirrors", "degraded"}
    # ``degraded`` is null or the reason, as ``show job`` prints it.
    assert shape["degraded"] == (group.reason if group.degraded else None)


# ---------------------------------------------------------------- malformed values

KEY = "/raps/v1/jobs/12"
_MISSING = object()  # marks a field to delete


def _record_dict() -> dict[str, Any]:
    return dict(json.loads(record().to_json()))


def _with(**changes: Any) -> bytes:
    d = _record_dict()
    for k, v in changes.items():
        if v is _MISSING:
            del d[k]
        else:
            d[k] = v
    return json.dumps(d).encode()


def _with_spec(**changes: Any) -> bytes:
    d = _record_dict()
    d["spec"].update(changes)
    return json.dumps(d).encode()



@pytest.mark.parametrize(("raw", "where", "field"), [
    (b"not json", KEY, "not JSON"),
    (b"\xff\xfe", KEY, "not JSON"),
    (b"[1, 2]", KEY, "expected a JSON object, got list"),
    (b"null", KEY, "got NoneType"),
    (_with(job_id=_MISSING), KEY, "'job_id'"),
    (_with(job_id=""), KEY, "'job_id'"),
    (_with(job_id=12), KEY, "'job_id'"),
    (_with(restart_count=-1), KEY, "'restart_count'"),
    (_with(restart_count="0"), KEY, "'restart_count'"),
    (_with(restart_count=1.0), KEY, "'restart_count'"),
    (_with(owner_uid=True), KEY, "'owner_uid'"),
    (_with(owner_uid=_MISSING), KEY, "'owner_uid'"),
    (_with(nodes=[]), KEY, "'nodes'"),
    (_with(nodes="n1"), KEY, "'nodes'"),
    (_with(nodes=["n1", ""]), KEY, "'nodes'"),
    (_with(nodes=["n1", 2]), KEY, "'nodes'"),
    (_with(state="done"), KEY, "'state'"),
    (_with(state=_MISSING), KEY, "'state'"),
    (_with(registered_at="now"), KEY, "'registered_at'"),
    (_with(ended_at=False), KEY, "'ended_at'"),
    (_with(user=None), KEY, "'user'"),
    (_with(exit_code=2**40), KEY, "'exit_code'"),
    (_with(spec=_MISSING), KEY, "'spec'"),
    (_with(spec=[]), KEY, "'spec'"),
    (_with_spec(spares=65), f"{KEY} spec", "'spares'"),
    (_with_spec(spares=None), f"{KEY} spec", "'spares'"),
    (_with_spec(replicas=9), f"{KEY} spec", "'replicas'"),
    (_with_spec(ckpt_interval_sec=0), f"{KEY} spec", "'ckpt_interval_sec'"),
    (_with_spec(ranks_per_node=0), f"{KEY} spec", "'ranks_per_node'"),
])
def test_malformed_record_names_key_and_field(raw: bytes, where: str, field: str) -> None:
    with pytest.raises(RecordError) as info:
        JobRecord.from_json(KEY, raw)
    msg = str(info.value)
    assert msg.startswith(f"{where}: "), msg
    assert field in msg
    assert "\n" not in msg  # one line for the daemon's log


def test_malformed_missing_field_says_missing() -> None:
    with pytest.raises(RecordError, match=r"'owner_uid'.*<missing>"):
        JobRecord.from_json(KEY, _with(owner_uid=_MISSING))


def _mutated(value: bytes, **changes: Any) -> bytes:
    d = json.loads(value)
    d.update(changes)
    return json.dumps(d).encode()


MAP = RankMap("12", 0, ("n1",), ("n2",), 2, 1.0).to_json()
ENTRY = RankEntry(0, "n1", 1, "assigned", ("n2",)).to_json()
GROUP = group_to_json(BackupGroup(0, "n1", "n3", ("n5",)))


@pytest.mark.parametrize(("decode", "raw", "field"), [
    (lambda k, r: RankMap.from_json(k, r), _mutated(MAP, replicas=9), "'replicas'"),
    (lambda k, r: RankMap.from_json(k, r), _mutated(MAP, nodes=[""]), "'nodes'"),
    (lambda k, r: RankMap.from_json(k, r), _mutated(MAP, restart_count=-1), "'restart_count'"),
    (lambda k, r: RankMap.from_json(k, r), _mutated(MAP, error=None), "'error'"),
    (lambda k, r: RankMap.from_json(k, r), b"{", "not JSON"),
    (lambda k, r: RankEntry.from_json(k, r), _mutated(ENTRY, epoch=0), "'epoch'"),
    (lambda k, r: RankEntry.from_json(k, r), _mutated(ENTRY, rank=-1), "'rank'"),
    (lambda k, r: RankEntry.from_json(k, r), _mutated(ENTRY, node=""), "'node'"),
    (lambda k, r: RankEntry.from_json(k, r), _mutated(ENTRY, spares="n2"), "'spares'"),
    (lambda k, r: group_from_json(k, r, 0), _mutated(GROUP, primary=None), "'primary'"),
    (lambda k, r: group_from_json(k, r, 0), _mutated(GROUP, log_backup=""), "'log_backup'"),
    (lambda k, r: group_from_json(k, r, 0), _mutated(GROUP, ckpt_mirrors=None),
     "'ckpt_mirrors'"),
    (lambda k, r: group_from_json(k, r, 0), _mutated(GROUP, degraded=True), "'degraded'"),
    (lambda k, r: group_from_json(k, r, 0), b"3", "expected a JSON object"),
])
def test_malformed_map_entry_group_names_key_and_field(
        decode: Callable[[str, bytes], object], raw: bytes, field: str) -> None:
    with pytest.raises(RecordError) as info:
        decode("/raps/v1/jobs/12/x", raw)
    msg = str(info.value)
    assert msg.startswith("/raps/v1/jobs/12/x: ") and field in msg, msg


# ---------------------------------------------------------------- registration


def test_registration_create() -> None:
    assert registration(None, record()) == "create"


def test_registration_requeue() -> None:
    # A requeued run may land on other nodes; the job keeps its checkpoints.
    old = record(restart_count=0).ended(10.0, 0)
    assert registration(old, record(restart_count=1, nodes=("n1", "n2"))) == "requeue"
    assert registration(record(restart_count=1), record(restart_count=3)) == "requeue"


def test_registration_same() -> None:
    # A repeated prolog for this very run must not wipe what the leader built.
    assert registration(record(restart_count=2), record(restart_count=2)) == "same"


@pytest.mark.parametrize(("existing", "new"), [
    (record(restart_count=2), record(restart_count=1)),                  # lower count
    (record(restart_count=1).ended(5.0, 0), record(restart_count=1)),    # that run ended
    (record(owner_uid=1000), record(owner_uid=1001)),                    # another user
    (record(owner_uid=1000), record(owner_uid=1001, restart_count=1)),   # even if higher
    (record(nodes=("n1", "n2")), record(nodes=("n1", "n3"))),           # other nodes
])
def test_registration_reuse(existing: JobRecord, new: JobRecord) -> None:
    assert registration(existing, new) == "reuse"


# ---------------------------------------------------------------- choose_spares


def test_spares_spread_over_racks_of_two() -> None:
    working, spares = choose_spares(SIX, SIX_NODES, 2)
    assert len({rack_of(SIX, s) for s in spares}) == 2
    # Ties go to the first rack by name, and its last node: n2, then r2's n4.
    assert spares == ("n2", "n4")
    assert working == ("n1", "n3", "n5", "n6")


def test_spares_one_per_rack() -> None:
    nodes = [f"n{i}" for i in range(1, 10)]
    working, spares = choose_spares(NINE, nodes, 3)
    assert sorted(rack_of(NINE, s) for s in spares) == ["r1", "r2", "r3"]
    assert spares == ("n3", "n6", "n9")
    assert working == ("n1", "n2", "n4", "n5", "n7", "n8")


def test_spares_taken_from_the_fullest_rack() -> None:
    topo = make_topology({"r1": ["n1"], "r2": ["n2", "n3", "n4"]})
    _, spares = choose_spares(topo, ["n1", "n2", "n3", "n4"], 2)
    assert spares == ("n3", "n4")  # r2 keeps as many working nodes as r1


def test_spares_natural_order() -> None:
    topo = make_topology({"r1": ["n1", "n2", "n10"]})
    # Text order would put n2 last and make it the spare; n10 is the last node.
    working, spares = choose_spares(topo, ["n10", "n2", "n1"], 1)
    assert spares == ("n10",) and working == ("n1", "n2")
    working, spares = choose_spares(topo, ["n10", "n2", "n1"], 0)
    assert working == ("n1", "n2", "n10") and spares == ()


@pytest.mark.parametrize(("nodes", "count"), [(["n1", "n2"], 2), (["n1", "n2"], 3), (["n1"], 1)])
def test_spares_need_a_working_node(nodes: list[str], count: int) -> None:
    with pytest.raises(PlacementError, match=f"{count} spares asked"):
        choose_spares(SIX, nodes, count)


def test_spares_node_not_in_topology() -> None:
    with pytest.raises(PlacementError, match="'n9' is not in any rack"):
        choose_spares(SIX, ["n1", "n2", "n9"], 1)


# ---------------------------------------------------------------- build_map


def test_map_ranks_per_node_consecutive() -> None:
    rec = record(nodes=("n1", "n3", "n5"), spec=JobSpec(ranks_per_node=2))
    plan = build_map(rec, SIX, default_replicas=2, now=50.0)
    m = plan.rank_map
    assert m.error == ""
    assert m.nodes == ("n1", "n1", "n3", "n3", "n5", "n5")
    assert [e.rank for e in plan.entries] == list(range(6))
    assert [e.node for e in plan.entries] == list(m.nodes)
    assert [g.rank for g in plan.groups] == list(range(6))
    assert all(g.primary == e.node for g, e in zip(plan.groups, plan.entries, strict=True))
    assert m.job_id == "12" and m.restart_count == 0 and m.built_at == 50.0


def test_map_spares_and_entries() -> None:
    plan = build_map(record(spec=JobSpec(spares=2)), SIX, default_replicas=2, now=1.0)
    assert plan.rank_map.nodes == ("n1", "n3", "n5", "n6")
    assert plan.rank_map.spares == ("n2", "n4")
    for e in plan.entries:
        assert e.status == "assigned"
        assert sorted(e.spares) == ["n2", "n4"]  # every rank may use every spare
        assert e.epoch == 1  # no previous run


def test_map_epochs_follow_previous_run() -> None:
    plan = build_map(record(restart_count=1), SIX, default_replicas=2, now=1.0,
                     previous_epochs={0: 1, 1: 3, 7: 9})
    # Ranks the previous run did not have start at 1.
    assert [e.epoch for e in plan.entries] == [2, 4, 1, 1, 1, 1]


def test_a_new_run_keeps_the_placements_of_the_one_before() -> None:
    """A restore takes a generation only from the node that ran the rank at its epoch:
    the placements of earlier runs go with the entry."""
    plan = build_map(record(restart_count=1), SIX, default_replicas=2, now=1.0,
                     previous_epochs={0: 4}, previous_placed={0: ((4, "n3"), (3, "n1"))})
    e = plan.entries[0]
    assert e.epoch == 5 and e.placed == ((4, "n3"), (3, "n1")) and e.node_at(4) == "n3"


@pytest.mark.parametrize(("spec_replicas", "default", "want"), [
    (None, 2, 2), (None, 3, 3), (1, 3, 1), (3, 2, 3), (0, 2, 0)])
def test_map_replicas_from_spec_or_default(spec_replicas: int | None, default: int,
                                           want: int) -> None:
    rec = record(spec=JobSpec(spares=2, replicas=spec_replicas))
    plan = build_map(rec, SIX, default_replicas=default, now=1.0)
    assert plan.rank_map.replicas == want
    for g in plan.groups:
        # Six nodes in the pool leave room for every copy.
        assert len(g.ckpt_mirrors) == max(0, want - 1)
        assert (g.log_backup is None) == (want == 0)
        assert len(set(g.members)) == len(g.members) == want + 1


def test_map_error_not_exception() -> None:
    rec = record(nodes=("n1", "n2"), spec=JobSpec(spares=2))
    plan = build_map(rec, SIX, default_replicas=2, now=7.0)
    assert plan.entries == () and plan.groups == ()
    m = plan.rank_map
    assert "2 spares asked" in m.error
    assert m.nodes == () and m.spares == () and m.built_at == 7.0 and m.replicas == 2
    # The error map is stored like any other and must decode.
    assert RankMap.from_json("k", m.to_json()) == m


def test_map_error_unknown_node() -> None:
    plan = build_map(record(nodes=("n1", "x1")), SIX, default_replicas=2, now=1.0)
    assert "'x1' is not in any rack" in plan.rank_map.error


# ---------------------------------------------------------------- purge_due

GRACE = 60.0


@pytest.mark.parametrize("state", ["RUNNING", "PENDING", "CONFIGURING", "COMPLETING",
                                   "REQUEUED", "SUSPENDED"])
def test_no_purge_while_job_may_run(state: str) -> None:
    rec = record().ended(0.0, 0)  # even an ended run: a requeued job is PENDING again
    assert not purge_due(rec, state, 0.0, 1e9, GRACE)


@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL"])
def test_purge_after_grace_from_ended_at(state: str) -> None:
    rec = record().ended(100.0, 0)
    assert not purge_due(rec, state, None, 100.0 + GRACE - 0.1, GRACE)
    assert purge_due(rec, state, None, 100.0 + GRACE, GRACE)
    # The later of ended_at and the coordinator's first sighting counts: a job
    # requeued long ago and cancelled while pending gets its whole grace period.
    assert not purge_due(rec, state, 500.0, 100.0 + GRACE, GRACE)
    assert not purge_due(rec, state, 500.0, 500.0 + GRACE - 0.1, GRACE)
    assert purge_due(rec, state, 500.0, 500.0 + GRACE, GRACE)


def test_purge_gone_from_slurm_uses_final_since() -> None:
    rec = record()  # the epilog could not mark the run ended
    assert not purge_due(rec, None, None, 1e9, GRACE)  # never seen finished: keep
    assert not purge_due(rec, None, 200.0, 200.0 + GRACE - 1, GRACE)
    assert purge_due(rec, None, 200.0, 200.0 + GRACE, GRACE)


def test_purge_final_state_without_ended_at() -> None:
    rec = record()
    assert not purge_due(rec, "COMPLETED", 10.0, 10.0 + GRACE / 2, GRACE)
    assert purge_due(rec, "COMPLETED", 10.0, 10.0 + GRACE, GRACE)


def test_purge_zero_grace() -> None:
    assert purge_due(record().ended(5.0, 1), "FAILED", None, 5.0, 0.0)


def test_sweep_deletes_only_purged_jobs_data_older_than_the_purge() -> None:
    from raps_slurm.core.jobs import sweep
    local = {"5": 100.0, "6": 100.0, "7": 300.0, "10": 50.0}
    tombstones = {"5": 200.0, "7": 200.0, "10": 200.0}
    # 6: never purged; 7: dir made after the purge (a new job reusing the id, its prolog
    # ran before its registration); 10 registered again: all kept.
    assert sweep(local, tombstones, registered={"10"}) == ["5"]
    assert sweep(local, {}, registered=set()) == []
