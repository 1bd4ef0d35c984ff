"""A short seeded fault campaign (``rapsctl bench faults``' runs) on the session cluster:
heat_ring and random programs under crashed and frozen nodes end with their failure-free
results, a job is requeued only when no spare remained, and no rank of a node no fault
touched is restarted or moved. Seed 20's three runs here: heat_ring and a rack (one node
frozen, one crashed), a random program and a working node crashed with the node of its
log backup, heat_ring and a rack again. Its fourth run, the random program and one
working node crashed, is the second run without the backup's loss (38 s); its fifth, a
rack of two crashed nodes, proved nothing the first ones and test_node_recovery's rack
test do not; a rack and one more node, which leaves no spare, is test_recovery's no-spare
requeue and ``rapsctl bench faults``' longer campaigns."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from raps_slurm.bench.faults import campaign
from raps_slurm.testing.cluster import LocalCluster

RUNS, SEED = 3, 20


# three jobs of 20-60 s each on a loaded 2-core machine, and their failure-free references
@pytest.mark.timeout(360)
def test_a_seeded_fault_campaign_loses_no_data_and_computes_no_wrong_result(
        cluster: LocalCluster, leading: Callable[[str], Any]) -> None:
    with leading("faults"):
        result = campaign(cluster, RUNS, SEED, say=print)
    totals, runs = result["totals"], result["runs"]
    report = json.dumps(runs, indent=1)
    assert totals["runs"] == RUNS
    assert totals["errors"] == 0, report
    assert totals["wrong_results"] == 0, report
    assert totals["lost_data"] == 0, report
    assert totals["requeued_with_spare_left"] == 0, report
    assert totals["recovered"] + totals["requeued"] == RUNS, report
    # no healthy rank restarted or moved, no requeue the harness had to rescue
    assert totals["healthy_restarted"] == 0, report
    assert totals["healthy_moved"] == 0, report
    assert totals["requeues_held"] == 0, report
    assert totals["goals_met"] is True, report
