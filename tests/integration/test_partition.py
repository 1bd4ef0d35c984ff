"""Real network partitions: a cluster in namespace mode (``RAPS_CLUSTER_NET=ns``: each node
in its own network namespace, racks as bridges, etcd members on the core bridge), a link
taken down while everything on both sides keeps running. What a pulled cable or a dead
switch port does on a real cluster; docs/detection.md says what each case stands for.

The cluster here is this module's own (4 nodes in 2 racks, 3 etcd members, ports at
RAPS_CLUSTER_PORT + 50, so it never meets the session's loopback cluster), brought up once
and always down."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.bench.faults import campaign
from raps_slurm.config import DetectionConfig, load_file
from raps_slurm.coordinator.election import LOG_TIME, read_leader
from raps_slurm.core.jobs import RankEntry
from raps_slurm.errors import SlurmCommandError, StoreUnavailable
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import (
    CoordinatorProcess,
    LocalCluster,
    cluster_for_tests,
    wait_until,
)
from raps_slurm.testing.jobs import (
    HEAT_RING,
    back_in_service,
    crashed,
    finish,
    heat_reference,
    job_plans,
    rank_entries,
    rank_pids,
)
from raps_slurm.testing.jobs import committed as committed_generations

HEAT = ["--steps", "240", "--every", "20"]
PORT_OFFSET = 50  # the module's cluster beside the session's (bases 50 apart differ in 10.S)

Store = tuple[StateStore, Keys]


def _netns_missing() -> str:
    """Why this kernel (or user) cannot build the namespace cluster, or '' when it can."""
    probe = f"rcprobe{os.getpid() % 100000}"
    for argv in (["ip", "netns", "add", probe], ["ip", "netns", "del", probe],
                 ["ip", "link", "add", probe, "type", "bridge"], ["ip", "link", "del", probe]):
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
        except FileNotFoundError:
            return "the ip program (iproute2) is not installed"
        if proc.returncode != 0:
            return f"cannot create network namespaces and bridges here ({' '.join(argv)}: " \
                   f"{proc.stderr.strip()})"
    return ""


@pytest.fixture(scope="module")
def ns_cluster() -> Iterator[LocalCluster]:
    why = _netns_missing()
    if why:  # a failure, not a skip: a skipped partition test proves nothing (CI can)
        pytest.fail(why)
    # Three etcd members, each in a namespace of its own on the core bridge: one of them
    # can be cut off while the store keeps its quorum. A request to the cut member fails
    # over to the next one only after store.timeout_sec: at the default 5 s, longer than
    # the profile's 3 s leader lease, a cut member cost the leader its lead and, without
    # acks, every agent its ranks (measured). 1 s fits a fail-over in every lease.
    with cluster_for_tests("raps-nscluster-", net="ns", port_offset=PORT_OFFSET,
                           nodes=4, racks=2, etcd_members=3, store_timeout=1.0) as c:
        yield c


@pytest.fixture(scope="module")
def ns_store(ns_cluster: LocalCluster) -> Iterator[Store]:
    s, keys = open_store(load_file(ns_cluster.config_path).store)
    with s:
        yield s, keys


def leader_of(cluster: LocalCluster) -> str:
    """``rapsctl ping``'s answer (names the leader)."""
    return subprocess.run(
        [sys.executable, "-m", "raps_slurm.cli", "--config", str(cluster.config_path), "ping"],
        env={**os.environ, **cluster.env}, capture_output=True, text=True, timeout=60,
        check=False).stdout


@pytest.fixture(scope="module")
def ns_leader(ns_cluster: LocalCluster) -> Iterator[CoordinatorProcess]:
    """One coordinator in head namespace h1 (on the core bridge, where a partition can cut
    it off), leading."""
    c = ns_cluster.coordinator("part").start(head=1)
    try:
        wait_until("coordinator 'part' to lead", lambda: leader_of(ns_cluster),
                   lambda out: "leader part " in out, timeout=30)
        yield c
    finally:
        assert c.stop() == 0, c.log()[-2000:]


