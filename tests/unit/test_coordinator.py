"""The coordinator: leader election and the cycle that maps and purges jobs.

Everything runs on a MemoryStore whose lease expiry follows a fake clock, with a fixed
topology (3 racks of 2 nodes, n1..n6) and Slurm job states the test controls, so
failover and grace periods are exercised without sleeping.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from raps_slurm.config import Config, parse_config
from raps_slurm.coordinator.cycle import Coordinator
from raps_slurm.coordinator.election import Leadership, read_leader
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry, RankMap, group_from_json
from raps_slurm.errors import NotLeader, StoreUnavailable
from raps_slurm.model import BackupGroup, Switch, Topology
from raps_slurm.registry import UnknownJob, job_view
from raps_slurm.store import Guard, Keys, Lease, MemoryStore, Put
from raps_slurm.testing import FakeClock

LEASE_SEC = 10.0  # coordinator.leader_lease_sec's default, a whole number of seconds
GRACE = 5.0
SIX_NODES = ("n1", "n2", "n3", "n4", "n5", "n6")



def make_topology() -> Topology:
    racks = {"r1": ["n1", "n2"], "r2": ["n3", "n4"], "r3": ["n5", "n6"]}
    switches = {r: Switch(r, 0, frozenset(nodes)) for r, nodes in racks.items()}
    switches["root"] = Switch("root", 1, frozenset(SIX_NODES), tuple(racks))
    return Topology(switches)


TOPOLOGY = make_topology()


def make_config(grace: float = GRACE, poll: float = 0.5) -> Config:
    return parse_config({"coordinator": {"purge_grace_sec": grace, "slurm_poll_sec": poll,
                                         "leader_lease_sec": LEASE_SEC,
                                         "metrics_address": ""}})


@dataclass
class Cluster:
    """A store, its clock and what Slurm says about jobs; builds coordinators on them."""

    clock: FakeClock
    store: MemoryStore
    keys: Keys
    cfg: Config
    states: dict[str, str] = field(default_factory=dict)  # job id -> Slurm state

    def leadership(self, name: str) -> Leadership:
        return Leadership(self.store, self.keys.leader(), LEASE_SEC, {"name": name},
                          clock=self.clock)

    def coordinator(self, name: str, cfg: Config | None = None) -> Coordinator:
        return Coordinator(cfg or self.cfg, self.store, self.keys, self.leadership(name),
                           topology=lambda: TOPOLOGY, job_states=lambda: dict(self.states),
                           name=name, clock=self.clock, monotonic=self.clock)

    def register(self, job_id: str, nodes: Sequence[str] = SIX_NODES, spares: int = 2,
                 restart_count: int = 0, replicas: int | None = None) -> JobRecord:
        """What PrologSlurmctld writes for a run."""
        rec = JobRecord(job_id, restart_count, 1000, tuple(nodes),
                        JobSpec(spares=spares, replicas=replicas), registered_at=self.clock())
        self.store.put(self.keys.job(job_id), rec.to_json())
        return rec

    def end(self, rec: JobRecord) -> JobRecord:
        """What EpilogSlurmctld writes when the run ends."""
        ended = rec.ended(self.clock(), 0)
        self.store.put(self.keys.job(rec.job_id), ended.to_json())
        return ended

    def exists(self, key: str) -> bool:
        return self.store.get(key) is not None

    def job_keys(self, job_id: str) -> list[str]:
        """The record and everything below it."""
        key = self.keys.job(job_id)
        return [kv.key for kv in self.store.get_prefix(key)
                if kv.key == key or kv.key.startswith(key + "/")]

    def entries(self, job_id: str) -> list[RankEntry]:
        return [RankEntry.from_json(kv.key, kv.value)
                for kv in self.store.get_prefix(self.keys.job_ranks_prefix(job_id))]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    yield Cluster(clock, store, Keys("/raps/v1/"), make_config())
    store.close()


# ---------------------------------------------------------------- Leadership


def test_first_leads_second_stands_by(cluster: Cluster) -> None:
    first, second = cluster.leadership("c1"), cluster.leadership("c2")
    assert first.step()
    assert not second.step()
    assert first.is_leader() and first.revision > 0
    assert not second.is_leader() and second.revision == 0
    assert second.leader_name == "c1"
    leader = read_leader(cluster.store, cluster.keys.leader())
    assert leader is not None and leader["name"] == "c1"
    assert leader["revision"] == first.revision


def test_leader_stays_while_it_steps(cluster: Cluster) -> None:
    first, second = cluster.leadership("c1"), cluster.leadership("c2")
    first.step()
    for _ in range(10):  # 40 s, four lease TTLs: the refreshes keep it
        cluster.clock.advance(4.0)
        assert first.step()
        assert not second.step()


def test_standby_takes_over_after_ttl(cluster: Cluster) -> None:
    first, second = cluster.leadership("c1"), cluster.leadership("c2")
    first.step()
    second.step()
    old_revision = first.revision
    cluster.clock.advance(LEASE_SEC - 0.5)
    assert not second.step()  # not before the TTL
    cluster.clock.advance(0.5)  # first did not step: paused, its lease runs out
    assert second.step()
    assert second.leader_name == "c2" and second.revision > old_revision

    # commit() itself does not look at the clock: etcd's revision guard refuses the write.
    key = cluster.keys.job_map("99")
    with pytest.raises(NotLeader, match="another coordinator leads"):
        first.commit([], [Put(key, b"{}")])
    assert not cluster.exists(key)
    assert not first.is_leader() and first.revision == 0
    assert "leader key changed" in first.lost_reason

    assert not first.step()
    assert first.leader_name == "c2"
    assert second.commit([], [Put(key, b"{}")])  # the new leader's writes go through


def test_commit_false_when_only_guards_fail(cluster: Cluster) -> None:
    first = cluster.leadership("c1")
    first.step()
    key = cluster.keys.job("5")
    assert not first.commit([Guard(key, 12345)], [Put(key, b"x")])
    assert not cluster.exists(key)
    assert first.is_leader()  # a failed guard of its own says nothing about leadership
    assert first.commit([Guard(key, 0)], [Put(key, b"x")])
    assert cluster.exists(key)


def test_resign_hands_over_at_once(cluster: Cluster) -> None:
    first, second = cluster.leadership("c1"), cluster.leadership("c2")
    first.step()
    assert not second.step()
    first.resign()
    assert second.step()  # no clock advance: no wait for the TTL
    assert not first.is_leader()
    with pytest.raises(NotLeader):
        first.commit([], [Put(cluster.keys.job("1"), b"x")])
    first.resign()  # idempotent


def test_commit_without_leadership(cluster: Cluster) -> None:
    with pytest.raises(NotLeader):
        cluster.leadership("c1").commit([], [Put(cluster.keys.job("1"), b"x")])


# ---------------------------------------------------------------- the cycle: mapping


def test_standby_status(cluster: Cluster) -> None:
    c1, c2 = cluster.coordinator("c1"), cluster.coordinator("c2")
    assert c1.run_cycle() == "leader: 0 jobs"
    status = c2.run_cycle()
    assert status.startswith("standby: leader is")
    assert status == "standby: leader is c1"


def test_maps_registered_job(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1")
    c1.run_cycle()
    cluster.register("12")
    assert c1.run_cycle() == "leader: 1 jobs; mapped job 12 (4 ranks, 2 spares)"
    keys = cluster.keys
    assert cluster.exists(keys.job_map("12"))
    for rank in range(4):
        assert cluster.exists(keys.job_rank("12", rank))
        assert cluster.exists(keys.job_group("12", rank))
    assert not cluster.exists(keys.job_rank("12", 4))
    kv = cluster.store.get(keys.job_map("12"))
    assert kv is not None
    m = RankMap.from_json(kv.key, kv.value)
    assert m.built_by == "c1" and m.restart_count == 0 and m.built_at == cluster.clock()
    # A mapped run is not mapped again.
    assert c1.run_cycle() == "leader: 1 jobs"


def test_job_view_shape(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1")
    cluster.register("12")
    c1.run_cycle()
    view = job_view(cluster.store, cluster.keys, "12")
    json.dumps(view)  # printed by ``rapsctl show job --json``
    assert view["job_id"] == "12"
    assert view["restart_count"] == 0 and view["owner_uid"] == 1000
    assert view["state"] == "mapped"
    assert view["spares"] == ["n2", "n4"]
    ranks = view["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["node"] for r in ranks] == ["n1", "n3", "n5", "n6"]
    for r in ranks:
        assert set(r) >= {"rank", "node", "epoch", "status", "group", "spares"}
        assert r["epoch"] == 1 and r["status"] == "assigned"
        assert sorted(r["spares"]) == ["n2", "n4"]
        group = r["group"]
        assert set(group) == {"primary", "log_backup", "ckpt_mirrors", "degraded"}
        assert group["primary"] == r["node"]
        assert isinstance(group["log_backup"], str)
        assert len(group["ckpt_mirrors"]) == 1  # replica_count 2 by default
        # Spares fill the third rack, so every group is rack-disjoint.
        assert group["degraded"] is None


def test_map_error_state(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1")
    cluster.register("13", nodes=("n1", "n2"), spares=2)
    assert c1.run_cycle() == "leader: 1 jobs; job 13: map error"
    view = job_view(cluster.store, cluster.keys, "13")
    assert view["state"] == "map-error"
    assert "2 spares asked" in view["map_error"]
    assert view["ranks"] == [] and view["spares"] == []
    # The error is the answer for this run: no retry every cycle.
    assert c1.run_cycle() == "leader: 1 jobs"


def test_requeue_is_mapped_again_with_next_epoch(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1")
    first = cluster.register("12")
    c1.run_cycle()
    cluster.end(first)
    assert c1.run_cycle() == "leader: 1 jobs"  # an ended run is not mapped
    # The requeued run got fewer nodes: the same 4 ranks, on 4 nodes, with no spare left.
    cluster.register("12", nodes=("n1", "n2", "n3", "n4"), restart_count=1)
    assert c1.run_cycle() == "leader: 1 jobs; mapped job 12 (4 ranks, 0 spares)"
    entries = cluster.entries("12")
    assert [(e.rank, e.epoch) for e in entries] == [(0, 2), (1, 2), (2, 2), (3, 2)]
    view = job_view(cluster.store, cluster.keys, "12")
    assert view["restart_count"] == 1 and view["state"] == "mapped"
    assert [r["epoch"] for r in view["ranks"]] == [2, 2, 2, 2]
    # Three nodes cannot hold 4 ranks at one per node: a map error, not fewer ranks.
    cluster.end(cluster.register("12", nodes=("n1", "n2", "n3", "n4"), restart_count=1))
    cluster.register("12", nodes=("n1", "n2", "n3"), restart_count=2)
    assert c1.run_cycle() == "leader: 1 jobs; job 12: map error"
    assert "4 ranks at 1 per node need 4 nodes, but only 3" in \
        job_view(cluster.store, cluster.keys, "12")["map_error"]


def test_malformed_record_skipped(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    c1 = cluster.coordinator("c1")
    cluster.store.put(cluster.keys.job("8"), b"not json")
    cluster.register("9")
    caplog.set_level(logging.ERROR, logger="raps.coordinator")
    assert c1.run_cycle() == "leader: 1 jobs; mapped job 9 (4 ranks, 2 spares)"
    assert c1.run_cycle() == "leader: 1 jobs"
    bad = [r for r in caplog.records if "skipping malformed value" in r.getMessage()]
    assert len(bad) == 1  # logged once, not every cycle
    assert "/raps/v1/jobs/8: not JSON" in bad[0].getMessage()
    assert cluster.job_keys("8") == [cluster.keys.job("8")]  # left alone for a human


def test_new_leader_maps_after_failover(cluster: Cluster) -> None:
    c1, c2 = cluster.coordinator("c1"), cluster.coordinator("c2")
    cluster.register("12")
    c1.run_cycle()
    assert c2.run_cycle() == "standby: leader is c1"
    cluster.clock.advance(LEASE_SEC)  # c1 paused for a whole TTL
    cluster.register("13", nodes=("n1", "n3", "n5"), spares=0)
    # c2 maps the new job only: job 12's map is current.
    assert c2.run_cycle() == "leader: 2 jobs; mapped job 13 (3 ranks, 0 spares)"
    status = c1.run_cycle()
    assert status.startswith("standby: leader is c2 (lease not refreshed"), status


def test_deposed_leader_writes_nothing(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1")
    l2 = cluster.leadership("c2")
    c1.run_cycle()
    # The leader key is replaced under c1 while c1's lease (and local clock) still say it
    # leads, e.g. by an operator: only the revision guard can stop its writes.
    cluster.store.delete(cluster.keys.leader())
    assert l2.step()
    cluster.register("12")
    assert c1.run_cycle() == "stepped down: write refused: another coordinator leads"
    assert cluster.job_keys("12") == [cluster.keys.job("12")]


# ---------------------------------------------------------------- the cycle: purge


def test_purge_after_grace(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1")
    rec = cluster.register("12")
    cluster.states["12"] = "RUNNING"
    c1.run_cycle()
    cluster.end(rec)
    cluster.states["12"] = "COMPLETED"
    cluster.clock.advance(1.0)  # past slurm_poll_sec: the new state is read
    assert c1.run_cycle() == "leader: 1 jobs"
    cluster.clock.advance(GRACE - 1.0 - 0.5)
    assert c1.run_cycle() == "leader: 1 jobs"
    assert len(cluster.job_keys("12")) == 10  # record, map, 4 ranks, 4 groups
    cluster.clock.advance(0.5)  # grace over since the epilog's ended_at, not yet since
    assert c1.run_cycle() == "leader: 1 jobs"  # the leader first saw COMPLETED (1 s later)
    cluster.clock.advance(1.0)
    from raps_slurm.core.planner import Plan  # a recovery the job had: summed up, then gone

    done = Plan("12-1-2", "12", 1, "n1", "n5", 2, "dead", 0, "done", created_at=10.0,
                finished_at=14.5, detected_at=10.0)
    cluster.store.put(cluster.keys.plan(done.plan_id), done.to_json())
    assert c1.run_cycle() == "leader: 1 jobs; purged job 12"
    assert cluster.job_keys("12") == []
    assert cluster.store.get(cluster.keys.plan(done.plan_id)) is None
    kv = cluster.store.get(cluster.keys.purged("12"))
    assert kv is not None
    summary = json.loads(kv.value)["recoveries"]
    assert summary["plans"] == 1 and summary["states"] == {"done": 1}
    assert summary["verdict_to_done_s"] == {"n": 1, "mean": 4.5, "max": 4.5}
    with pytest.raises(UnknownJob):
        job_view(cluster.store, cluster.keys, "12")
    assert c1.run_cycle() == "leader: 0 jobs"


def test_no_purge_while_pending(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1")
    rec = cluster.register("12")
    cluster.states["12"] = "RUNNING"
    c1.run_cycle()
    cluster.end(rec)
    cluster.states["12"] = "PENDING"  # requeued: its checkpoints must stay
    for _ in range(5):  # 20 s, four grace periods
        cluster.clock.advance(4.0)
        assert c1.run_cycle() == "leader: 1 jobs"
    assert len(cluster.job_keys("12")) == 10
    # Cancelled while pending: its run ended long ago, but the grace period counts
    # from when the leader first saw it finished for good.
    cluster.states["12"] = "CANCELLED"
    cluster.clock.advance(1.0)
    assert c1.run_cycle() == "leader: 1 jobs"
    cluster.clock.advance(GRACE)
    assert c1.run_cycle() == "leader: 1 jobs; purged job 12"


def test_purge_job_gone_from_slurm(cluster: Cluster) -> None:
    # The epilog never marked the run ended and Slurm forgot the job (MinJobAge):
    # the grace counts from the coordinator's first sighting.
    c1 = cluster.coordinator("c1")
    cluster.register("12")
    cluster.states["12"] = "RUNNING"
    c1.run_cycle()
    del cluster.states["12"]
    cluster.clock.advance(1.0)
    assert c1.run_cycle() == "leader: 1 jobs"
    cluster.clock.advance(GRACE - 0.5)
    assert c1.run_cycle() == "leader: 1 jobs"
    cluster.clock.advance(0.5)
    assert c1.run_cycle() == "leader: 1 jobs; purged job 12"
    assert cluster.job_keys("12") == []


def test_running_again_resets_first_sighting(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1")
    cluster.register("12")
    c1.run_cycle()  # not in the states: first sighting as gone
    cluster.states["12"] = "RUNNING"
    cluster.clock.advance(1.0)
    c1.run_cycle()
    del cluster.states["12"]
    cluster.clock.advance(GRACE - 0.5)
    # Seen gone again only now; the first sighting, GRACE + 0.5 s ago, must not count.
    assert c1.run_cycle() == "leader: 1 jobs"


# ---------------------------------------------------------------- regressions


def test_new_job_not_purged_on_stale_states(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1", make_config(grace=0.0, poll=10.0))
    c1.run_cycle()  # polls Slurm: no jobs yet
    cluster.register("7")
    cluster.states["7"] = "RUNNING"  # Slurm knows it; the next poll is 10 s away
    cluster.clock.advance(1.0)
    assert c1.run_cycle() == "leader: 1 jobs; mapped job 7 (4 ranks, 2 spares)"
    assert cluster.exists(cluster.keys.job("7"))


def test_non_numeric_job_key_skipped(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1")
    cluster.register("x")
    cluster.register("9")
    assert c1.run_cycle().endswith("mapped job 9 (4 ranks, 2 spares)")


def test_record_for_another_job_id_skipped(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1")
    rec = JobRecord("6", 0, 1000, SIX_NODES, JobSpec())
    cluster.store.put(cluster.keys.job("5"), rec.to_json())
    c1.run_cycle()
    c1.run_cycle()
    assert cluster.store.get_prefix(cluster.keys.job_prefix("6")) == []


def test_a_hanging_squeue_does_not_stop_the_cycle(cluster: Cluster) -> None:
    """Job states are read in the background: the loop that keeps the lease goes on."""
    import threading
    release = threading.Event()

    def slow_states() -> dict[str, str]:
        release.wait(10)
        return {"12": "COMPLETED"}

    c1 = Coordinator(cluster.cfg, cluster.store, cluster.keys, cluster.leadership("c1"),
                     topology=lambda: TOPOLOGY, job_states=slow_states, name="c1",
                     clock=cluster.clock, monotonic=cluster.clock, background=True)
    rec = cluster.register("12")
    started = time.monotonic()
    status = c1.run_cycle()  # the topology is read in the background too
    while "mapped" not in status and time.monotonic() - started < 2:
        status = c1.run_cycle()
    assert status == "leader: 1 jobs; mapped job 12 (4 ranks, 2 spares)", status
    assert time.monotonic() - started < 2  # squeue hangs; the cycles do not
    cluster.end(rec)
    cluster.clock.advance(GRACE + 1)
    assert c1.run_cycle() == "leader: 1 jobs"  # no word from Slurm yet: nothing purged
    release.set()
    deadline = time.monotonic() + 5
    status = ""
    while time.monotonic() < deadline and "purged" not in status:
        cluster.clock.advance(0.1)
        status = c1.run_cycle()
    assert status.endswith("purged job 12"), status


# ---------------------------------------------------------------- groups after a death


def groups(cluster: Cluster, job_id: str) -> dict[int, BackupGroup]:
    return {int(kv.key.rsplit("/", 1)[1]): group_from_json(kv.key, kv.value, 0)
            for kv in cluster.store.get_prefix(cluster.keys.job_groups_prefix(job_id))}


def test_dead_backup_is_replaced_by_a_live_pool_node(cluster: Cluster) -> None:
    dead: set[str] = set()
    c1 = Coordinator(cluster.cfg, cluster.store, cluster.keys, cluster.leadership("c1"),
                     topology=lambda: TOPOLOGY, job_states=lambda: dict(cluster.states),
                     name="c1", clock=cluster.clock, monotonic=cluster.clock,
                     dead_nodes=lambda: set(dead))
    c1.run_cycle()
    cluster.register("31", replicas=2)
    c1.run_cycle()
    before = groups(cluster, "31")
    victim = before[0].ckpt_mirrors[0]
    users = [r for r, g in before.items() if victim in (g.log_backup, *g.ckpt_mirrors)]
    dead.add(victim)
    line = c1.run_cycle()
    assert f"job 31: {len(users)} group(s) off dead nodes" in line
    after = groups(cluster, "31")
    for rank, g in after.items():
        assert victim not in (g.log_backup, *g.ckpt_mirrors)
        assert g.primary == before[rank].primary
        members = [m for m in (g.primary, g.log_backup, *g.ckpt_mirrors) if m]
        assert len(set(members)) == len(members) == 3
        if rank not in users:
            assert g == before[rank]
    # Nothing more to do while the node stays dead.
    assert "off dead nodes" not in c1.run_cycle()


def test_dead_nodes_ignore_a_registration_older_than_the_verdict() -> None:
    from raps_slurm.coordinator.deadnodes import DeadNodes

    store, keys = MemoryStore(), Keys()
    dead = DeadNodes(store, keys, every=0.0)
    store.put(keys.node("n1"), b"{}")
    store.put(keys.node("n2"), b"{}")
    assert dead() == set()
    # n1 crashed: its registration lingers until its lease runs out, the verdict is newer
    store.put(keys.node_verdict("n1"), json.dumps({"kind": "DEAD", "at": 5.0}).encode())
    store.put(keys.node_verdict("n2"), json.dumps({"kind": "SUSPECT", "at": 5.0}).encode())
    assert dead() == {"n1"} and dead.dead_at == {"n1": 5.0} and dead.unhealthy == {"n2"}
    # n1 came back: a registration created after the verdict
    store.delete(keys.node("n1"))
    store.put(keys.node("n1"), b"{}")
    assert dead() == set()
    store.put(keys.node_verdict("n1"), b"not json")  # malformed: ignored, not fatal
    assert dead() == set()


def test_dead_nodes_follow_health_verdicts_deletes_and_a_lost_watch() -> None:
    from raps_slurm.coordinator.deadnodes import DeadNodes

    store, keys = MemoryStore(), Keys()
    dead = DeadNodes(store, keys, every=0.0)
    for n in ("n1", "n2", "n3"):
        store.put(keys.node(n), b"{}")
    assert dead() == set() and dead.registered == {"n1", "n2", "n3"}
    drain = {"level": "DRAIN", "reason": "raps: nvme0 temp 72C > 70C", "at": 7.0}
    store.put(keys.node_health_verdict("n2"), json.dumps(drain).encode())
    store.put(keys.node_health_verdict("n3"), json.dumps({"level": "DEGRADED"}).encode())
    dead()
    assert dead.draining == {"n2": ("nvme0 temp 72C > 70C", 7.0)}
    assert dead.unhealthy == {"n2", "n3"}
    # What a rank map keeps ranks off: a node drained for health since the run registered
    # (not one drained before: an admin resumed it), one whose agent is not registered.
    assert dead.fitness(["n1", "n2", "n3", "n4"], 7.0) == (
        {"n2": "draining (nvme0 temp 72C > 70C)", "n4": "no live agent"}, {})
    assert dead.fitness(["n2"], 8.0) == ({}, {})
    # Back to OK, and a registration gone with its lease: both followed.
    store.put(keys.node_health_verdict("n3"), json.dumps({"level": "OK"}).encode())
    store.delete(keys.node("n1"))
    dead()
    assert dead.unhealthy == {"n2"} and dead.registered == {"n2", "n3"}
    # A verdict written while the watch is lost is found by the read that follows.
    dead.close()
    store.put(keys.node_verdict("n3"), json.dumps({"kind": "DEAD", "at": 9.0}).encode())
    assert dead() == {"n3"} and dead.dead_at == {"n3": 9.0}
    assert dead.registered == {"n2"} and dead.draining == {"n2": ("nvme0 temp 72C > 70C", 7.0)}
    # This leader's own verdict: refresh() makes the next call wait for it.
    store.put(keys.node_verdict("n2"), json.dumps({"kind": "DEAD", "at": 10.0}).encode())
    dead.refresh()
    assert dead() == {"n2", "n3"} and dead.draining == {}


class _FlakyStore(MemoryStore):
    """A memory store whose lease refreshes fail while ``down`` (etcd without quorum)."""

    down = False

    def refresh_lease(self, lease: Lease) -> None:
        if self.down:
            raise StoreUnavailable("no etcd endpoint answered")
        super().refresh_lease(lease)


def test_a_failed_lease_refresh_counts_an_outage_and_keeps_leading() -> None:
    clock = FakeClock()
    store = _FlakyStore(clock=clock)
    lead = Leadership(store, Keys().leader(), LEASE_SEC, {"name": "c1"}, clock=clock)
    assert lead.step() and lead.outages == 0
    store.down = True
    clock.advance(LEASE_SEC / 2)
    assert lead.step() and lead.outages == 1  # leads on by its own clock until the TTL
    store.down = False
    clock.advance(LEASE_SEC / 3)
    assert lead.step() and lead.outages == 1
    store.close()
