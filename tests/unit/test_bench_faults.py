"""``rapsctl bench faults`` without a cluster: the drawn fault plans and the totals."""

from __future__ import annotations

import random
from typing import Any

import pytest

from raps_slurm.bench.faults import COMBOS, KINDS_NS, draw_faults, draw_kind, totals
from raps_slurm.errors import BenchError

RACKS: dict[str, tuple[str, ...]] = {"s1": ("n1", "n2"), "s2": ("n3", "n4"), "s3": ("n5", "n6")}


def view(nodes: list[str], backups: list[str], spares: list[str]) -> dict[str, Any]:
    return {"spares": spares,
            "ranks": [{"rank": r, "node": n, "group": {"log_backup": b, "ckpt_mirrors": [b]}}
                      for r, (n, b) in enumerate(zip(nodes, backups, strict=True))]}


def test_drawn_plans_have_one_to_three_victims_and_never_the_batch_host() -> None:
    v = view(["n1", "n3", "n5", "n6"], ["n3", "n5", "n2", "n1"], ["n2", "n4"])
    rng = random.Random(3)
    seen = set()
    for _ in range(300):
        combo, faults = draw_faults(rng, v, "n1", RACKS)
        seen.add(combo)
        nodes = [f.node for f in faults]
        assert 1 <= len(nodes) <= 3 and len(set(nodes)) == len(nodes)
        assert "n1" not in nodes
        assert all(f.kind in ("crash", "freeze") for f in faults)
        assert all((f.hold_s is not None) == (f.kind == "freeze") for f in faults)
        assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
        if combo == "primary+backup":
            [p] = [f.node for f in faults if f.role == "primary"]
            assert {f.node for f in faults if f.role == "backup"} == {
                r["group"]["log_backup"] for r in v["ranks"] if r["node"] == p}
        if combo.startswith("rack"):
            assert tuple(sorted(f.node for f in faults if f.role == "rack")) in RACKS.values()
    assert seen == set(COMBOS)


def test_the_same_seed_draws_the_same_plans() -> None:
    v = view(["n1", "n3", "n5", "n6"], ["n3", "n5", "n2", "n1"], ["n2", "n4"])
    a, b = random.Random(9), random.Random(9)
    assert [draw_faults(a, v, "n1", RACKS) for _ in range(20)] == \
        [draw_faults(b, v, "n1", RACKS) for _ in range(20)]


def test_with_partitions_every_kind_is_drawn_and_a_held_fault_has_its_hold() -> None:
    v = view(["n1", "n3", "n5", "n6"], ["n3", "n5", "n2", "n1"], ["n2", "n4"])
    rng = random.Random(5)
    kinds = [f.kind for _ in range(300) for f in draw_faults(rng, v, "n1", RACKS, KINDS_NS)[1]]
    counts = {k: kinds.count(k) for k in KINDS_NS}
    # 50 / 25 / 25 %: each within a wide band of its share of 500+ faults
    assert 0.4 < counts["crash"] / len(kinds) < 0.6, counts
    assert 0.15 < counts["partition"] / len(kinds) < 0.35, counts
    rng = random.Random(5)
    for _ in range(100):
        for f in draw_faults(rng, v, "n1", RACKS, KINDS_NS)[1]:
            assert (f.hold_s is not None) == (f.kind != "crash"), f


def test_kinds_drawn_one_alone_or_a_known_set_only() -> None:
    rng = random.Random(1)
    assert {draw_kind(rng, ("partition",)) for _ in range(20)} == {"partition"}
    with pytest.raises(BenchError, match="fault kinds"):
        draw_kind(rng, ("crash", "partition"))


def test_totals_count_outcomes_and_a_requeue_with_a_spare_left_misses_the_goal() -> None:
    ok = {"recovered": True, "faults": [{"kind": "crash"}]}
    requeued = {"requeued": True, "spares_left": 0, "faults": [{"kind": "freeze"}]}
    cut = {"recovered": True, "faults": [{"kind": "partition"}, {"kind": "crash"}]}
    t = totals([ok, requeued, cut])
    assert (t["runs"], t["recovered"], t["requeued"], t["crashes"], t["freezes"],
            t["partitions"]) == (3, 2, 1, 2, 1, 1)
    assert t["goals_met"]
    assert not totals([ok, {**requeued, "spares_left": 1}])["goals_met"]
    assert not totals([ok, {"lost_data": True}])["goals_met"]
    assert not totals([ok, {"error": "boom"}])["goals_met"]