def detection(cluster: LocalCluster) -> DetectionConfig:
    return load_file(cluster.config_path).detection


def miss_window(d: DetectionConfig) -> float:
    return d.kernel_heartbeat_interval_sec * d.miss_threshold


def verdict(store: Store, node: str) -> dict[str, Any] | None:
    s, keys = store
    kv = s.get(keys.node_verdict(node))
    return None if kv is None else dict(json.loads(kv.value))


def kinds_seen(store: Store, node: str, seconds: float) -> list[str]:
    """The node's verdict kinds, polled every 50 ms for ``seconds`` (a DEAD verdict also
    drains the node and plans its ranks' moves, which the callers check as well)."""
    seen: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        v = verdict(store, node)
        if v is not None and (not seen or seen[-1] != v["kind"]):
            seen.append(v["kind"])
        time.sleep(0.05)
    return seen


@contextmanager
def heat_job(cluster: LocalCluster, *sbatch: str) -> Iterator[tuple[str, Path]]:
    """A --raps job running heat_ring under raps-run; cancelled when the block ends."""
    job, out = cluster.submit_raps_run(
        [sys.executable, str(HEAT_RING), *HEAT, "--step-sec", "0.05"], list(sbatch), "part")
    try:
        yield job, out
    except BaseException:
        # the cluster's run dir goes with the module: keep its logs for the diagnosis
        kept = Path(tempfile.mkdtemp(prefix=f"raps-partition-job{job}-"))
        with contextlib.suppress(OSError):
            shutil.copytree(cluster.run_dir / "log", kept / "log")
            shutil.copytree(cluster.run_dir / "jobs", kept / "jobs")
        print(f"job {job}: {cluster.slurm().job(int(job)).state}; logs kept in {kept}; "
              f"its output:\n{out.read_text()[-3000:] if out.exists() else '(none)'}")
        raise
    finally:
        with contextlib.suppress(SlurmCommandError):
            CommandRunner(timeout=60, env=cluster.env).run(["scancel", job])


def victim_of(cluster: LocalCluster, store: Store, job: str, ranks: int) -> tuple[int, str]:
    """The last rank not on the batch script's node (losing the batch host escalates, which
    the recovery tests cover), and its node, once every rank committed a checkpoint."""
    entries = wait_until(f"job {job} mapped", lambda: rank_entries(*store, job),
                         lambda e: len(e) == ranks, 60)
    host = wait_until("the batch host", lambda: cluster.slurm().job(int(job)).batch_host,
                      bool, 20)
    rank = max(r for r, e in entries.items() if e.node != host)
    wait_until(f"rank {rank} committed", lambda: committed_generations(*store, job, rank),
               bool, 60)
    return rank, entries[rank].node


