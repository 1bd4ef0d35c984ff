"""etcd budgets: the arithmetic of ``rapsctl config check``, the agent's node budget and
the leader's report pauses (pure decisions), ``register`` refusing nodes outside the job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from raps_slurm.agent.local_api import LocalApiServer, Peer, RankTable
from raps_slurm.agent.quota import JobQuotas, PauseBook, job_size
from raps_slurm.config import Config, load_config, parse_config
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.hygiene import Hygiene
from raps_slurm.core.budget import WRITE_OVERHEAD, etcd_budget
from raps_slurm.core.hygiene import ReportPause, next_pause_level, report_pauses
from raps_slurm.core.jobs import JobRecord, JobSpec, RankMap
from raps_slurm.errors import Refused
from raps_slurm.store import Keys, MemoryStore
from raps_slurm.testing import FakeClock

ROOT = Path(__file__).resolve().parents[2]
KiB, MiB = 1 << 10, 1 << 20


# --- the arithmetic ------------------------------------------------------------------------

def test_the_shipped_defaults_fit_and_the_sum_is_the_stated_one() -> None:
    cfg = Config()
    b = etcd_budget(cfg)
    a, s = cfg.agent, cfg.store
    window = s.compaction_retention_sec + s.compaction_interval_sec
    per_node = a.node_etcd_kb_per_sec * KiB * window + a.node_etcd_burst_kb * KiB
    assert b.worst_bytes == pytest.approx(s.cluster_nodes * per_node)
    assert b.allowed_bytes == pytest.approx(s.etcd_budget_share * s.space_quota_bytes)
    assert b.fits and b.worst_bytes <= b.allowed_bytes
    lines = b.lines()
    assert lines[-1].startswith("fits: worst case")
    # one line per term, each naming the keys it comes from
    for key in ("agent.max_value_kb", "agent.node_etcd_kb_per_sec", "agent.node_etcd_burst_kb",
                "store.compaction_retention_sec", "store.cluster_nodes",
                "store.etcd_budget_share", "store.space_quota_bytes"):
        assert any(key in line for line in lines), key


def test_the_production_example_is_sized_for_its_cluster_and_fits() -> None:
    cfg = load_config(str(Path(__file__).parents[2] / "configs" / "production.yaml"))
    b = etcd_budget(cfg)
    assert cfg.store.cluster_nodes == 1000 and b.fits, b.lines()


def test_a_config_that_could_fill_etcd_is_refused_naming_the_keys() -> None:
    # the budgets before they were derived from the quota: an hour of history, and a node
    # as fast as one job's 50 writes/s of 64 KiB
    per_job_kb = 50 * (64 * KiB + WRITE_OVERHEAD) / KiB
    cfg = parse_config({"store": {"compaction_retention_sec": 3600},
                        "agent": {"node_etcd_kb_per_sec": per_job_kb}})
    b = etcd_budget(cfg)
    assert not b.fits and b.worst_bytes > cfg.store.space_quota_bytes
    [problem] = b.problems
    for key in ("agent.node_etcd_kb_per_sec", "store.compaction_retention_sec",
                "store.space_quota_bytes"):
        assert key in problem
    # the same node budget on a cluster that small, with that much quota, fits
    assert not etcd_budget(parse_config({"store": {"cluster_nodes": 1,
                                                   "compaction_retention_sec": 10,
                                                   "compaction_interval_sec": 1},
                                         "agent": {"node_etcd_kb_per_sec": 1.0}})).problems


@pytest.mark.parametrize("change, named", [
    ({"store": {"space_quota_bytes": 0}}, "store.space_quota_bytes is 0"),
    ({"store": {"compaction_retention_sec": 0}}, "store.compaction_retention_sec is 0"),
    ({"agent": {"node_etcd_burst_kb": 8}}, "agent.max_value_kb=64 does not fit"),
    ({"store": {"report_resume_share": 0.8}}, "store.report_resume_share=0.8 must be below"),
])
def test_what_cannot_be_bounded_is_refused(change: dict[str, dict[str, object]],
                                           named: str) -> None:
    b = etcd_budget(parse_config(change))
    assert not b.fits and any(named in p for p in b.problems), b.problems


def test_rapsctl_config_check_prints_the_sum_and_refuses_what_could_fill_etcd(
        tmp_path: Path) -> None:
    def check(text: str) -> subprocess.CompletedProcess[str]:
        f = tmp_path / "raps.yaml"
        f.write_text(text)
        return subprocess.run([sys.executable, "-m", "raps_slurm.cli", "config", "check",
                               str(f)], capture_output=True, text=True, cwd=ROOT, timeout=60,
                              check=False)
    ok = check("store: {cluster_nodes: 8}\n")
    assert ok.returncode == 0, ok.stderr
    assert "#   cluster in history" in ok.stdout and "#   fits: worst case" in ok.stdout
    bad = check("store: {cluster_nodes: 100000}\n")
    assert bad.returncode == 2
    assert "etcd budget:" in bad.stderr and "agent.node_etcd_kb_per_sec" in bad.stderr
    assert "Traceback" not in bad.stderr


# --- the agent's node budget and pauses -------------------------------------------------------

def test_the_node_budget_is_shared_by_every_job_on_the_node_and_refills() -> None:
    clock = FakeClock()
    q = JobQuotas(writes_per_sec=1000, burst=1000, max_value_bytes=64 * KiB,
                  node_bytes_per_sec=4 * KiB, node_burst_bytes=256 * KiB, clock=clock)
    value = b"x" * (64 * KiB)
    fits = (256 * KiB) // (len(value) + WRITE_OVERHEAD)
    for i in range(fits):
        q.write("msg_stats", str(i % 2), 1000, value)      # two jobs, one node budget
    with pytest.raises(Refused) as exc:
        q.write("msg_stats", "7", 1001, value)                # a third job: the node is spent
    assert exc.value.kind == "quota" and "agent.node_etcd_kb_per_sec=4" in str(exc.value)
    q.write("msg_stats", "7", 0, value)                       # root is not budgeted
    clock.advance((len(value) + WRITE_OVERHEAD) / (4 * KiB))
    q.write("msg_stats", "7", 1001, value)                    # refilled at the node's rate
    with pytest.raises(Refused):
        q.write("msg_stats", "7", 1001, value)


def test_one_job_flooding_a_node_leaves_another_job_its_share() -> None:
    clock = FakeClock()
    q = JobQuotas(writes_per_sec=1000, burst=1000, max_value_bytes=64 * KiB,
                  node_bytes_per_sec=4 * KiB, node_burst_bytes=256 * KiB, clock=clock)
    value = b"x" * (64 * KiB)
    q.write("msg_stats", "6", 1001, b"{}")                    # bob's job is there too
    flood = 0
    with pytest.raises(Refused) as exc:
        for flood in range(1000):  # noqa: B007
            q.write("msg_stats", "5", 1000, value)
    assert "job 5 is over its share of this node's etcd budget" in str(exc.value)
    assert flood * (len(value) + WRITE_OVERHEAD) <= 128 * KiB      # half of the node's
    q.write("msg_stats", "6", 1001, value)                    # bob's share is untouched


def test_a_paused_job_writes_nothing_and_others_go_on() -> None:
    store, keys, clock = MemoryStore(), Keys(), FakeClock()
    book = PauseBook(store, keys, refresh_sec=2.0, clock=clock)
    q = JobQuotas(paused=book)
    pause = ReportPause("5", 1e9, 700 * MiB, 1024 * MiB, 3 * MiB, "alice")
    store.put(keys.job_paused("5"), pause.to_json())
    with pytest.raises(Refused) as exc:
        q.write("peer_publish", "5", 1000, b"{}")
    assert exc.value.kind == "paused" and "job 5 (user alice)" in str(exc.value)
    q.write("peer_publish", "6", 1001, b"{}")
    store.delete(keys.job_paused("5"))
    with pytest.raises(Refused):                              # cached until the refresh
        q.write("peer_publish", "5", 1000, b"{}")
    clock.advance(2.0)
    q.write("peer_publish", "5", 1000, b"{}")


# --- the leader's decision ------------------------------------------------------------------

def test_the_heaviest_writer_not_yet_paused_is_paused_above_the_watermark() -> None:
    written = {"5": 10 * MiB, "6": 2 * MiB, "7": 0}
    q = 1000 * MiB
    assert report_pauses(690 * MiB, q, 0.7, 0.5, written, set()).pause is None
    assert report_pauses(700 * MiB, q, 0.7, 0.5, written, set()).pause == "5"
    # with job 5 paused at 700 MiB, the next is paused at half the room left then
    level = next_pause_level(q, 0.7, 700 * MiB)
    assert level == 700 * MiB + (q - 700 * MiB) / 2
    assert report_pauses(int(level) - 1, q, 0.7, 0.5, written, {"5"}, 700 * MiB).pause is None
    assert report_pauses(int(level), q, 0.7, 0.5, written, {"5"}, 700 * MiB).pause == "6"
    assert report_pauses(999 * MiB, q, 0.7, 0.5, written, {"5", "6"},
                         950 * MiB).pause is None                     # 7 wrote nothing
    between = report_pauses(600 * MiB, q, 0.7, 0.5, written, {"5"})
    assert between.pause is None and between.resume == ()      # hysteresis
    assert report_pauses(499 * MiB, q, 0.7, 0.5, written, {"6", "5"}).resume == ("5", "6")
    assert report_pauses(999 * MiB, 0, 0.7, 0.5, written, set()).pause is None  # no quota


def test_a_pause_reads_back_and_names_job_and_user() -> None:
    p = ReportPause("42", 1_700_000_000.0, 750 * MiB, 1024 * MiB, 5 * MiB, "bob")
    assert ReportPause.from_json("k", p.to_json()) == p
    line = p.line()
    assert "job 42 (user bob)" in line and "73% of its quota" in line


def test_the_leader_pauses_the_job_that_writes_most_and_resumes_it(tmp_path: Path) -> None:
    clock = FakeClock()
    store, keys = MemoryStore(clock=clock), Keys()
    quota = 64 * KiB
    cfg = parse_config({"store": {"space_quota_bytes": quota, "compaction_interval_sec": 1,
                                  "compaction_retention_sec": 1}})
    lead = Leadership(store, keys.leader(), 10, {"name": "a"}, clock=clock)
    assert lead.step()
    h = Hygiene(cfg, store, lead, monotonic=clock)
    for job, user in (("5", "alice"), ("6", "bob")):
        store.put(keys.job(job), JobRecord(job, 0, 1000, ("n1",), JobSpec(),
                                           user=user).to_json())
    assert h.step() == []
    clock.advance(1)
    # bob's job writes three times what alice's does, past the watermark together
    need = int(cfg.store.report_watermark_share * quota)
    for r in range(6):
        store.put(keys.job_msgstats("n1", "6", r), b"b" * (need // 8))
    for r in range(2):
        store.put(keys.job_msgstats("n1", "5", r), b"a" * (need // 8))
    lines = h.step()
    assert any("reports of job 6 (user bob) paused" in line for line in lines), lines
    assert store.get(keys.job_paused("6")) is not None
    assert store.get(keys.job_paused("5")) is None
    store.delete_prefix(keys.node_job_reports_prefix("n1", "6"))
    clock.advance(1)
    assert lead.step()
    lines = h.step()
    assert any("reports of job 6 resumed" in line for line in lines), lines
    assert store.get(keys.job_paused("6")) is None


# --- register ---------------------------------------------------------------------------------

def test_register_refuses_a_node_outside_the_job_and_counts_it(tmp_path: Path) -> None:
    store, keys = MemoryStore(), Keys()
    store.put(keys.job("5"), JobRecord("5", 0, 1000, ("n1", "n2"), JobSpec()).to_json())
    store.put(keys.job_map("5"), RankMap("5", 0, ("n1", "n2"), ("n3",)).to_json())
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "status").write_text("Name:\tpython\nUid:\t1000\t1000\n")

    def agent(node: str) -> LocalApiServer:
        return LocalApiServer(tmp_path / f"{node}.sock", node, owner_of=lambda job: 1000,
                              valid_for=lambda: 10.0, table=RankTable(), proc_root=proc,
                              size_of=lambda job: job_size(store, keys, job, node))

    peer = Peer(4242, 1000, 1000)
    ask = {"op": "register", "job": "5", "rank": 0, "epoch": 1, "pid": 4242}
    outside = agent("n6")
    reply = outside.handle_request(ask, peer)
    assert reply["ok"] is False and reply["kind"] == "node"
    assert "node n6 is not a node of job 5" in str(reply["error"])
    assert outside.error_counts()["node"] == 1
    assert outside.ranks.get("5", 0) is None
    for node in ("n1", "n3"):                                   # a node of the job, a spare
        inside = agent(node)
        assert inside.handle_request(ask, peer)["ok"] is True, node
    assert job_size(store, keys, "5", "n2") == 2
