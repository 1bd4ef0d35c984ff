"""An unprivileged user attacks her own node's root agent while another user's job runs
on that node (the bounds of docs/architecture.md, Trust boundaries and Per-job quotas).

bob owns a job with one rank on n1, where alice's rank 0 runs. Through n1's agent socket
he saves a state that declares 2 GiB of zeros (a few KiB on disk), restores it, then
sends at once more restores than his uid may have waiting and a flood of log reads
(``raps_slurm.testing.attacks``). The restore hands him the whole declared size while
the agent allocates only the stored part; the agent's memory (the RSS of its pid,
sampled throughout) grows by a small fraction of what he declared; his restores beyond
``agent.uid_restores_at_once`` and the queue behind it are refused with kind ``busy``
and counted in n1's health sample; alice's job finishes with its failure-free result,
no node is drained and none is held dead.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from raps_slurm.agent.uid_limits import QUEUE
from raps_slurm.config import load_file, node_dir
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import (
    FINAL,
    HEAT_RING,
    finish,
    heat_reference,
    job_state,
    node_dead,
    wait_mapped,
)
from tests.integration.test_two_users import NODES, users  # noqa: F401

VICTIM_ARGS = ("--steps", "300", "--every", "50", "--step-sec", "0.05")

DECLARED_MB = 2048  # what bob's state declares: zeros
FLOOD = QUEUE + 32  # restores bob sends at once: more than may wait behind the one running


class PeakRss:
    """The largest RSS a process reaches while the block runs (sampled every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.start = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _refused(s: StateStore, k: Keys, node: str) -> dict[str, int]:
    """What the node's agent says its local API refused since it started, by kind."""
    kv = s.get(k.node_health(node))
    if kv is None:
        return {}
    return dict(json.loads(kv.value).get("rejected", {}).get("local_api", {}))


def _submit_attack(cluster: LocalCluster, socket_path: str, go: Path) -> tuple[str, Path]:
    """bob's job: one node (n1, beside alice's rank 0), the attack as its batch script."""
    out = cluster.run_dir / "jobs"
    out.mkdir(exist_ok=True)
    out.chmod(0o777)
    script = out / "attack-agent.sh"
    script.write_text(f"#!/bin/bash\nexec {sys.executable} -m raps_slurm.testing.attacks agent "
                      f"{socket_path} $SLURM_JOB_ID {DECLARED_MB} {FLOOD} --go {go}\n")
    job = CommandRunner(timeout=60, env=cluster.env).run(
        ["sbatch", "--parsable", "--uid=raps-it-bob", "-o", str(out / "attack-agent-%j.out"),
         "--raps", "--raps-spares=0", "-N1", "-w", "n1", str(script)]).strip().split(";")[0]
    return job, out / f"attack-agent-{job}.out"


@pytest.mark.usefixtures("users")  # alice and bob exist
def test_a_users_restores_and_log_reads_leave_the_agent_and_another_job_alone(
        cluster: LocalCluster, store: tuple[StateStore, Keys], leading: Callable[..., Any],
        tmp_path: Path) -> None:
    s, k = store
    cfg = load_file(cluster.config_path)
    clean = heat_reference(tmp_path, len(NODES), VICTIM_ARGS)
    agent_pid = int((cluster.run_dir / "pids" / "agent-n1.pid").read_text())
    before = _refused(s, k, "n1")
    go = cluster.run_dir / "jobs" / f"go-{os.getpid()}"
    with leading("c-attack"):
        victim, victim_out = cluster.submit_raps_run(
            [sys.executable, str(HEAT_RING), *VICTIM_ARGS],
            ["--uid=raps-it-alice", "--raps-spares=0", f"-N{len(NODES)}", "-w", ",".join(NODES)],
            "victim-agent")
        attacker, attack_out = _submit_attack(cluster, node_dir(cfg.agent.socket_path, "n1"), go)
        try:
            wait_mapped(s, k, victim)
            wait_mapped(s, k, attacker)
            with PeakRss(agent_pid) as rss:
                go.touch()
                wait_until(f"bob's job {attacker} to end", lambda: job_state(cluster, attacker),
                           lambda st: st in FINAL, 240)
            assert job_state(cluster, victim) == "RUNNING", \
                "alice's job ended before the attack did: it proves nothing (make it longer)"
            finish(cluster, victim, victim_out, clean)
        finally:
            go.unlink(missing_ok=True)
            for job in (victim, attacker):
                if job_state(cluster, job) not in FINAL:
                    CommandRunner(timeout=60, env=cluster.env).run(["scancel", job])
        assert job_state(cluster, attacker) == "COMPLETED", attack_out.read_text()[-3000:]
        seen = json.loads(attack_out.read_text().splitlines()[-1])
        declared = DECLARED_MB << 20
        # the whole declared state, of which only what is stored was allocated
        assert seen["restored"]["size"] >= declared, seen
        assert seen["restored"]["allocated"] < declared // 64, seen
        grown = rss.peak - rss.start
        assert grown < declared // 8, (f"the agent's RSS grew by {grown} bytes while bob "
                                       f"restored {declared}", seen)
        restores = seen["flood"]["ckpt_restore"]
        assert sum(restores.values()) == FLOOD and set(restores) <= {"ok", "busy"}, seen
        # one runs, QUEUE wait: the rest is refused
        assert restores.get("busy", 0) >= 1 and restores.get("ok", 0) >= 1, seen
        assert set(seen["flood"]["log_read"]) <= {"ok", "busy"}, seen
        busy = sum(c.get("busy", 0) for c in seen["flood"].values())
        wait_until("n1's health sample counting bob's refusals", lambda: _refused(s, k, "n1"),
                   lambda now: now.get("busy", 0) - before.get("busy", 0) >= busy, 30)
        for node in cluster.node_names:
            assert not node_dead(s, k, node), f"{node} held dead during the attack"
            state = cluster.slurm().node(node).state_text
            assert "DRAIN" not in state and "DOWN" not in state, (node, state)
