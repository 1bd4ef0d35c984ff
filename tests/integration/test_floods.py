"""Hostile input against the running daemons of the real cluster: the coordinator's
heartbeat port, an agent's chunk-transfer port and its local API socket are flooded with
random, truncated, oversized, wrongly signed input and names outside the cluster. Each
daemon keeps running and serving, no verdict changes, and every rejection is counted by
kind: the coordinator's own counter for heartbeats (from the agents' own address, past
its budget, as ``rate``, while the agents are still heard), the agent's counters
(exported through its health sample and the leader's ``raps_agent_rejected`` metric),
exactly, for the other two doors.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import struct
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from raps_slurm.checkpoint.transfer import TransferClient, TransferError
from raps_slurm.checkpoint.transfer_wire import handshake_proof, recv_handshake, send_handshake
from raps_slurm.coordinator.election import read_leader
from raps_slurm.errors import BadDatagram
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.cluster import CoordinatorProcess, LocalCluster, wait_until
from raps_slurm.testing.etcd import free_port
from raps_slurm.wire.heartbeat import (
    MAGIC,
    MAX_DATAGRAM,
    VERSION,
    Heartbeat,
    claimed_node,
    encode,
    node_key,
)
from raps_slurm.wire.heartbeat import load_key as load_cluster_key

DATAGRAMS = 10_000
TRANSFER_CONNECTIONS = 1_000  # per kind (3,000 in all): each a TCP connection and a server thread
API_REQUESTS = 500  # per kind (3,000 in all)
BATCH = 250  # datagrams: a burst larger than the socket buffer would be lost, not refused
STREAM_BATCH = 2_000  # connections lose nothing; each wait costs a health sample's round trip
NODE = "n1"


def metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


def heartbeat_counts(port: int) -> Counter[str]:
    return Counter({dict(labels)["result"]: int(v) for (name, labels), v in metrics(port).items()
                    if name == "raps_coordinator_heartbeats_total"})


def agent_counts(port: int, door: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for (name, labels), v in metrics(port).items():
        d = dict(labels)
        if name == "raps_agent_rejected" and d["node"] == NODE and d["door"] == door:
            out[d["kind"]] = int(v)
    return out


def verdicts(store: StateStore, keys: Keys) -> dict[str, int]:
    return {kv.key: kv.mod_revision for kv in store.get_prefix(keys.nodes_prefix())
            if kv.key.endswith("verdict")}


def flood(count: int, make: Callable[[int], tuple[Any, str]], send: Callable[[Any], None],
          counts: Callable[[], Counter[str]], batch: int = BATCH) -> Counter[str]:
    """Send ``count`` inputs made as (input, the kind it must be counted as) at send time,
    in batches; after each, wait until the daemon counted all of it (no loss hides a
    crash, no burst overflows a socket buffer). At the end the daemon's counts of those
    kinds are what was sent, kind by kind (give or take two strays); returns them."""
    base = counts()
    want: Counter[str] = Counter()

    def mine() -> Counter[str]:
        now = counts() - base
        return Counter({k: now[k] for k in now if k in want})

    for start in range(0, count, batch):
        for i in range(start, min(count, start + batch)):
            data, kind = make(i)
            send(data)
            want[kind] += 1
        wait_until("the daemon to count every rejection", mine,
                   lambda c: all(c[k] >= n for k, n in want.items()), timeout=30)
    got = mine()
    # At least every input sent, each counted as its kind. A stray refusal or two more
    # may come from another client of the same daemon (a connection the previous test's
    # job dropped mid-frame was counted once in CI); more than that is an error.
    assert all(want[k] <= got[k] <= want[k] + 2 for k in want), (got, want)
    return got


@contextlib.contextmanager
def metered_leader(cluster: LocalCluster, s: StateStore, keys: Keys, name: str
                   ) -> Iterator[tuple[CoordinatorProcess, int, dict[str, Any]]]:
    """A coordinator with a metrics port that leads (the process, the port, the leader
    key); stopped cleanly at the end."""
    port = free_port()
    c = cluster.coordinator(name).start(metrics_address=f"127.0.0.1:{port}")
    try:
        leader = wait_until(f"{name} to lead", lambda: read_leader(s, keys.leader()),
                            lambda v: v is not None and v.get("name") == name, 20)
        assert leader is not None
        yield c, port, leader
    finally:
        assert c.stop() == 0, c.log()[-2000:]


def test_coordinator_heartbeat_port_survives_a_flood(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Any) -> None:
    """10,000 bad datagrams from 127.0.0.1, the address every agent of the cluster sends
    from: each is refused under its reason until the address spent its budget, then
    dropped unread (``rate``), while the agents' own heartbeats are still heard."""
    s, keys = store
    cluster_key = load_cluster_key(str(cluster.run_dir / "etc" / "raps.key"))
    key = node_key(cluster_key, "flood1")  # a name outside the cluster, signed right
    members = set(cluster.node_names)
    with metered_leader(cluster, s, keys, "flood") as (c, port, leader):
        host, _, hb_port = str(leader["heartbeat"]).rpartition(":")
        target = ("127.0.0.1" if host in ("0.0.0.0", "") else host, int(hb_port))
        wait_until("every node heard by the new leader", lambda: heartbeat_counts(port),
                   lambda n: n["accepted"] >= 2 * len(members), timeout=30)
        before = verdicts(s, keys)
        rng = random.Random(8)
        other = os.urandom(32)

        def make(i: int) -> tuple[bytes, str]:
            kind = i % 5
            if kind == 0:
                data = rng.randbytes(rng.randrange(0, 700))
            elif kind == 1:
                good = encode(Heartbeat("flood1", 1, i + 1, time.time()), key)
                data = good[:rng.randrange(0, len(good))]
            elif kind == 2:
                data = MAGIC + bytes([VERSION]) + rng.randbytes(
                    rng.randrange(MAX_DATAGRAM - 3, 1400))
            elif kind == 3:  # a real node's name, a key that is not its own
                data = encode(Heartbeat(NODE, 1, i + 1, time.time()), other)
            else:
                data = encode(Heartbeat("flood1", 1, i + 1, time.time()), key)
            try:
                name = claimed_node(data)
            except BadDatagram as exc:
                return data, exc.reason
            return data, ("member" if name not in members else "signature")

        base = heartbeat_counts(port)
        want: Counter[str] = Counter()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for start in range(0, DATAGRAMS, BATCH):
                for i in range(start, start + BATCH):
                    data, kind = make(i)
                    sock.sendto(data, target)
                    want[kind] += 1
                sent = start + BATCH
                got = wait_until(
                    "the coordinator to count every datagram", lambda: heartbeat_counts(port),
                    lambda n, sent=sent: sum((n - base)[k] for k in (*want, "rate")) >= sent,
                    timeout=30)
        finally:
            sock.close()
        got = got - base
        # Each refused under its own reason or, past the address's budget, unread.
        assert all(got[k] <= want[k] + 2 for k in want), (got, want)
        assert DATAGRAMS <= sum(got[k] for k in (*want, "rate")) <= DATAGRAMS + 2, got
        assert got["rate"] >= DATAGRAMS // 2, got
        assert {"size", "magic", "member", "signature"} <= set(got), got
        # the agents, on the same address, were heard all along
        assert got["accepted"] >= len(members), got
        assert c.proc is not None and c.proc.poll() is None, c.log()[-2000:]
        assert read_leader(s, keys.leader())["name"] == "flood"  # type: ignore[index]
        assert verdicts(s, keys) == before
        assert all(s.get(keys.node(n)) is not None for n in cluster.node_names)


