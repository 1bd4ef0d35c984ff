"""The node as the unit of recovery on the real local cluster: a job with several ranks
per node loses a node (or a rack's two working nodes) and every rank of it moves
together to one spare node; a node RAPS holds DEAD but an admin resumed in Slurm gets no
ranks and causes no requeue loop. Each finishes with the failure-free result."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm.runner import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import (
    FINAL,
    HEAT_RING,
    back_in_service,
    committed,
    crashed,
    finish,
    heat_reference,
    job_plans,
    job_state,
    node_dead,
    rank_entries,
    rank_pids,
    wait_mapped,
)

HEAT = ["--steps", "160", "--every", "20", "--step-sec", "0.05"]


@contextmanager
def heat_job(cluster: LocalCluster, *sbatch: str) -> Iterator[tuple[str, Path]]:
    run = CommandRunner(timeout=60, env=cluster.env)
    job, out = cluster.submit_raps_run([sys.executable, str(HEAT_RING), *HEAT], list(sbatch),
                                       "job")
    try:
        yield job, out
    finally:
        with contextlib.suppress(SlurmCommandError):
            run.run(["scancel", job])


def mapped(store: tuple[StateStore, Keys], job: str) -> dict[str, Any]:
    return wait_mapped(*store, job)


def batch_host(cluster: LocalCluster, job: str) -> str:
    return wait_until("the batch host", lambda: cluster.slurm().job(int(job)).batch_host,
                      bool, 20)


def layout(cluster: LocalCluster, store: tuple[StateStore, Keys], job: str
           ) -> tuple[dict[str, Any], dict[int, str], str]:
    """The mapped job, its rank -> node, and the batch script's node."""
    data = mapped(store, job)
    return data, {r["rank"]: r["node"] for r in data["ranks"]}, batch_host(cluster, job)


def finish_counting_replays(cluster: LocalCluster, store: tuple[StateStore, Keys], job: str,
                            out: Path, clean: str, timeout: float) -> tuple[str, dict[int, int]]:
    """:func:`finish`, reading meanwhile each rank's message figures (they are purged soon
    after the job ends): the job's output and, per rank, the messages it sent again."""
    s, k = store
    resent: dict[int, int] = {}

    def state() -> str:
        for kv in s.get_prefix(k.rank_reports_root()):
            parts = k.split(kv.key)[2:]  # <node>/<job>/msgstats/<rank>
            if parts[1:3] != (job, "msgstats"):
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                rank = int(kv.key.rsplit("/", 1)[1])
                now = int(json.loads(kv.value)["stats"]["resent"])
                resent[rank] = max(resent.get(rank, 0), now)
        return job_state(cluster, job)

    wait_until(f"job {job} to end", state, lambda st: st in FINAL, timeout, interval=0.2)
    return finish(cluster, job, out, clean), resent


@pytest.mark.parametrize("per_node", [3, 4])
def test_a_dead_nodes_ranks_move_together_to_one_spare(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path, per_node: int) -> None:
    clean = heat_reference(tmp_path, 4 * per_node, HEAT[:4])
    with leading(f"rpn{per_node}"), heat_job(
            cluster, "--raps-spares=2", f"--raps-ranks-per-node={per_node}", "-N6") as (job, out):
        data, ranks, host = layout(cluster, store, job)
        assert len(ranks) == 4 * per_node and len(set(ranks.values())) == 4
        node = max(n for n in ranks.values() if n != host)
        victims = sorted(r for r, n in ranks.items() if n == node)
        # The node's ranks share one backup group.
        groups = {(r["group"]["log_backup"], tuple(r["group"]["ckpt_mirrors"]))
                  for r in data["ranks"] if r["node"] == node}
        assert len(groups) == 1, groups
        for r in victims:
            wait_until(f"rank {r} committed", lambda r=r: committed(*store, job, r), bool, 90)
        with crashed(cluster, store, node):
            # the crash falls between two checkpoints with messages in flight: the peers
            # send the moved ranks again what they had sent since those ranks' checkpoints
            text, resent = finish_counting_replays(cluster, store, job, out, clean, 240)
            assert sum(n for r, n in resent.items() if r not in victims) > 0, resent
            every = job_plans(*store, job)
            got = [p for p in every if p.source == node]
            assert sorted(p.rank for p in got) == victims, every
            assert {p.state for p in got} == {"done"} and {p.epoch for p in got} == {2}, \
                f"{got}\n{text[-4000:]}"
            [target] = {p.target for p in got}
            assert target in data["spares"]
            # No plan for a rank whose node did not fail: a starved rank is not hung.
            assert every == got, f"{every}\n{text[-4000:]}"
            now = rank_entries(*store, job)
            assert {r for r, e in now.items() if e.node == target} == set(victims)
            assert cluster.slurm().job(int(job)).restart_count == 0, text[-3000:]


