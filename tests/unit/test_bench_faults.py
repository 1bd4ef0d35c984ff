"""``rapsctl bench faults`` without a cluster: the drawn fault plans, each run's judgement
(negative controls: every way a run can go wrong is counted) and the totals."""

from __future__ import annotations

import random
from typing import Any

import pytest

from raps_slurm.bench.faults import COMBOS, KINDS_NS, draw_faults, draw_kind, judge_run, totals
from raps_slurm.core.planner import Plan
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


def test_healthy_restarts_moves_and_held_requeues_are_totalled_and_miss_the_goal() -> None:
    ok = {"recovered": True, "healthy_restarted": 0, "healthy_moved": 0}
    t = totals([ok, {**ok, "healthy_restarted": 2}, {**ok, "healthy_moved": 1}])
    assert (t["healthy_restarted"], t["healthy_moved"]) == (2, 1)
    assert totals([ok, ok])["goals_met"]
    assert not totals([ok, {**ok, "healthy_restarted": 1}])["goals_met"]
    assert not totals([ok, {**ok, "healthy_moved": 1}])["goals_met"]
    held = {"requeued": True, "spares_left": 0, "requeue_held": "BadConstraints ..."}
    assert totals([ok, held])["requeues_held"] == 1
    assert not totals([ok, held])["goals_met"]


CLEAN = "final 1b5d354b0f5e0c45 9241b67741105f24"
OTHER = "final 1b5d354b0f5e0c45 0000000000000000"
SPARES = ["n2", "n4"]


def plan(rank: int, source: str, target: str, run: int = 0, state: str = "done") -> Plan:
    return Plan(f"p{rank}-{source}-{target}", "7", rank, source, target, 2, "DEAD", 0,
                state=state, run=run)


def output(*lines: str) -> str:
    return "".join(f"{x}\n" for x in ("raps-run: rank 0 epoch 1 started on n1", *lines))


def judge(text: str, state: str = "COMPLETED", restarts: int = 0,
          plans: list[Plan] | None = None, victims: frozenset[str] = frozenset({"n3"}),
          dead: frozenset[str] = frozenset()) -> dict[str, Any]:
    return judge_run(text, CLEAN, state, restarts, plans or [], SPARES, set(dead),
                     set(victims))


def test_a_completed_run_with_the_clean_line_and_a_move_off_the_victim_recovered() -> None:
    got = judge(output(CLEAN), plans=[plan(1, "n3", "n2")])
    assert got["recovered"] and got["result"] == "same"
    assert not (got["wrong_result"] or got["lost_data"] or got["requeued"])
    assert (got["moves"], got["healthy_moved"], got["healthy_restarted"]) == (1, 0, 0)
    assert got["spares_left"] == 1 and got["last_word"] is None
    assert totals([got])["goals_met"]


def test_a_different_final_line_is_a_wrong_result() -> None:
    got = judge(output(OTHER))
    assert got["wrong_result"] and got["result"] == "differs" and not got["recovered"]
    assert not totals([got])["goals_met"]


def test_only_the_last_final_line_counts() -> None:
    # the first run printed the clean line, the requeued run appended a wrong one
    got = judge(output(CLEAN, "raps-run: requeued", OTHER), restarts=1)
    assert got["wrong_result"] and got["requeued"] and not got["recovered"]
    # and the other way round: a wrong line followed by the clean one is the clean result
    assert judge(output(OTHER, CLEAN), restarts=1)["result"] == "same"
    # a labelled line (srun --label) is a final line too
    assert judge(output(f"0: {OTHER}"))["wrong_result"]


def test_a_failed_job_lost_its_data_even_with_the_clean_line() -> None:
    got = judge(output(CLEAN, "raps-run: rank 3 failed"), state="FAILED")
    assert got["lost_data"] and not got["recovered"] and not got["wrong_result"]
    assert got["result"] == "same" and got["last_word"] == "raps-run: rank 3 failed"
    assert not totals([got])["goals_met"]


def test_a_completed_job_without_a_final_line_lost_its_data() -> None:
    got = judge(output("step 100"))
    assert got["lost_data"] and got["result"] == "missing" and not got["recovered"]
    assert not judge("")["recovered"]


def test_a_job_that_ends_with_its_data_lost_is_counted() -> None:
    words = "raps-run: rank 2: generations [3, 4] all have bad chunks: lost"
    for state in ("FAILED", "NODE_FAIL", "CANCELLED", "TIMEOUT", "unfinished"):
        got = judge(output("step 40", words), state=state)
        assert got["lost_data"] and not got["recovered"], state
        assert got["last_word"] == words
        assert totals([got])["lost_data"] == 1


def test_a_healthy_rank_restarted_in_place_or_moved_is_counted() -> None:
    plans = [plan(1, "n3", "n2"),     # the victim's rank moved: expected
             plan(2, "n3", "n3"),     # restarted in place on the (frozen) victim: expected
             plan(0, "n1", "n1"),     # a healthy rank restarted in place
             plan(4, "n5", "n4"),     # a healthy rank moved
             plan(5, "n6", "n6", run=1, state="failed")]
    got = judge(output(CLEAN), plans=plans)
    assert (got["healthy_restarted"], got["healthy_moved"]) == (2, 1)
    assert (got["moves"], got["plans_failed"]) == (2, 1)
    assert got["recovered"]  # the result is right, but the campaign misses its goal
    assert not totals([got])["goals_met"]
    # a spare taken by a move (n2), or seen dead (n4), is not left
    assert judge(output(CLEAN), plans=plans[:1], dead=frozenset({"n4"}))["spares_left"] == 0