def test_agent_doors_survive_a_flood(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Any) -> None:
    s, keys = store
    key = load_cluster_key(str(cluster.run_dir / "etc" / "raps.key"))
    with metered_leader(cluster, s, keys, "flood-agent") as (_, port, _leader):
        reg = json.loads(s.get(keys.node(NODE)).value)  # type: ignore[union-attr]
        host, _, tport = str(reg["transfer"]).rpartition(":")
        address = ("127.0.0.1" if host in ("0.0.0.0", "") else host, int(tport))
        before = verdicts(s, keys)
        rng = random.Random(9)

        def send_transfer(item: tuple[str, bytes]) -> None:
            how, data = item
            if how == "unknown_op":  # a correct handshake, then a request no one serves
                with TransferClient(key, "flooder", address) as client:
                    client._chan.send({"op": "nope"}, b"")
                    with contextlib.suppress(TransferError, OSError):
                        client._chan.recv()  # the server hangs up: what we want
                return
            with socket.create_connection(address, timeout=10) as conn, \
                    contextlib.suppress(OSError, TransferError):  # the server may hang up
                if how == "wrong_proof":
                    nc = os.urandom(16)
                    deadline = time.monotonic() + 10
                    send_handshake(conn, {"node": "flooder", "nonce": nc.hex()}, deadline)
                    hello = recv_handshake(conn, deadline)
                    ns = bytes.fromhex(hello["nonce"])
                    send_handshake(conn, {"proof": handshake_proof(data, b"c", nc, ns, "flooder",
                                                                   hello["node"])}, deadline)
                else:
                    conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
                conn.recv(65536)  # until the server closes

        def make_transfer(i: int) -> tuple[tuple[str, bytes], str]:
            return [(("random", rng.randbytes(rng.randrange(0, 300))), "handshake"),
                    (("wrong_proof", os.urandom(32)), "authentication"),
                    (("unknown_op", b""), "frame")][i % 3]

        flood(3 * TRANSFER_CONNECTIONS, make_transfer, send_transfer,
              lambda: agent_counts(port, "transfer"), STREAM_BATCH)

        sock_path = str(cluster.run_dir / "sock" / NODE / "agent.sock")
        frame = struct.Struct(">I")

        def request(body: bytes) -> bytes:
            return frame.pack(len(body)) + body

        def send_api(data: bytes) -> None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(10)
                conn.connect(sock_path)
                with contextlib.suppress(OSError):  # the agent may hang up first
                    conn.sendall(data)
                    conn.shutdown(socket.SHUT_WR)
                    while conn.recv(65536):
                        pass

        def make_api(i: int) -> tuple[bytes, str]:
            return [(frame.pack(rng.randrange(1 << 17, 1 << 32)), "size"),
                    (request(b"{not json " + rng.randbytes(8).hex().encode()), "json"),
                    (request(b"[1, 2, 3]"), "not_object"),
                    (request(json.dumps({"op": "nope"}).encode()), "unknown_op"),
                    (request(json.dumps({"op": "register", "job": 1}).encode()), "schema"),
                    (frame.pack(100) + b"short", "truncated")][i % 6]

        flood(6 * API_REQUESTS, make_api, send_api, lambda: agent_counts(port, "local_api"),
              STREAM_BATCH)

        # Still serving: registered, a hello answered, no verdict changed.
        assert s.get(keys.node(NODE)) is not None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(sock_path)
            conn.sendall(request(b'{"op": "hello"}'))
            (n,) = frame.unpack(conn.recv(4))
            assert json.loads(conn.recv(n))["ok"] is True
        assert verdicts(s, keys) == before
