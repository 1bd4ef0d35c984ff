"""The coordinator's heartbeat server on real UDP sockets (loopback only)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from raps_slurm.coordinator.heartbeats import HeartbeatServer
from raps_slurm.errors import BadDatagram
from raps_slurm.wire.heartbeat import Ack, Heartbeat, Probe, decode, encode, node_key

KEY = b"k" * 32  # the cluster key; agents sign with their node keys
U64 = (1 << 64) - 1
OTHER = b"o" * 32


def nk(node: str) -> bytes:
    return node_key(KEY, node)


@pytest.fixture
def leading() -> list[int]:
    return [7]  # leader revision; 0 = not leading


@pytest.fixture
def server(leading: list[int]) -> Iterator[HeartbeatServer]:
    s = HeartbeatServer(("127.0.0.1", 0), KEY, max_skew=5.0, leader_revision=lambda: leading[0])
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def agent() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(2.0)
    try:
        yield sock
    finally:
        sock.close()


def wait_for(probe: object, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_valid_heartbeat_is_acked_and_queued(server: HeartbeatServer,
                                             agent: socket.socket) -> None:
    hb = Heartbeat("n1", 1, 1, time.time())
    agent.sendto(encode(hb, nk("n1")), server.address)
    ack = decode(agent.recvfrom(512)[0], nk("n1"))
    assert isinstance(ack, Ack)
    assert (ack.node, ack.counter, ack.sent_at, ack.leader_revision) == ("n1", 1, hb.sent_at, 7)
    got = server.drain()
    assert [(r.node, r.sent_at, r.acked) for r in got] == [("n1", hb.sent_at, True)]


def test_forged_replayed_and_stale_heartbeats_are_dropped_and_counted(
        server: HeartbeatServer, agent: socket.socket) -> None:
    good = encode(Heartbeat("n1", 1, 5, time.time()), nk("n1"))
    agent.sendto(good, server.address)
    agent.recvfrom(512)
    agent.sendto(good, server.address)                                           # replay
    agent.sendto(encode(Heartbeat("n1", 1, 4, time.time()), nk("n1")), server.address)  # older
    agent.sendto(encode(Heartbeat("n1", 1, 9, time.time()), OTHER), server.address)  # forged
    agent.sendto(encode(Heartbeat("n1", 1, 9, time.time() - 60), nk("n1")), server.address)  # stale
    agent.sendto(b"\x00" * 100, server.address)                                  # garbage
    wait_for(lambda: sum(server.rejected.values()) == 5)
    assert server.rejected == {"replay": 2, "signature": 1, "skew": 1, "magic": 1}
    assert server.accepted == 1 and len(server.drain()) == 1  # none renewed anything
    agent.settimeout(0.3)
    with pytest.raises(TimeoutError):
        agent.recvfrom(512)  # and none was acknowledged


def test_no_ack_unless_leading(server: HeartbeatServer, agent: socket.socket,
                               leading: list[int]) -> None:
    leading[0] = 0
    agent.sendto(encode(Heartbeat("n2", 1, 1, time.time()), nk("n2")), server.address)
    wait_for(lambda: server.accepted == 1)
    agent.settimeout(0.3)
    with pytest.raises(TimeoutError):
        agent.recvfrom(512)
    assert [r.acked for r in server.drain()] == [False]



def test_the_server_refuses_another_nodes_key_and_acks_with_the_nodes_key(
        server: HeartbeatServer, agent: socket.socket) -> None:
    mine, other = nk("n5"), nk("n6")
    now = time.time()
    inc = time.time_ns()
    # n6 (or anyone holding the cluster key alone) speaks for n5 with absurd numbers
    agent.sendto(encode(Heartbeat("n5", U64, U64, now), other), server.address)
    agent.sendto(encode(Heartbeat("n5", U64, U64, now), KEY), server.address)
    wait_for(lambda: server.rejected["signature"] == 2)
    agent.sendto(encode(Heartbeat("n5", inc, 1, now), mine), server.address)
    ack = decode(agent.recvfrom(512)[0], mine)
    assert isinstance(ack, Ack) and (ack.node, ack.incarnation, ack.counter) == ("n5", inc, 1)
    with pytest.raises(BadDatagram, match="signature"):
        decode(encode(ack, mine), other)
    assert [r.node for r in server.drain()] == ["n5"]
    server.send_probe("n5", agent.getsockname(), 9)
    probe = decode(agent.recvfrom(512)[0], mine)
    assert isinstance(probe, Probe) and probe.nonce == 9


def test_the_server_forgets_a_node_and_then_accepts_a_smaller_incarnation(
        server: HeartbeatServer, agent: socket.socket) -> None:
    mine = nk("n1")
    now = time.time()
    big = time.time_ns()
    small = big - 3600 * 10**9  # a clock stepped back an hour before the restart
    agent.sendto(encode(Heartbeat("n1", big, 1, now), mine), server.address)
    agent.recvfrom(512)
    agent.sendto(encode(Heartbeat("n1", small, 1, now), mine), server.address)
    wait_for(lambda: server.rejected["replay"] == 1)
    forgotten: list[str] = []
    server.on_forget = forgotten.append
    server.forget("n1")
    assert forgotten == ["n1"]
    agent.sendto(encode(Heartbeat("n1", small, 2, now), mine), server.address)
    assert decode(agent.recvfrom(512)[0], mine).incarnation == small  # type: ignore[union-attr]


def test_names_outside_the_cluster_are_refused_before_any_key_work(
        agent: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    from raps_slurm.wire import heartbeat

    derived: list[str] = []
    real = heartbeat.node_key

    def counting(key: bytes, node: str) -> bytes:
        derived.append(node)
        return real(key, node)

    monkeypatch.setattr(heartbeat, "node_key", counting)
    names = [["n1", "n2"]]
    s = HeartbeatServer(("127.0.0.1", 0), KEY, max_skew=5.0, leader_revision=lambda: 7,
                        members_from=lambda: names[0])
    s.start()
    try:
        wait_for(lambda: s.members == {"n1", "n2"})
        for i in range(50):
            agent.sendto(encode(Heartbeat(f"x{i}", 1, 1, time.time()), nk(f"x{i}")), s.address)
        wait_for(lambda: s.rejected["member"] == 50)
        assert not [n for n in derived if n.startswith("x")]
        agent.sendto(encode(Heartbeat("n1", 1, 1, time.time()), nk("n1")), s.address)
        assert isinstance(decode(agent.recv(512), nk("n1")), Ack)
        # a wrongly signed flood naming a member derives its key once, not per datagram
        before = len(derived)
        for i in range(20):
            agent.sendto(encode(Heartbeat("n2", 1, i + 1, time.time()), OTHER), s.address)
        wait_for(lambda: s.rejected["signature"] == 20)
        assert len(derived) - before <= 1
    finally:
        s.stop()


def test_a_source_that_spent_its_budget_is_dropped_unread_but_a_node_s_own_address_is_heard(
        server: HeartbeatServer, agent: socket.socket) -> None:
    from raps_slurm.coordinator.heartbeats import SourceBudget

    server.budget = SourceBudget(rate=1.0, burst=10.0)
    # n1's agent is heard from this address first: its address is n1's home
    agent.sendto(encode(Heartbeat("n1", 1, 1, time.time()), nk("n1")), server.address)
    assert isinstance(decode(agent.recv(512), nk("n1")), Ack)
    flood = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for i in range(200):  # wrongly signed, from n1's address (two ports)
            agent.sendto(encode(Heartbeat("n9", 1, i + 1, time.time()), OTHER), server.address)
            flood.sendto(encode(Heartbeat("n9", 1, i + 1, time.time()), OTHER),
                         ("127.0.0.1", server.address[1]))
        wait_for(lambda: server.rejected["signature"] + server.rejected["rate"] == 400)
        assert server.rejected["rate"] >= 350, server.rejected
        # n1's address spent its budget, and n1's own heartbeats are still heard
        agent.sendto(encode(Heartbeat("n1", 1, 2, time.time()), nk("n1")), server.address)
        assert isinstance(decode(agent.recv(512), nk("n1")), Ack)
    finally:
        flood.close()


def test_source_budget_refills_and_bounds_its_table() -> None:
    from raps_slurm.coordinator.heartbeats import SourceBudget

    b = SourceBudget(rate=2.0, burst=3.0, max_sources=2)
    for _ in range(3):
        assert not b.exhausted("a", 0.0)
        b.charge("a", 0.0)
    assert b.exhausted("a", 0.0) and b.exhausted("a", 0.4)
    assert not b.exhausted("a", 0.5)  # one token back after 1/rate s
    b.charge("b", 0.0)
    for i in range(100):  # spoofed addresses share one bucket beyond the table
        b.charge(f"s{i}", 0.0)
    assert b.exhausted("s7", 0.0) and len(b._buckets) <= 3
