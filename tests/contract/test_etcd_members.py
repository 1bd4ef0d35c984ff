"""RAPS against a three-member etcd under faults: one member lost changes nothing, two
lost stop writes with a clear error until one returns; three ``raps-coordinator``
processes hand leadership over when the leader is frozen, and the thawed one steps down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from raps_slurm.coordinator.election import Leadership
from raps_slurm.errors import NotLeader, StoreError
from raps_slurm.store import EtcdStore, Keys
from raps_slurm.testing import EtcdCluster
from raps_slurm.testing.cluster import leader_name, wait_until
from raps_slurm.wire.heartbeat import create_key

ROOT = Path(__file__).resolve().parents[2]
LEASE = 3.0

pytestmark = pytest.mark.etcd


@pytest.fixture
def etcd3() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


def writes(store: EtcdStore, key: str) -> bool:
    try:
        store.put(key, b"x")
        return True
    except StoreError:
        return False


def test_one_member_lost_is_nothing_two_lost_stop_writes_clearly(etcd3: EtcdCluster) -> None:
    store = EtcdStore(etcd3.urls, timeout=2.0)
    keys = Keys()
    lead = Leadership(store, keys.leader(), LEASE, {"name": "a"})
    assert lead.step()
    etcd3.stop_member(0)  # the endpoint every client tries first
    wait_until("writes through the other members", lambda: writes(store, "/raps/v1/t/1"),
               timeout=20)
    assert lead.step() and lead.commit([], [])
    etcd3.stop_member(1)  # quorum lost
    with pytest.raises(StoreError) as exc:
        for _ in range(5):  # the first may still be answered from a stale leader's view
            store.put("/raps/v1/t/2", b"x")
            time.sleep(0.5)
    text = str(exc.value)
    assert "etcd" in text and ("timed out" in text or "no etcd endpoint answered" in text
                               or "leader" in text), text
    etcd3.start_member(1, wait=True)
    wait_until("writes again with two members", lambda: writes(store, "/raps/v1/t/3"),
               timeout=30)
    store.close()


def no_leader(url: str) -> bool:
    st = requests.post(url + "/v3/maintenance/status", json={}, timeout=2).json()
    return "etcdserver: no leader" in (st.get("errors") or [])


def test_quorum_lost_only_when_a_majority_is_provably_out(etcd3: EtcdCluster) -> None:
    """Stopped members refuse connections and the last one answers without a leader: no
    quorum anywhere. Frozen members (what a partition looks like) prove nothing."""
    store = EtcdStore(etcd3.urls, timeout=2.0)
    assert not store.quorum_lost()
    etcd3.pause_member(1)
    etcd3.pause_member(2)
    # Member 0 alone has no leader, but 1 and 2 may be serving together elsewhere.
    wait_until("member 0 without a leader", lambda: no_leader(etcd3.urls[0]), timeout=10)
    started = time.monotonic()
    assert not store.quorum_lost()
    assert time.monotonic() - started < 4  # bounded probes, not the store timeout per call
    etcd3.pause_member(1, False)
    etcd3.pause_member(2, False)
    etcd3.stop_member(1)
    wait_until("writes with two members", lambda: writes(store, "/raps/v1/q/1"), timeout=20)
    assert not store.quorum_lost()  # two members still make a quorum
    etcd3.stop_member(2)
    wait_until("two members out: no quorum", store.quorum_lost, timeout=10)
    etcd3.start_member(1, wait=True)
    wait_until("quorum back", lambda: not store.quorum_lost(), timeout=10)
    store.close()


def coordinator(cfg: Path, name: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "RAPS_CONFIG"}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "raps_slurm.coordinator", "--config",
                                 str(cfg), "--name", name, "--heartbeat-address",
                                 "127.0.0.1:0", "--user-address", ""], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def ping(cfg: Path) -> str:
    return subprocess.run([sys.executable, "-m", "raps_slurm.cli", "--config", str(cfg),
                           "ping"], capture_output=True, text=True, timeout=30,
                          check=False).stdout


def test_three_coordinators_three_members(etcd3: EtcdCluster, tmp_path: Path) -> None:
    key = tmp_path / "raps.key"
    create_key(str(key))
    cfg = yaml.safe_load((ROOT / "configs" / "test.yaml").read_text())
    # under 2/3 of the lease: the config refuses more with several endpoints
    cfg["store"] = {"endpoints": etcd3.urls, "timeout_sec": 1.5}
    cfg["detection"]["cluster_key_file"] = str(key)
    cfg["coordinator"]["leader_lease_sec"] = LEASE
    cfg["coordinator"]["metrics_address"] = ""
    cfg["hooks"] = {"log_dir": str(tmp_path)}
    path = tmp_path / "raps.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs = {n: coordinator(path, n, tmp_path / f"{n}.log") for n in ("c1", "c2", "c3")}
    # Who leads is read from the leader key (what ``rapsctl ping`` reports), not through
    # a ``rapsctl`` process per probe, which takes most of a second: the hand-over below
    # is timed by these probes. The ping itself is checked once the quorum is lost.
    store = EtcdStore(etcd3.urls, timeout=1.5)
    keys = Keys()

    def leader() -> str | None:
        return leader_name(store, keys)

    try:
        first = wait_until("a leader", leader, bool, 30)
        assert first in procs
        # The leader frozen: a standby leads within the lease (and a read or two).
        procs[first].send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        second = wait_until("another leader", leader,
                            lambda n: n is not None and n != first, 2 * LEASE + 15)
        assert time.monotonic() - frozen_at < 2 * LEASE + 15
        # Thawed, the old leader finds its lease gone, steps down and writes nothing.
        procs[first].send_signal(signal.SIGCONT)
        wait_until(f"{first} to step down", lambda: (tmp_path / f"{first}.log").read_text(),
                   lambda t: "lost leadership" in t, 20)
        assert leader() == second
        # One member lost (the first endpoint, every client's first choice): still led.
        etcd3.stop_member(0)
        wait_until("a leader with two members", leader, bool, 30)
        # Two lost: no quorum; ping says etcd is down, the coordinators say why.
        etcd3.stop_member(1)
        out = wait_until("ping to report etcd down", lambda: ping(path),
                         lambda o: "is DOWN" in o, 30)
        assert "etcd at" in out and "no quorum" in out, out
        wait_until("a coordinator to report the store", lambda: "".join(
            (tmp_path / f"{n}.log").read_text() for n in procs),
            lambda t: "etcd unavailable" in t or "etcd error" in t, 30)
        # A member back: quorum again, and a leader.
        etcd3.start_member(1, wait=True)
        wait_until("a leader again", leader, bool, 40)
        for n, p in procs.items():
            assert p.poll() is None, f"{n} exited: {(tmp_path / f'{n}.log').read_text()[-2000:]}"
    finally:
        store.close()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def test_a_deposed_leader_cannot_write(etcd3: EtcdCluster) -> None:
    store = EtcdStore(etcd3.urls, timeout=2.0)
    keys = Keys()
    t = [0.0]
    old = Leadership(store, keys.leader(), LEASE, {"name": "old"}, clock=lambda: t[0])
    assert old.step()
    store.delete(keys.leader())  # its lease lapsed and another took the key meanwhile
    new = Leadership(store, keys.leader(), LEASE, {"name": "new"})
    assert new.step()
    with pytest.raises(NotLeader):
        old.commit([], [])
    assert new.commit([], [])
    store.close()
