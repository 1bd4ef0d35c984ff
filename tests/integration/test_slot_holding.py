"""Finding 5 of the isolation work: a second uid holds the connection slots of another
user's ranks while her job runs. bob watches the host's listening TCP sockets and keeps
34 idle connections open to every one alice's processes open (more than a rank's 32
handshake slots), from another address (127.0.0.2: a host of the network), replacing
each the rank closes. The ranks evict his connections for their peers' (gate.py: his
address holds at most half the slots, the oldest of the heaviest address goes first, a
handshake has 5 s), alice's job finishes with its failure-free result, and each rank
counts what it evicted. Before the slots were bounded per source, every connection
past bob's 32 was refused, the peers' among them, until his timed out (10 to 40 s),
and nothing was evicted: the job only got through in those gaps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import agent_job, heat_reference
from tests.integration.test_two_users import ARGS, NODES, _peer, _rank, users  # noqa: F401

HOLD = 34  # connections bob keeps to each listener: more than MAX_HANDSHAKES



def test_slots_held_by_another_user_do_not_stop_a_job(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        users: tuple[int, int], tmp_path: Path) -> None:  # noqa: F811 (the fixture)
    alice, bob = users
    s, k = store
    clean = heat_reference(tmp_path, len(NODES), ARGS)
    job = agent_job(s, k, NODES, owner=alice, user="raps-it-alice")
    holder = subprocess.Popen([sys.executable, "-m", "raps_slurm.testing.attacks", "hold",
                               str(alice), str(HOLD), "127.0.0.2"],
                              user=bob, cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    procs = []
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        procs = [_rank(cluster, job, r, alice) for r in range(len(NODES))]
        finals = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            finals += [x for x in out.splitlines() if x.startswith("final ")]
        assert holder.poll() is None, holder.communicate()[1][-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        try:
            out, err = holder.communicate("stop\n", timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
            out, err = holder.communicate()
    attack = json.loads(out.splitlines()[-1])
    assert finals[:1] == [clean]  # rank 0 prints the result
    # bob held every rank's listener with more connections than it has slots
    assert attack["ports"] >= len(NODES) and attack["opened"] >= HOLD * len(NODES), attack
    for r in range(len(NODES)):
        stats = wait_until(f"rank {r}'s message figures",
                           lambda r=r: s.get(k.job_msgstats(NODES[r], job, r)),
                           lambda kv: kv is not None, 30)
        refused = json.loads(stats.value)["stats"]["refused_connections"]
        assert refused.get("source", 0) + refused.get("evicted", 0) >= 1, (r, refused)
        assert _peer(store, job, r) is not None
    s.delete_prefix(k.job(job))
