"""Replica boost: a failing rack's ranks get one more mirror in the healthiest other rack,
the agents' targets include it, and it goes when the rack heals."""

from __future__ import annotations

from raps_slurm.core.boost import boost
from raps_slurm.core.checkpoints import replica_targets
from raps_slurm.model import BackupGroup

RACK = {"n1": "r1", "n2": "r1", "n3": "r2", "n4": "r2", "n5": "r3", "n6": "r3",
        "n7": "r4", "n8": "r4"}
POOL = sorted(RACK)


def groups() -> dict[int, BackupGroup]:
    return {0: BackupGroup(0, "n1", "n3", ("n5",)), 1: BackupGroup(1, "n3", "n5", ("n1",)),
            2: BackupGroup(2, "n5", "n1", ("n3",))}


def test_a_low_scoring_rack_boosts_its_ranks_only() -> None:
    scores = {"r1": 0.3, "r2": 1.0, "r3": 0.9, "r4": 0.95}
    out = boost(groups(), 2, RACK, scores, POOL, (), 0.5, 0.8, 1)
    assert set(out) == {0}                      # rank 0 runs in r1
    assert out[0].ckpt_mirrors == ("n5", "n7")  # r4: best score among racks not in the group
    # already boosted: nothing more
    assert boost({0: out[0]}, 2, RACK, scores, POOL, (), 0.5, 0.8, 1) == {}


def test_dead_nodes_and_the_failing_rack_are_skipped() -> None:
    scores = {"r1": 0.3, "r2": 1.0, "r3": 0.9, "r4": 0.95}
    out = boost(groups(), 2, RACK, scores, POOL, {"n7", "n8"}, 0.5, 0.8, 1)
    assert out[0].ckpt_mirrors == ("n5", "n4")  # r4 dead: a used rack, the best-scoring one
    only_home = {0: BackupGroup(0, "n1", "n3", ("n5",))}
    assert boost(only_home, 2, RACK, scores, ["n1", "n2", "n3", "n5"], (), 0.5, 0.8, 1) == {}
    assert boost(groups(), 2, RACK, scores, POOL, (), 0.5, 0.8, 0) == {}  # boost off


def test_hysteresis_and_recovery() -> None:
    boosted = {0: BackupGroup(0, "n1", "n3", ("n5", "n7"))}
    assert boost(boosted, 2, RACK, {"r1": 0.6}, POOL, (), 0.5, 0.8, 1) == {}   # in between
    back = boost(boosted, 2, RACK, {"r1": 0.85}, POOL, (), 0.5, 0.8, 1)
    assert back[0].ckpt_mirrors == ("n5",)


def test_agents_copy_to_a_boosted_groups_extra_mirror() -> None:
    g = BackupGroup(0, "n1", "n3", ("n5", "n7"))
    assert replica_targets(g, "n1", 2) == ["n3", "n5", "n7"]
    assert replica_targets(BackupGroup(0, "n1", "n3", ("n5",)), "n1", 2) == ["n3", "n5"]
    # the rank moved to n2: the old primary is a copy too, within the listed count
    assert replica_targets(BackupGroup(0, "n1", "n3", ("n5",)), "n2", 2) == ["n3", "n5"]
    assert replica_targets(None, "n1", 2) == []
