"""An agent deletes what its node reported about jobs the leader purged, and nothing else
(``raps_slurm/agent/sweep.py``): the leader's purge misses a node that was down, or that a
requeue took out of the job."""

from __future__ import annotations

import json

from raps_slurm.agent.sweep import sweep_reports
from raps_slurm.store import Keys
from raps_slurm.store.memory import MemoryStore


def test_a_node_deletes_its_own_reports_of_purged_jobs_alone() -> None:
    store, k = MemoryStore(), Keys()
    for node in ("n1", "n2"):
        for job in ("5", "6", "50"):
            store.put(k.job_peer(node, job, 0), b"{}")
            store.put(k.plan_event(node, f"{job}-0-2", "running"), b"{}")
    store.put(k.purged("5"), json.dumps({"purged_at": 1.0}).encode())
    store.put(k.purged("6"), json.dumps({"purged_at": 1.0}).encode())
    store.put(k.job("6"), b"{}")  # job id 6 registered again since: its reports stay
    assert sweep_reports(store, k, "n1") == ["5"]
    assert store.get(k.job_peer("n1", "5", 0)) is None
    assert store.get(k.plan_event("n1", "5-0-2", "running")) is None
    for key in (k.job_peer("n1", "50", 0), k.plan_event("n1", "50-0-2", "running"),
                k.job_peer("n1", "6", 0), k.job_peer("n2", "5", 0),
                k.plan_event("n2", "5-0-2", "running")):
        assert store.get(key) is not None, key
    assert sweep_reports(store, k, "n3") == []  # nothing reported: one read, nothing done
