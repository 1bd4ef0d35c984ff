"""A leader elected after a node's agent went (its registration gone with its lease)
still watches that node, because it holds ranks of a running job, and declares it DEAD:
the cycle tells the detection loop which nodes hold ranks, and a watched node with no
address to probe counts each probe as failed."""

from __future__ import annotations

import json

from leader_world import World, step

from raps_slurm.config import parse_config
from raps_slurm.coordinator.detection import Detection
from raps_slurm.coordinator.heartbeats import HeartbeatServer
from raps_slurm.core.jobs import RankEntry
from raps_slurm.model import NodeInfo, NodeState

KEY = b"k" * 32


def test_the_cycle_places_the_nodes_that_hold_ranks_of_running_jobs(world: World) -> None:
    c = world.coordinator("c1")
    step(c, world, 2)  # maps job 7 (ranks on n1 n3 n5 n6, spares n2 n4), then reads it
    assert world.placed[-1] == {"n1", "n3", "n5", "n6"}
    # rank 3 moved from n6 to n2: its entry, not the first mapping, says where it runs
    entry = world.entry(3)
    world.store.put(world.keys.job_rank("7", 3), RankEntry(
        3, "n2", entry.epoch + 1, entry.status, entry.spares).to_json())
    step(c, world)
    assert world.placed[-1] == {"n1", "n2", "n3", "n5"}
    world.state = "COMPLETED"
    rec = json.loads(world.store.get(world.keys.job("7")).value)  # type: ignore[union-attr]
    rec["state"] = "completed"
    world.store.put(world.keys.job("7"), json.dumps(rec).encode())
    step(c, world)
    assert world.placed[-1] == frozenset()


def run_detection(world: World, placed: frozenset[str], seconds: float) -> list[str]:
    """A fresh leader's detection loop, told ``placed``, ticked for ``seconds``: the
    verdict lines it gave. No node registered and no heartbeat comes."""
    c = world.coordinator("c1")
    step(c, world)
    server = HeartbeatServer(("127.0.0.1", 0), KEY, max_skew=5.0, leader_revision=lambda: 1)
    drained: list[str] = []
    det = Detection(parse_config({}), world.store, world.keys, c.leadership, server,
                    node_info=lambda n: NodeInfo(n, NodeState.ALLOCATED),
                    drain=lambda node, reason: drained.append(node), clock=world.clock)
    lines: list[str] = []
    try:
        det.placed_nodes(placed)
        end = world.clock() + seconds
        while world.clock() < end:
            lines += det.tick()
            step(c, world)  # keeps the lease; 0.2 s of the world's clock
    finally:
        det.close()
    assert drained == [line.split()[1] for line in lines if line.startswith("DEAD")]
    return lines


def test_a_placed_node_never_heard_from_gets_its_dead_verdict(world: World) -> None:
    lines = run_detection(world, frozenset({"n6"}), 30.0)
    assert lines == ["DEAD n6"]
    verdict = world.store.get(world.keys.node_verdict("n6"))
    assert verdict is not None and json.loads(verdict.value)["kind"] == "DEAD"


def test_a_node_neither_registered_nor_placed_gets_no_verdict(world: World) -> None:
    assert run_detection(world, frozenset(), 30.0) == []
    assert world.store.get(world.keys.node_verdict("n6")) is None