def gone(pids: list[int]) -> bool:
    """None of ``pids`` runs any more (exited, or a zombie waiting to be reaped)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return False
    return True


def test_partitioned_node_is_dead_its_rank_moves_and_its_copy_fenced_itself_first(
        ns_cluster: LocalCluster, ns_store: Store, ns_leader: CoordinatorProcess,
        tmp_path: Path) -> None:
    cluster, (s, keys) = ns_cluster, ns_store
    d = detection(cluster)
    clean = heat_reference(tmp_path, 3, HEAT)
    with heat_job(cluster, "--raps-spares=1", "-N4") as (job, out):
        rank, node = victim_of(cluster, ns_store, job, 3)
        old = wait_until(f"rank {rank} epoch 1 running", lambda: rank_pids(job, rank, 1),
                         bool, 20)
        before = verdict(ns_store, node)
        start = time.monotonic()
        cluster.partition(node)
        cut = time.monotonic()  # the link went down between start and cut
        fenced_at = dead_at = None
        moved_rev = 0
        try:
            deadline = cut + 60
            while (fenced_at is None or dead_at is None or not moved_rev) \
                    and time.monotonic() < deadline:
                now = time.monotonic()
                if fenced_at is None and gone(old):
                    fenced_at = now
                v = verdict(ns_store, node)
                if dead_at is None and v is not None and v != before and v["kind"] == "DEAD":
                    dead_at = now
                kv = s.get(keys.job_rank(job, rank))
                if not moved_rev and kv is not None \
                        and RankEntry.from_json(kv.key, kv.value).epoch == 2:
                    moved_rev = kv.mod_revision
                time.sleep(0.05)
            assert fenced_at is not None, f"the partitioned copy of rank {rank} still runs"
            assert dead_at is not None, f"no DEAD verdict for {node}"
            assert moved_rev, f"rank {rank} got no new epoch"
            print(f"{node} partitioned: its rank {rank} gone {fenced_at - start:.2f}s after the "
                  f"cut began (miss window {miss_window(d):.2f}s), DEAD verdict seen after "
                  f"{dead_at - start:.2f}s")
            # The copy stopped by itself within its lease: before the leader held the node
            # dead (+ one poll), however much later the verdict came.
            assert fenced_at <= dead_at + 0.05, (fenced_at - start, dead_at - start)
            wait_until(f"rank {rank} restored on the spare",
                       lambda: [p.state for p in job_plans(s, keys, job)],
                       lambda st: bool(st) and st[0] in ("restored", "done"), 60)
        finally:
            cluster.heal(node)
        try:
            # Healed: the node is heard from again, the old copy stays gone, the job ends
            # with the failure-free result (nothing done twice).
            wait_until(f"{node} ALIVE again", lambda: verdict(ns_store, node),
                       lambda v: v is not None and v["kind"] == "ALIVE", timeout=30)
            assert not rank_pids(job, rank, 1)
            finish(cluster, job, out, clean)
            every = job_plans(s, keys, job)
            # One move, and no plan for a rank whose node was not cut off.
            [plan] = every
            assert (plan.rank, plan.source, plan.epoch, plan.state) == (rank, node, 2, "done")
            assert all(p.state == "done" for p in every), every
            # Nothing the old epoch wrote was committed after the new one existed.
            late = [json.loads(kv.value) for kv in s.get_prefix(keys.ckpt_prefix(job, rank))
                    if kv.create_revision > moved_rev]
            assert late and all(r["epoch"] >= 2 for r in late), late
        finally:
            # drained by its DEAD verdict: the next test needs all four nodes
            back_in_service(cluster, s, keys, node)


def test_partition_shorter_than_the_miss_window_gives_no_verdict_and_no_move(
        ns_cluster: LocalCluster, ns_store: Store, ns_leader: CoordinatorProcess,
        tmp_path: Path) -> None:
    cluster, (s, keys) = ns_cluster, ns_store
    d = detection(cluster)
    # A quarter of the window: the node's ranks stay valid for one miss window after its
    # last acknowledgement, and on this loaded 2-core machine the first acknowledgement
    # after the heal can take a few hundred ms (a half-window blip fenced a rank 1 run in 4)
    blip = miss_window(d) / 4
    clean = heat_reference(tmp_path, 3, HEAT)
    with heat_job(cluster, "--raps-spares=1", "-N4") as (job, out):
        rank, node = victim_of(cluster, ns_store, job, 3)
        pids = wait_until(f"rank {rank} running", lambda: rank_pids(job, rank, 1), bool, 20)
        # A new leader holds back DEAD verdicts for its first window: be past it.
        assert time.monotonic() - ns_leader.started > miss_window(d) + d.fence_margin_sec
        cluster.partition(node, seconds=blip)
        # Long enough for any verdict to be reached: two miss windows + fence margin.
        seen = kinds_seen(ns_store, node, 2 * (miss_window(d) + d.fence_margin_sec) + 1)
        assert "DEAD" not in seen, seen
        assert not cluster.slurm().node(node).reason.startswith("raps: dead")
        assert not job_plans(s, keys, job)
        assert {e.epoch for e in rank_entries(s, keys, job).values()} == {1}
        assert not gone(pids), f"rank {rank} on {node} stopped during a {blip:.2f}s blip"
        finish(cluster, job, out, clean)


def test_a_whole_rack_partitioned_its_ranks_move_and_nothing_runs_twice(
        ns_cluster: LocalCluster, ns_store: Store, ns_leader: CoordinatorProcess,
        tmp_path: Path) -> None:
    """A rack's uplink cut (a failed top-of-rack switch): both of its nodes are DEAD, every
    rank there moves out of the rack, each partitioned copy stopped itself before the
    verdict, and no split brain: the old epochs commit nothing after the new ones exist."""
    cluster, (s, keys) = ns_cluster, ns_store
    clean = heat_reference(tmp_path, 4, HEAT)
    # 4 ranks, 2 per node, on 2 nodes (one per rack) and 2 spares: the cut rack holds
    # one node of ranks and one spare, so its 2 ranks move together to the other spare
    with heat_job(cluster, "--raps-spares=2", "--raps-ranks-per-node=2", "-N4") as (job, out):
        entries = wait_until(f"job {job} mapped", lambda: rank_entries(s, keys, job),
                             lambda e: len(e) == 4, 60)
        host = wait_until("the batch host", lambda: cluster.slurm().job(int(job)).batch_host,
                          bool, 20)
        # the rack without the batch script (losing it escalates: the recovery tests)
        rack = "r2" if host in ("n1", "n2") else "r1"
        cut = ("n3", "n4") if rack == "r2" else ("n1", "n2")
        victims = sorted(r for r, e in entries.items() if e.node in cut)
        assert victims, f"no rank in rack {rack}: {entries}"
        for r in victims:
            wait_until(f"rank {r} committed", lambda r=r: committed_generations(s, keys, job, r),
                       bool, 60)
        old = {r: wait_until(f"rank {r} epoch 1 running", lambda r=r: rank_pids(job, r, 1),
                             bool, 20) for r in victims}
        before = {n: verdict(ns_store, n) for n in cut}
        start = time.monotonic()
        cluster.partition(rack)
        moved: dict[int, int] = {}
        fenced: dict[int, float] = {}
        dead: dict[str, float] = {}
        try:
            deadline = time.monotonic() + 60
            while (len(moved) < len(victims) or len(fenced) < len(victims)
                   or len(dead) < len(cut)) and time.monotonic() < deadline:
                now = time.monotonic()
                for r in victims:
                    if r not in fenced and gone(old[r]):
                        fenced[r] = now
                    kv = s.get(keys.job_rank(job, r))
                    if r not in moved and kv is not None \
                            and RankEntry.from_json(kv.key, kv.value).epoch == 2:
                        moved[r] = kv.mod_revision
                for n in cut:
                    v = verdict(ns_store, n)
                    if n not in dead and v is not None and v != before[n] \
                            and v["kind"] == "DEAD":
                        dead[n] = now
                time.sleep(0.05)
            assert set(dead) == set(cut), f"DEAD verdicts for {sorted(dead)} of {cut}"
            assert set(fenced) == set(victims), f"partitioned copies still run: " \
                f"{sorted(set(victims) - set(fenced))}"
            assert set(moved) == set(victims), f"no new epoch for {set(victims) - set(moved)}"
            print(f"rack {rack} partitioned: copies gone after "
                  f"{ {r: round(t - start, 2) for r, t in fenced.items()} } s, DEAD after "
                  f"{ {n: round(t - start, 2) for n, t in dead.items()} } s")
            for r in victims:  # each copy stopped itself before its node was held dead
                assert fenced[r] <= dead[entries[r].node] + 0.05, (r, fenced, dead)
            now_on = rank_entries(s, keys, job)
            assert not {now_on[r].node for r in victims} & set(cut), now_on
        finally:
            cluster.heal(rack)
        try:
            for n in cut:
                wait_until(f"{n} ALIVE again", lambda n=n: verdict(ns_store, n),
                           lambda v: v is not None and v["kind"] == "ALIVE", timeout=30)
            for r in victims:
                assert not rank_pids(job, r, 1)
            finish(cluster, job, out, clean)
            every = job_plans(s, keys, job)
            moves = sorted((p.rank, p.epoch, p.state) for p in every if p.source != p.target)
            assert moves == [(r, 2, "done") for r in victims], every
            for r in victims:
                late = [json.loads(kv.value) for kv in s.get_prefix(keys.ckpt_prefix(job, r))
                        if kv.create_revision > moved[r]]
                assert all(x["epoch"] >= 2 for x in late), (r, late)
        finally:
            back_in_service(cluster, s, keys, *cut)


def test_an_etcd_member_partitioned_gives_no_verdict_and_no_move(
        ns_cluster: LocalCluster, ns_store: Store, ns_leader: CoordinatorProcess,
        tmp_path: Path) -> None:
    """One of three etcd members cut off for several miss windows: the store keeps its
    quorum, so no node is held dead, none is drained, no rank moves, and the job ends
    with the failure-free result."""
    cluster, (s, keys) = ns_cluster, ns_store
    d = detection(cluster)
    clean = heat_reference(tmp_path, 3, HEAT)
    with heat_job(cluster, "--raps-spares=1", "-N4") as (job, out):
        victim_of(cluster, ns_store, job, 3)  # mapped, running, a checkpoint committed
        before = {n: verdict(ns_store, n) for n in ("n1", "n2", "n3", "n4")}
        cut = 5 * miss_window(d) + d.fence_margin_sec
        seen: dict[str, list[str]] = {n: [] for n in before}

        def watch(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                for n in before:
                    try:
                        v = verdict(ns_store, n)
                    except StoreUnavailable:  # the cut member led etcd: an election runs
                        continue
                    if v is not None and v != before[n] and v["kind"] not in seen[n]:
                        seen[n].append(v["kind"])
                time.sleep(0.05)

        cluster.partition("e1")
        try:
            watch(cut)
        finally:
            cluster.heal("e1")
        watch(miss_window(d) + d.fence_margin_sec + 1)  # a late verdict
        assert not any("DEAD" in k for k in seen.values()), seen
        for n in before:
            assert not cluster.slurm().node(n).reason.startswith("raps: dead"), n
        # the healed member rejoining may start one more election: read once etcd answers
        plans = wait_until("etcd to answer after the heal",
                           lambda: answered(lambda: job_plans(s, keys, job)),
                           lambda v: v is not None, 30)
        assert not [p for p in plans if p.source != p.target], plans
        finish(cluster, job, out, clean)


def answered(read: Any) -> Any:
    """What ``read()`` returns, None while etcd elects a leader (no endpoint answers)."""
    try:
        return read()
    except StoreUnavailable:
        return None


def leader_name(store: Store) -> str | None:
    s, keys = store
    try:
        value = read_leader(s, keys.leader())
    except StoreUnavailable:
        return None
    return str(value.get("name")) if isinstance(value, dict) else None


def logged_at(log: str, text: str) -> datetime:
    """When a coordinator's log (``%(asctime)s ...``) first says ``text``."""
    line = next(x for x in log.splitlines() if text in x)
    return datetime.strptime(line[:23], LOG_TIME)


