"""One job floods etcd through an agent's writes for its ranks, against a real etcd with a
small quota: the leader pauses that job's reports before etcd's NOSPACE alarm, another
user's job goes on writing, ``rapsctl show status`` names the job and its user, and the
reports resume once etcd is below the resume share."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.agent.quota import JobQuotas, PauseBook
from raps_slurm.config import parse_config
from raps_slurm.coordinator.election import Leadership
from raps_slurm.coordinator.hygiene import Hygiene
from raps_slurm.core.hygiene import ReportPause
from raps_slurm.core.jobs import JobRecord, JobSpec
from raps_slurm.errors import ClusterError, Refused, StoreError
from raps_slurm.store import EtcdStore, Keys
from raps_slurm.testing.etcd import EtcdServer

ROOT = Path(__file__).resolve().parents[2]
QUOTA = 8 << 20
VALUE = 60 << 10
ALICE, MALLORY = 1000, 1001


@pytest.fixture
def small_etcd() -> Iterator[EtcdServer]:
    try:
        # in memory: the flood's fsyncs would otherwise wait on a shared disk
        server = EtcdServer(extra_args=("--quota-backend-bytes", str(QUOTA)),
                            tmp_root="/dev/shm").start()
    except ClusterError as exc:
        pytest.fail(f"this test needs a real etcd: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


def _show_status(config: Path, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "raps_slurm.cli", "--config", str(config),
                        "show", "status", *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=60, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _status(config: Path) -> dict[str, object]:
    out: dict[str, object] = json.loads(_show_status(config, "--json"))
    return out


@pytest.mark.etcd
def test_the_heaviest_writer_is_paused_before_nospace(small_etcd: EtcdServer,
                                                       tmp_path: Path) -> None:
    settings = {"store": {"endpoints": [small_etcd.url], "space_quota_bytes": QUOTA,
                          # history is kept, as it is between two compactions
                          "compaction_retention_sec": 3600, "compaction_interval_sec": 0.1}}
    cfg = parse_config(settings)
    config = tmp_path / "raps.yaml"
    config.write_text(json.dumps(settings))
    store, keys = EtcdStore([small_etcd.url], timeout=5.0), Keys()
    with store:
        lead = Leadership(store, keys.leader(), 10, {"name": "c1"})
        assert lead.step()
        hygiene = Hygiene(cfg, store, lead)
        for job, uid, user in (("5", ALICE, "alice"), ("6", MALLORY, "mallory")):
            store.put(keys.job(job), JobRecord(job, 0, uid, ("n1",), JobSpec(),
                                               user=user).to_json())
        # The agent's door as on n1: job budgets as shipped, the node's far above what
        # this quota affords (as with store.cluster_nodes set too low), so that only the
        # watermark stands between the flood and NOSPACE: the quota in 4 s.
        quotas = JobQuotas(max_value_bytes=64 << 10, node_bytes_per_sec=QUOTA / 4,
                           node_burst_bytes=256 << 10,
                           paused=PauseBook(store, keys, refresh_sec=0.1))

        def report(job: str, uid: int, rank: int, value: bytes) -> None:
            quotas.write("msg_stats", job, uid, value)
            store.put(keys.job_msgstats("n1", job, rank), value)

        def report_soon(job: str, uid: int, rank: int, value: bytes) -> None:
            """As a rank reports: a write over the node's rate goes in a moment later."""
            give_up = time.monotonic() + 10
            while True:
                try:
                    return report(job, uid, rank, value)
                except Refused as exc:
                    if exc.kind != "quota" or time.monotonic() > give_up:
                        raise
                time.sleep(0.02)

        refused: Refused | None = None
        writes = 0
        deadline = time.monotonic() + 60
        while refused is None:
            assert time.monotonic() < deadline, f"no pause after {writes} writes"
            try:
                report("6", MALLORY, writes % 4, b"m" * VALUE)
            except Refused as exc:
                if exc.kind == "quota":  # the node's rate: the flood goes on at it
                    time.sleep(0.01)
                    lead.step()
                    hygiene.step()
                    continue
                refused = exc
            except StoreError as exc:
                pytest.fail(f"etcd refused a write before the job was paused, after {writes} "
                            f"writes: {exc}")
            writes += 1
            lead.step()
            if writes % 5 == 0:
                report_soon("5", ALICE, 0, b"a" * VALUE)  # the victim reports at its own pace
            hygiene.step()
        assert refused.kind == "paused" and "job 6 (user mallory)" in str(refused)
        assert store.get(keys.job_paused("5")) is None
        st = store.status()
        assert not st.alarms and st.db_size < QUOTA
        kv = store.get(keys.job_paused("6"))
        assert kv is not None
        pause = ReportPause.from_json(kv.key, kv.value)
        assert pause.in_use >= cfg.store.report_watermark_share * QUOTA and pause.quota == QUOTA
        report_soon("5", ALICE, 0, b"a" * VALUE)  # the other user's job still writes
        with pytest.raises(Refused):
            report("6", MALLORY, 0, b"m" * VALUE)
        status = _status(config)
        assert status["alarms"] == []
        [paused] = status["reports_paused"]  # type: ignore[misc]
        assert paused["job"] == "6" and paused["user"] == "mallory"
        assert "reports of job 6 (user mallory) paused since" in _show_status(config)
        # The flood's keys go and the history is compacted: below the resume share the
        # leader lifts the pause and the job writes again. (etcd counts the compacted
        # pages free at its next writes: the victim's small reports go on meanwhile.)
        store.delete_prefix(keys.node_job_reports_prefix("n1", "6"))
        store.compact(store.current_revision())
        deadline = time.monotonic() + 30
        while store.get(keys.job_paused("6")) is not None:
            assert time.monotonic() < deadline, \
                f"not resumed; etcd in use {store.status().db_size_in_use} of {QUOTA}"
            report_soon("5", ALICE, 1, b"{}")
            assert lead.step()
            hygiene.step()
            time.sleep(0.1)
        time.sleep(0.2)  # the agent's PauseBook reads again after refresh_sec
        report_soon("6", MALLORY, 0, b"m" * VALUE)
        assert _status(config)["reports_paused"] == []
