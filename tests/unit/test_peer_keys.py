"""Pair keys of the chunk transfer: an agent with a node key and tickets authenticates as
its own node only, and reads no cluster key (loopback servers, real files)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.agent.main import _node_keys
from raps_slurm.agent.transfer_access import RECHECK, JobNodes
from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.peer_keys import PeerKeys, create_tickets, load_tickets, pair_key
from raps_slurm.checkpoint.transfer import TransferClient, TransferError, TransferServer
from raps_slurm.checkpoint.transfer_wire import handshake_proof, recv_handshake, send_handshake
from raps_slurm.config import Config, DetectionConfig, parse_config
from raps_slurm.core.jobs import JobRecord, JobSpec, group_to_json
from raps_slurm.errors import ConfigError
from raps_slurm.model import BackupGroup
from raps_slurm.store import Keys, MemoryStore
from raps_slurm.testing.cluster import wait_until
from raps_slurm.wire.heartbeat import create_node_key, node_key

CLUSTER = secrets.token_bytes(64)
NODES = ["n1", "n2", "n3"]


def agent_keys(tmp_path: Path, node: str) -> PeerKeys:
    """``node``'s keys as its agent holds them: node key and tickets, no cluster key."""
    path = tmp_path / f"{node}.tickets"
    if not path.exists():
        create_tickets(str(path), CLUSTER, node, NODES)
    return PeerKeys.from_files(node, node_key(CLUSTER, node), str(path))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[TransferServer]:
    srv = TransferServer(ChunkStore(tmp_path / "n2"), agent_keys(tmp_path, "n2"), "n2",
                         ("127.0.0.1", 0))
    srv.start()
    yield srv
    srv.stop()


def served(client: TransferClient) -> bool:
    with client as c:
        return bool(c.call({"op": "has", "job": "9", "digests": []})[0]["missing"] == [])


def test_a_node_with_its_tickets_talks_to_a_node_with_its_node_key(server, tmp_path) -> None:
    assert served(TransferClient(agent_keys(tmp_path, "n1"), "n1", server.address, peer="n2"))
    # the head node's rapsctl derives its ticket from the cluster key
    assert served(TransferClient(CLUSTER, "rapsctl@head", server.address, peer="n2"))
    assert server.rejections() == {}


def test_a_node_cannot_pass_for_another_client(server, tmp_path) -> None:
    """Root on n3 holds n3's tickets: claiming to be n1 with them fails, whether it checks
    the server's proof (it cannot) or answers regardless."""
    n3 = agent_keys(tmp_path, "n3")
    ticket = load_tickets(str(tmp_path / "n3.tickets"), "n3")["n2"]
    with pytest.raises(TransferError, match="failed authentication"):
        TransferClient(PeerKeys("n1", list, {"n2": ticket}.get), "n1", server.address,
                       peer="n2")
    with socket.create_connection(server.address, timeout=10) as conn:
        deadline = time.monotonic() + 10
        nc = os.urandom(16)
        send_handshake(conn, {"node": "n1", "nonce": nc.hex()}, deadline)
        ns = bytes.fromhex(recv_handshake(conn, deadline)["nonce"])
        send_handshake(conn, {"proof": handshake_proof(ticket, b"c", nc, ns, "n1", "n2")},
                       deadline)
        assert conn.recv(1) == b""  # the server hangs up
    wait_until("the refusal counted", server.rejections,
               lambda r: r.get("authentication") == 1, timeout=10)
    assert served(TransferClient(n3, "n3", server.address, peer="n2"))