def test_two_nodes_of_a_rack_lost_together_are_two_moves(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    clean = heat_reference(tmp_path, 8, HEAT[:4])
    with leading("rack2"), heat_job(cluster, "--raps-spares=2", "--raps-ranks-per-node=2",
                                    "-N6") as (job, out):
        data, ranks, host = layout(cluster, store, job)
        topo = cluster.slurm().topology()
        rack = next(r for r, members in topo.racks().items()
                    if set(members) <= set(ranks.values()) and host not in members)
        lost = sorted(topo.racks()[rack])
        victims = sorted(r for r, n in ranks.items() if n in lost)
        assert len(victims) == 4
        for r in victims:
            wait_until(f"rank {r} committed", lambda r=r: committed(*store, job, r), bool, 90)
        with crashed(cluster, store, *lost):
            finish(cluster, job, out, clean, timeout=240)
            every = job_plans(*store, job)
            got = [p for p in every if p.source in lost]
            assert sorted(p.rank for p in got) == victims, every
            assert {p.state for p in got} == {"done"}
            assert every == got, every  # none for a rank whose node did not fail
            by_source: dict[str, set[str]] = {}
            for p in got:
                by_source.setdefault(p.source, set()).add(p.target)
            # each lost node's ranks went to one spare, the two nodes to different spares
            assert sorted(by_source) == lost
            assert all(len(t) == 1 for t in by_source.values())
            assert set().union(*by_source.values()) == set(data["spares"])
            assert cluster.slurm().job(int(job)).restart_count == 0


def test_a_dead_node_resumed_in_slurm_gets_no_ranks_and_no_requeue_loop(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    s, k = store
    node = cluster.node_names[-1]  # never the batch host (Slurm takes the first node)
    clean = heat_reference(tmp_path, 4, HEAT[:4])
    with leading("deadresumed"):
        cluster.agent_stop(node)
        try:
            wait_until(f"{node} DEAD", lambda: node_dead(s, k, node), bool, 60)
            wait_until(f"{node} drained", lambda: cluster.slurm().node(node).state_text,
                       lambda st: "DRAIN" in st, 30)
            # An admin resumes it in Slurm; its slurmd runs, its agent stays silent.
            CommandRunner(timeout=60, env=cluster.env).run(
                ["scontrol", "update", f"NodeName={node}", "State=RESUME"])
            wait_until(f"{node} idle in Slurm", lambda: cluster.slurm().node(node).state_text,
                       lambda st: "DRAIN" not in st and "DOWN" not in st, 30)
            with heat_job(cluster, "--raps-spares=2", "-N6") as (job, out):
                data = mapped(store, job)
                assert node in cluster.slurm().job(int(job)).nodes  # Slurm did allocate it
                assert node not in {r["node"] for r in data["ranks"]}
                assert node not in data["spares"] and len(data["spares"]) == 1
                finish(cluster, job, out, clean, timeout=180)
                # No node failed during the job: no plan at all (none onto the dead node, no
                # healthy rank restarted in place).
                assert job_plans(*store, job) == []
                assert cluster.slurm().job(int(job)).restart_count == 0
                assert s.get(k.job_escalation(job)) is None
        finally:
            cluster.agent_start(node)
            back_in_service(cluster, *store, node)


def test_a_node_and_its_log_backup_lost_together_recover_without_a_requeue(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    """The correlated loss the commit rule is for: a node dies together with the node that
    holds its ranks' message log. Their committed checkpoints are whole elsewhere, and a
    rank of either that a peer needs messages from re-creates them by re-executing."""
    clean = heat_reference(tmp_path, 8, HEAT[:4])
    with leading("logbackup"), heat_job(cluster, "--raps-spares=2", "--raps-ranks-per-node=2",
                                        "-N6") as (job, out):
        data, ranks, host = layout(cluster, store, job)
        backup = {r["node"]: r["group"]["log_backup"] for r in data["ranks"]}
        # a working node whose log backup is not the batch host (losing that escalates)
        node = next(n for n in sorted(backup, reverse=True)
                    if n != host and backup[n] and backup[n] != host)
        lost = sorted({node, backup[node]})
        victims = sorted(r for r, n in ranks.items() if n in lost)
        for r in victims:
            wait_until(f"rank {r} committed", lambda r=r: committed(*store, job, r), bool, 90)
        with crashed(cluster, store, *lost):
            text = finish(cluster, job, out, clean, timeout=240)
            every = job_plans(*store, job)
            got = [p for p in every if p.source in lost]
            assert sorted({p.rank for p in got}) == victims, f"{every}\n{text[-4000:]}"
            # The log backup may be a spare: planned onto it before its own death was
            # seen, a move fails ("target ... died") and the next plan takes another spare.
            assert all(p.state == "done" or (p.state == "failed" and p.target in lost)
                       for p in got), f"{every}\n{text[-4000:]}"
            assert {p.rank for p in got if p.state == "done"} == set(victims), every
            assert every == got, every  # none for a rank whose node did not fail
            assert cluster.slurm().job(int(job)).restart_count == 0, text[-3000:]


def test_a_stopped_rank_among_four_on_a_node_is_restarted_alone_in_place(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        leading: Callable[[str], Any], tmp_path: Path) -> None:
    """SIGSTOP one of a node's 4 ranks: its node supervisor restarts it there with a new
    epoch (no new Slurm step); its 3 neighbours on the node keep running untouched."""
    clean = heat_reference(tmp_path, 16, HEAT[:4])
    with leading("stop4"), heat_job(cluster, "--raps-spares=2", "--raps-ranks-per-node=4",
                                    "-N6") as (job, out):
        _, ranks, host = layout(cluster, store, job)
        node = max(n for n in ranks.values() if n != host)
        mine = sorted(r for r, n in ranks.items() if n == node)
        victim, others = mine[-1], mine[:-1]
        wait_until(f"rank {victim} committed", lambda: committed(*store, job, victim), bool, 90)
        before = {r: wait_until(f"rank {r} running", lambda r=r: rank_pids(job, r, 1), bool, 30)
                  for r in mine}
        [pid] = before[victim]
        os.kill(pid, signal.SIGSTOP)  # alive, silent: HUNG, its node ALIVE
        try:
            wait_until(f"rank {victim} restarted", lambda: job_plans(*store, job),
                       lambda ps: any(p.rank == victim and p.state == "done" for p in ps), 90)
            # the neighbours are the same processes, still in their first epoch
            assert {r: rank_pids(job, r, 1) for r in others} == \
                {r: before[r] for r in others}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        text = finish(cluster, job, out, clean, timeout=240)
        every = job_plans(*store, job)
        assert all(p.source == p.target for p in every), every  # nothing moved
        mine_plans = [p for p in every if p.rank == victim]
        assert [(p.source, p.epoch, p.state) for p in mine_plans] == [(node, 2, "done")], \
            f"{every}\n{text[-3000:]}"
        assert "hung" in mine_plans[0].reason
        assert cluster.slurm().job(int(job)).restart_count == 0
