"""Ranks talking through the real agents: peers found through the agents, logs flushed to
the agents and copied to the log backup, a crashed rank relaunched on a node that holds
nothing, restored from its checkpoint and its log, its peers replaying."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from raps_slurm.config import load_file, node_dir
from raps_slurm.core.jobs import RankEntry, group_to_json
from raps_slurm.model import BackupGroup
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import agent_job, rank_report

REPO = Path(__file__).resolve().parents[2]
NODES = ("n1", "n2", "n3")


def setup_job(store: tuple[StateStore, Keys]) -> str:
    return agent_job(*store, NODES)


def start(cluster: LocalCluster, job: str, rank: int, node: str, epoch: int,
          *extra: str) -> subprocess.Popen[str]:
    cfg = load_file(cluster.config_path)
    env = {**os.environ, "RAPS_AGENT_SOCKET": node_dir(cfg.agent.socket_path, node),
           "RAPS_JOB": job, "RAPS_RANK": str(rank), "RAPS_SIZE": str(len(NODES)),
           "RAPS_EPOCH": str(epoch), "RAPS_CONFIG": str(cluster.config_path),
           "RAPS_APP_HEARTBEAT_SEC": "1"}
    return subprocess.Popen([sys.executable, str(REPO / "examples" / "heat_ring.py"),
                             "--steps", "150", "--every", "30", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd="/")


def final_line(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    [line] = [x for x in out.splitlines() if x.startswith("final ")]
    return line


def stats(store: tuple[StateStore, Keys], job: str, rank: int) -> dict[str, Any] | None:
    s, k = store
    kv = rank_report(s, k, job, "msgstats", rank)
    return None if kv is None else dict(json.loads(kv.value))


def test_crashed_rank_relaunched_elsewhere_replays_to_the_same_result(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Any) -> None:
    s, k = store
    clean_job = setup_job(store)
    procs = [start(cluster, clean_job, r, n, 1) for r, n in enumerate(NODES)]
    clean = final_line(procs[0])
    for p in procs[1:]:
        final_line_or_done(p)

    job = setup_job(store)
    procs = [start(cluster, job, r, n, 1, "--die-at", "100") for r, n in enumerate(NODES)]
    victim = procs[2]
    victim.wait(120)
    assert victim.returncode == 17, victim.stderr.read() if victim.stderr else ""
    # What recovery does: a new epoch for the rank on a spare, then the relaunch there.
    s.put(k.job_rank(job, 2), RankEntry(2, "n5", 2, "running", (), ((1, NODES[2]),)).to_json())
    s.put(k.job_group(job, 2), group_to_json(BackupGroup(2, "n5", "n4", ())))
    again = start(cluster, job, 2, "n5", 2, "--die-at", "100")
    assert final_line(procs[0]) == clean
    final_line_or_done(procs[1])
    final_line_or_done(again)
    # the rank's log came from its log backup: n5 holds the segments now too
    logs = cluster.run_dir / "ckpt" / "n5" / f"job-{job}" / "logs" / "2"
    assert logs.is_dir() and any(logs.glob("*.seg"))
    got = wait_until("rank 0's message-log figures", lambda: stats(store, job, 0),
                     lambda v: v is not None, 10)
    assert got is not None and got["stats"]["peers"]["2"]["sent"] > 0
    out = rapsctl("inspect", "--job", job, "--message-log").stdout
    print(out)
    assert "0->2" in out and "delivered" in out.splitlines()[0]
    rows = {r["pair"]: r for r in json.loads(
        rapsctl("inspect", "--job", job, "--message-log", "--json").stdout)["pairs"]}
    assert rows["1->2"]["sent"] == rows["1->2"]["delivered"] > 0


def final_line_or_done(proc: subprocess.Popen[str]) -> None:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