def test_a_node_cannot_pass_for_another_server(tmp_path) -> None:
    """n3 serves with its own node key: a client meaning n2 refuses it whether it says it
    is n2 (its proof fails) or says it is n3 (not the node meant)."""
    n3 = agent_keys(tmp_path, "n3")
    liar = TransferServer(ChunkStore(tmp_path / "liar"), n3, "n2", ("127.0.0.1", 0))
    honest = TransferServer(ChunkStore(tmp_path / "n3"), n3, "n3", ("127.0.0.1", 0))
    liar.start()
    honest.start()
    try:
        n1 = agent_keys(tmp_path, "n1")
        with pytest.raises(TransferError, match="failed authentication"):
            TransferClient(n1, "n1", liar.address, peer="n2")
        with pytest.raises(TransferError, match="'n3', not 'n2'"):
            TransferClient(n1, "n1", honest.address, peer="n2")
        assert served(TransferClient(n1, "n1", honest.address, peer="n3"))
    finally:
        liar.stop()
        honest.stop()


def test_no_ticket_for_a_server_is_a_clear_error(server, tmp_path) -> None:
    path = tmp_path / "lonely.tickets"
    create_tickets(str(path), CLUSTER, "n1", ["n1", "n3"])  # n2 left out
    keys = PeerKeys.from_files("n1", node_key(CLUSTER, "n1"), str(path))
    with pytest.raises(TransferError, match="no transfer ticket for node 'n2'"):
        TransferClient(keys, "n1", server.address, peer="n2")


def test_pair_keys_differ_by_client_and_by_server(tmp_path) -> None:
    k1, k2 = node_key(CLUSTER, "n1"), node_key(CLUSTER, "n2")
    keys = {pair_key(k1, "n2"), pair_key(k1, "n3"), pair_key(k2, "n1"), pair_key(k2, "n3")}
    assert len(keys) == 4
    # n3's ticket for server n1 is the key n1 derives for client n3, and nothing else
    assert agent_keys(tmp_path, "n3").ticket("n1") == pair_key(k1, "n3")
    assert agent_keys(tmp_path, "n3").ticket("n3") is None  # none for itself
    assert agent_keys(tmp_path, "n3").accepting("n1") == [pair_key(node_key(CLUSTER, "n3"),
                                                                    "n1")]


@pytest.mark.parametrize("content, mode, problem", [
    (b"{", 0o600, "not JSON"),
    (b'{"format": "other", "node": "n1", "tickets": {}}', 0o600, "not a tickets file"),
    (b'{"format": "raps-transfer-tickets/1", "node": "n9", "tickets": {}}', 0o600,
     "made for node 'n9', not 'n1'"),
    (b'{"format": "raps-transfer-tickets/1", "node": "n1", "tickets": {"n2": "zz"}}', 0o600,
     "ticket for 'n2': expected 64 hex digits"),
    (b'{"format": "raps-transfer-tickets/1", "node": "n1", "tickets": []}', 0o600,
     "'tickets' must map"),
    (b'{"format": "raps-transfer-tickets/1", "node": "n1", "tickets": {}}', 0o644,
     "mode 0644"),
])
def test_a_bad_tickets_file_is_one_line(tmp_path, content, mode, problem) -> None:
    path = tmp_path / "n1.tickets"
    path.write_bytes(content)
    path.chmod(mode)
    with pytest.raises(ConfigError) as err:
        load_tickets(str(path), "n1")
    assert len(err.value.errors) == 1 and problem in err.value.errors[0]
    assert str(path) in err.value.errors[0]


def test_an_agent_with_tickets_reads_no_cluster_key(tmp_path) -> None:
    create_node_key(str(tmp_path / "n1.key"), CLUSTER, "n1")
    create_tickets(str(tmp_path / "n1.tickets"), CLUSTER, "n1", NODES)
    det = DetectionConfig(cluster_key_file=str(tmp_path / "absent.key"),
                          node_key_file=str(tmp_path / "%n.key"),
                          transfer_tickets_file=str(tmp_path / "%n.tickets"))
    mine, also, keys = _node_keys(Config(detection=det), "n1")
    assert mine == node_key(CLUSTER, "n1") and also is None
    assert keys.ticket("n2") == pair_key(node_key(CLUSTER, "n2"), "n1")
    # without tickets it still needs the cluster key, and says so
    with pytest.raises(ConfigError, match=r"absent\.key: missing"):
        _node_keys(Config(detection=DetectionConfig(cluster_key_file=det.cluster_key_file)),
                   "n1")


