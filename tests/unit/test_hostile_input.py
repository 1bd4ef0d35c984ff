"""Garbage thrown at every port a RAPS daemon listens on, over real loopback sockets: the
coordinator's heartbeat port (10,000 datagrams), an agent's chunk-transfer port and its
local API socket. Each keeps serving honest peers afterwards, nothing is accepted, and
every rejection is counted by kind."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from raps_slurm.agent.local_api import LocalApiServer, RankTable
from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.transfer import TransferClient, TransferError, TransferServer
from raps_slurm.coordinator.heartbeats import HeartbeatServer
from raps_slurm.runtime.agent_client import encode_frame, read_reply
from raps_slurm.wire.heartbeat import MAX_DATAGRAM, Ack, Heartbeat, decode, encode, node_key

KEY, OTHER = b"k" * 32, b"o" * 32
N1 = node_key(KEY, "n1")  # n1's heartbeats verify only with its node key


def wait_for(what: str, probe: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def garbage_datagrams(rng: random.Random, n: int) -> Iterator[bytes]:
    """Random bytes, truncated and extended valid heartbeats, other-key signatures."""
    good = encode(Heartbeat("n1", 1, 1, time.time()), N1)
    for i in range(n):
        kind = i % 5
        if kind == 0:
            yield rng.randbytes(rng.randint(0, MAX_DATAGRAM + 64))
        elif kind == 1:
            yield good[:rng.randint(0, len(good) - 1)]
        elif kind == 2:
            yield good + rng.randbytes(rng.randint(1, 64))
        elif kind == 3:
            yield encode(Heartbeat("n1", 1, 100 + i, time.time()), OTHER)
        else:
            b = bytearray(good)
            b[rng.randrange(len(b))] ^= 1 + rng.randrange(255)
            yield bytes(b)


def test_heartbeat_port_survives_10000_garbage_datagrams() -> None:
    server = HeartbeatServer(("127.0.0.1", 0), KEY, max_skew=5.0, leader_revision=lambda: 7)
    server.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(2.0)
    try:
        rng = random.Random(7)
        sent = 0
        batch: list[bytes] = []
        for data in garbage_datagrams(rng, 10_000):
            batch.append(data)
            if len(batch) == 200:  # a batch at a time: the socket buffer drops nothing
                # each batch from an address of its own, below the per-source budget
                # (400 refusals at once): every datagram reaches the parsers
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as src:
                    src.bind((f"127.0.1.{sent // 200 + 1}", 0))
                    for d in batch:
                        src.sendto(d, server.address)
                sent += len(batch)
                wait_for(f"{sent} rejections",
                         lambda s=sent: sum(server.rejected.values()) >= s)
                batch = []
        assert sum(server.rejected.values()) == 10_000 and server.accepted == 0
        assert set(server.rejected) <= {"magic", "size", "signature", "format", "replay",
                                        "skew", "name", "field", "version", "kind"}, \
            server.rejected
        assert server.drain() == []
        hb = Heartbeat("n1", 1, 99_999, time.time())
        sock.sendto(encode(hb, N1), server.address)
        ack = decode(sock.recvfrom(512)[0], N1)
        assert isinstance(ack, Ack) and ack.counter == 99_999
    finally:
        sock.close()
        server.stop()


@pytest.fixture
def transfer(tmp_path: Path) -> Iterator[TransferServer]:
    store = ChunkStore(tmp_path / "store")
    raw = b"chunk"
    import blake3
    store.put_many("1", [(blake3.blake3(raw).hexdigest(), len(raw), b"\x00" + raw)])
    server = TransferServer(store, KEY, "n1", ("127.0.0.1", 0))
    server.start()
    yield server
    server.stop()


def test_transfer_port_survives_garbage_and_forged_peers(transfer: TransferServer) -> None:
    rng = random.Random(3)
    for i in range(60):
        with socket.create_connection(transfer.address, timeout=5) as s:
            if i % 3 == 0:
                s.sendall(rng.randbytes(rng.randint(1, 300)))
            elif i % 3 == 1:
                s.sendall(struct.pack(">I", 1 << 30))  # claims a gigantic hello
            else:
                s.sendall(struct.pack(">I", 8) + b"not json")
            with contextlib.suppress(OSError):  # the server may have hung up already
                s.shutdown(socket.SHUT_WR)
                s.recv(4096)
    # a peer with another cluster key fails the handshake
    for _ in range(5):
        with pytest.raises(TransferError):
            TransferClient(OTHER, "n9", transfer.address).close()
    wait_for("65 rejections", lambda: sum(transfer.rejected.values()) == 65)
    assert set(transfer.rejected) <= {"handshake", "authentication", "io"}, transfer.rejected
    assert transfer.rejected["handshake"] >= 60 - transfer.rejected["io"]
    # and an honest peer is served
    import blake3
    digest = blake3.blake3(b"chunk").hexdigest()
    with TransferClient(KEY, "n2", transfer.address) as c:
        got = list(c.fetch("1", [digest], {digest: 5}))
    assert [(d, raw, bytes(stored)) for d, raw, stored in got] == [(digest, 5, b"\x00chunk")]


def test_agent_socket_survives_garbage(tmp_path: Path) -> None:
    api = LocalApiServer(tmp_path / "agent.sock", "n1", owner_of=lambda job: None,
                         valid_for=lambda: 10.0, table=RankTable())
    api.start()
    try:
        rng = random.Random(5)
        for i in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(str(tmp_path / "agent.sock"))
            try:
                if i % 3 == 0:
                    body = rng.randbytes(rng.randint(1, 200))
                    s.sendall(struct.pack(">I", len(body)) + body)
                elif i % 3 == 1:
                    s.sendall(struct.pack(">I", 1 << 31))  # over the size limit
                else:
                    s.sendall(encode_frame({"op": "register", "job": "1" * 500, "rank": -1}))
                s.shutdown(socket.SHUT_WR)
                reply = read_reply(s)
                assert reply["ok"] is False, reply
            except (OSError, ConnectionError):
                pass
            finally:
                s.close()
        assert sum(api.errors.values()) >= 300, api.errors
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(str(tmp_path / "agent.sock"))
        s.sendall(encode_frame({"op": "hello"}))
        assert read_reply(s)["ok"] is True
        s.close()
    finally:
        api.stop()

