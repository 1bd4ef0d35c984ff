"""Which checkpoint generations a restore may take (``decide.attested``) and the
placements the leader keeps for that check (``RankEntry.placed``).

Every agent may write any job's shared records; only a node's own agent writes its
commits. A generation counts only when its commit was written by the node that ran the
rank at the commit's epoch, so root on one node can forge only the ranks it ran.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from raps_slurm.core import checkpoints as decide
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import PLACEMENTS_KEPT, RankEntry
from raps_slurm.errors import RecordError

ENTRY = RankEntry(0, "n4", 3, "running", (), ((2, "n1"), (1, "n1")))


def rec(gen: int, epoch: int, primary: str, **kw: object) -> CkptRecord:
    base = CkptRecord(0, gen, epoch, f"m{gen}{primary}", 10, 10, 1, f"w{gen}", primary,
                      (primary,), 1, "under_replicated", 100.0 + gen)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def commits(*records: CkptRecord) -> dict[tuple[str, int], CkptRecord]:
    return {(r.primary, r.generation): r for r in records}


def test_a_generation_counts_only_from_the_node_that_ran_the_rank_then() -> None:
    genuine = rec(1, 1, "n1", holders=("n1", "n2"))
    forged = rec(2, 2, "n2")  # n2 (a holder, never the rank's node) commits as itself
    found, refused = decide.attested(0, [genuine, forged], commits(genuine, forged),
                                     ENTRY.node_at)
    assert found == [genuine]
    assert refused == ["generation 2: n2 did not run rank 0 at epoch 2",
                       "generation 2: no commit of its primary n2 matches the record"]


def test_a_rewritten_or_deleted_shared_record_falls_back_to_the_commit() -> None:
    c1, c2 = rec(1, 1, "n1"), rec(2, 2, "n1")
    steered = dataclasses.replace(c2, manifest_digest="made-by-n2", holders=("n2",))
    found, refused = decide.attested(0, [steered], commits(c1, c2), ENTRY.node_at,
                                     fallback_holders=("n3", "n2"))
    assert sorted((r.generation, r.manifest_digest, r.holders) for r in found) == [
        (1, "m1n1", ("n1", "n2", "n3")), (2, "m2n1", ("n1", "n2", "n3"))]
    assert [r.state for r in found] == ["under_replicated"] * 2
    assert refused == ["generation 2: no commit of its primary n1 matches the record"]


def test_a_commit_under_one_node_naming_another_is_refused() -> None:
    c = rec(1, 3, "n4")
    found, refused = decide.attested(0, [], {("n1", 1): c, ("n4", 2): c}, ENTRY.node_at)
    assert found == []
    assert refused == [
        "commit 1 under n1: it names rank 0 generation 1 primary n4",
        "commit 2 under n4: it names rank 0 generation 1 primary n4"]
    wrong_rank = dataclasses.replace(c, rank=5)
    assert decide.attested(0, [], {("n4", 1): wrong_rank}, ENTRY.node_at)[0] == []


def test_an_epoch_before_the_kept_placements_cannot_be_checked() -> None:
    old = rec(1, 1, "n1")
    short = dataclasses.replace(ENTRY, placed=((2, "n1"),))
    assert decide.attested(0, [old], commits(old), short.node_at)[0] == []
    assert decide.attested(0, [old], commits(old), ENTRY.node_at)[0] == [old]


def test_a_later_epoch_is_newer_whatever_its_number() -> None:
    """n1 ran the rank at epoch 2; after it moved, root on n1 commits generation 99 at
    epoch 2. The spare's generation at epoch 3 is still the one restored first, and of
    two commits of one number the later epoch's counts."""
    late = rec(99, 2, "n1")
    mine, again = rec(5, 3, "n4"), rec(99, 3, "n4")
    found, _ = decide.attested(0, [], commits(late, mine), ENTRY.node_at)
    assert [r.generation for r in decide.restore_order(found)] == [5, 99]
    found, _ = decide.attested(0, [], {("n1", 99): late, ("n4", 99): again}, ENTRY.node_at)
    assert found == [again]


def test_the_entry_keeps_its_earlier_placements() -> None:
    e = RankEntry(0, "n1", 1, "running", ("n4",))
    for epoch in range(2, PLACEMENTS_KEPT + 4):
        e = e.moved(f"n{epoch}", epoch, "relaunched", ())
    assert len(e.placed) == PLACEMENTS_KEPT
    assert e.placed[0] == (e.epoch - 1, f"n{e.epoch - 1}")
    assert e.node_at(e.epoch) == e.node and e.node_at(e.epoch - 1) == f"n{e.epoch - 1}"
    assert e.node_at(1) is None and e.node_at(e.epoch + 1) is None
    assert RankEntry.from_json("k", e.to_json()) == e
    # an entry written before placements were kept reads as having none
    legacy = {"rank": 0, "node": "n1", "epoch": 2, "status": "running", "spares": []}
    assert RankEntry.from_json("k", json.dumps(legacy).encode()).placed == ()


@pytest.mark.parametrize("placed", [
    "n1", [[3, "n1"]], [[0, "n1"]], [["2", "n1"]], [[2, ""]], [[2]], [[True, "n1"]],
    [[1, "n1"]] * (PLACEMENTS_KEPT + 1)])
def test_a_malformed_placement_list_is_refused(placed: object) -> None:
    raw = {"rank": 0, "node": "n1", "epoch": 3, "status": "running", "spares": [],
           "placed": placed}
    with pytest.raises(RecordError, match=r"'placed': expected at most 16 \[epoch, node\]"):
        RankEntry.from_json("jobs/7/ranks/0", json.dumps(raw).encode())