def test_the_leaders_head_cut_off_mid_plan_a_standby_leads_and_the_plan_runs_once(
        ns_cluster: LocalCluster, ns_store: Store, ns_leader: CoordinatorProcess,
        tmp_path: Path) -> None:
    """The head running the leader cut off the network (etcd, slurmctld and the agents
    with it) while its plan for a crashed node is in flight: it stops leading on its own
    clock no later than etcd lets a standby in, the standby (on another head) finishes
    the plan once, and the old leader, healed, writes nothing: it stays a standby, the
    plan, epochs and rank starts are those of one move, and the job ends with the
    failure-free result."""
    cluster, (s, keys) = ns_cluster, ns_store
    lease = load_file(cluster.config_path).coordinator.leader_lease_sec
    clean = heat_reference(tmp_path, 3, HEAT)
    standby = cluster.coordinator("part-b").start(head=2)
    try:
        with heat_job(cluster, "--raps-spares=1", "-N4") as (job, out):
            rank, node = victim_of(cluster, ns_store, job, 3)
            ranks = rank_entries(s, keys, job)
            with crashed(cluster, ns_store, node):
                wait_until("a plan", lambda: job_plans(s, keys, job), bool, 30,
                           interval=0.02)
                before = len(ns_leader.log())
                cluster.partition("h1")
                try:
                    [inflight] = job_plans(s, keys, job)
                    assert inflight.state in ("queued", "running"), inflight
                    wait_until("the standby to lead", lambda: leader_name(ns_store),
                               lambda n: n == "part-b", lease + 10, interval=0.05)
                    # read while the job runs: its keys are purged seconds after its end
                    [plan] = wait_until("the plan done", lambda: job_plans(s, keys, job),
                                        lambda p: len(p) == 1 and p[0].state == "done", 60)
                    epochs = {r: e.epoch for r, e in rank_entries(s, keys, job).items()}
                    # its log line waits for a loop held by store calls that time out
                    # against every member (seconds each on a loaded machine); when its
                    # leadership ran out is the time in the line, checked below
                    cut_off = wait_until("the cut-off leader to step down",
                                         lambda: ns_leader.log()[before:],
                                         lambda t: "lost leadership" in t, lease + 30)
                finally:
                    cluster.heal("h1")
                # healed, the old leader finds another's key and leads nothing
                assert leader_name(ns_store) == "part-b"
                text = finish(cluster, job, out, clean)
            # its leadership ended by its own clock (ensure() refuses from then on) before
            # etcd let the standby in; the log line itself waits for the loop, which a
            # store call cut off from etcd holds for seconds
            said = next(x for x in cut_off.splitlines() if "lost leadership" in x)
            assert "ran out at " in said, said
            ran_out = datetime.strptime(said.split("ran out at ")[1][:23], LOG_TIME)
            took_over = logged_at(standby.log(), "became leader")
            print(f"leader cut off: its lease ran out at {ran_out.time()} by its clock, the "
                  f"standby led at {took_over.time()} (lease {lease:g}s); said at "
                  f"{logged_at(cut_off, 'lost leadership').time()}")
            assert ran_out <= took_over, (ran_out, took_over)
            assert (plan.plan_id, plan.rank, plan.epoch) == (inflight.plan_id, rank, 2)
            assert f"plan {plan.plan_id}" in standby.log()
            assert epochs == {r: 2 if r == rank else 1 for r in ranks}
            started = sorted(x for x in text.splitlines()
                             if x.startswith("raps-run: rank ") and " started on " in x)
            assert started == sorted(
                [f"raps-run: rank {r} epoch 1 started on {e.node}" for r, e in ranks.items()]
                + [f"raps-run: rank {rank} epoch 2 started on {plan.target}"]), text[-4000:]
            assert leader_name(ns_store) == "part-b"
            assert "became leader" not in ns_leader.log()[before:]
    finally:
        assert standby.stop() == 0, standby.log()[-2000:]
        # the standby resigned: the module's leader leads again for whatever comes next
        wait_until("coordinator 'part' to lead again", lambda: leader_name(ns_store),
                   lambda n: n == "part", 30)


@pytest.mark.timeout(400)
def test_a_seeded_campaign_of_partitions_loses_nothing(
        ns_cluster: LocalCluster, ns_leader: CoordinatorProcess) -> None:
    """``rapsctl bench faults --net ns``'s runs at a small size, partitions only: nodes,
    a node and its log backup, or a rack cut off for a drawn 1-10 s while everything on
    them runs on (3 ranks, one spare: two nodes lost at once may leave none, and then a
    requeue is the expected outcome)."""
    result = campaign(ns_cluster, 2, 7, say=print, ranks=3,
                      sbatch=("--raps-spares=1", "-N4", "--open-mode=append"),
                      kinds=("partition",))
    totals, report = result["totals"], json.dumps(result["runs"], indent=1)
    assert totals["partitions"] >= 2, report
    assert totals["errors"] == 0, report
    assert totals["wrong_results"] == 0, report
    assert totals["lost_data"] == 0, report
    assert totals["requeued_with_spare_left"] == 0, report
    assert totals["recovered"] + totals["requeued"] == 2, report