def test_tickets_need_a_node_key_file() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"detection": {"transfer_tickets_file": "/x/%n.tickets"}}, "t.yaml")
    assert err.value.errors == ["t.yaml: detection.transfer_tickets_file: set, but "
                                "detection.node_key_file is '' (an agent with tickets reads no "
                                "cluster key to derive its node key from)"]
    parse_config({"detection": {"transfer_tickets_file": "/x/%n.tickets",
                                "node_key_file": "/x/%n.key"}})


def test_rapsctl_config_transfer_tickets(tmp_path) -> None:
    key = tmp_path / "raps.key"
    key.write_bytes(CLUSTER)
    key.chmod(0o600)
    out = str(tmp_path / "%n.tickets")

    def run(*nodes: str, peers: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "raps_slurm.cli", "config",
                               "transfer-tickets", *nodes, "--peers", peers, "--cluster-key",
                               str(key), "--out", out], capture_output=True, text=True,
                              check=False)

    r = run("n1", "n2", peers="n[1-3]")
    assert r.returncode == 0, r.stderr
    assert "2 tickets of n1" in r.stdout
    assert sorted(load_tickets(str(tmp_path / "n2.tickets"), "n2")) == ["n1", "n3"]
    assert os.stat(tmp_path / "n1.tickets").st_mode & 0o777 == 0o600
    r = run("n3", peers="n[1-")
    assert r.returncode != 0 and "bad hostlist 'n[1-'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run("n1", peers="n1")
    assert r.returncode != 0 and "already exists" in r.stderr


def test_a_node_moves_only_the_data_of_its_own_jobs(tmp_path) -> None:
    """The agent's access rule on a real server: job 9 runs on n1 and n2; n3 is refused
    (counted), rapsctl on the head node is served, and n3 is served once job 9's
    registration names it (read again at most once per RECHECK)."""
    now = [100.0]
    store, keys = MemoryStore(clock=lambda: now[0]), Keys()
    store.put(keys.job("9"), JobRecord("9", 0, 1000, ("n1", "n2"), JobSpec()).to_json())
    # job 11: registered on n1 only; n3 holds rank 0's log backup (repair copies from it)
    store.put(keys.job("11"), JobRecord("11", 0, 1000, ("n1",), JobSpec()).to_json())
    store.put(keys.job_group("11", 0), group_to_json(BackupGroup(0, "n1", "n3", ())))
    srv = TransferServer(ChunkStore(tmp_path / "n2"), agent_keys(tmp_path, "n2"), "n2",
                         ("127.0.0.1", 0), allowed=JobNodes(store, keys, lambda: now[0]).allowed)
    srv.start()
    try:
        def has(client: TransferClient, job: str = "9") -> str:
            """'ok', or the server's refusal."""
            try:
                client.call({"op": "has", "job": job, "digests": []})
            except TransferError as exc:
                return str(exc)
            return "ok"

        with TransferClient(agent_keys(tmp_path, "n1"), "n1", srv.address, peer="n2") as n1:
            assert has(n1) == "ok"
            assert has(n1, "10") == "n2 refused has: n1 is not a node of job 10"  # no such job
            assert has(n1, "11") == "ok"
        with TransferClient(agent_keys(tmp_path, "n3"), "n3", srv.address, peer="n2") as n3:
            assert has(n3) == "n2 refused has: n3 is not a node of job 9"
            assert has(n3, "11") == "ok"  # a holder of job 11's data, after n1's lookup
            assert srv.rejections() == {"forbidden": 2}
            with TransferClient(CLUSTER, "rapsctl@head", srv.address) as head:
                assert has(head) == "ok"
            store.put(keys.job("9"), JobRecord("9", 1, 1000, ("n2", "n3"),
                                               JobSpec()).to_json())
            assert has(n3) != "ok"  # the refusal is remembered for RECHECK
            now[0] += RECHECK
            assert has(n3) == "ok"
    finally:
        srv.stop()
