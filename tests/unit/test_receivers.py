"""Heartbeat receiver processes on the coordinator's port (coordinator/receivers.py), on
real loopback sockets: spread by the kernel, acked only while the coordinator leads,
every replay stopped by the coordinator's own guard, a dead receiver replaced."""

from __future__ import annotations

import gc
import os
import selectors
import signal
import socket
import time
from collections.abc import Iterator

import pytest

from raps_slurm.coordinator import receivers
from raps_slurm.coordinator.heartbeats import HeartbeatServer, Received
from raps_slurm.coordinator.receivers import ReceiverPool
from raps_slurm.wire.heartbeat import Ack, Heartbeat, claimed_node, decode, encode, node_key

KEY = b"k" * 32  # the cluster key; agents sign with their node keys
SENDERS = 24  # source ports: the kernel hashes them over the receivers


def nk(node: str) -> bytes:
    return node_key(KEY, node)


@pytest.fixture
def pool() -> Iterator[ReceiverPool]:
    server = HeartbeatServer(("127.0.0.1", 0), KEY, max_skew=5.0, leader_revision=lambda: 7,
                             reuse_port=True)
    server.start()
    p = ReceiverPool(server, 3, KEY, None, 5.0)
    p.start()
    p.publish(7, time.monotonic() + 60)
    try:
        yield p
    finally:
        p.stop()
        server.stop()


@pytest.fixture
def senders() -> Iterator[list[socket.socket]]:
    socks = []
    for _ in range(SENDERS):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.settimeout(0.2)
        socks.append(s)
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


QUIET = 0.2  # seconds without a datagram on any sender: every ack has come


def _acks(socks: list[socket.socket], source: tuple[str, int]) -> list[list[Ack]]:
    """The acks each of ``socks`` received from ``source`` (the pool's address), read from
    all of them at once until none received anything for QUIET seconds (one socket after
    the other, that wait was paid once per socket). A datagram from another address is
    not this pool's: an agent of an earlier test's cluster, still shutting down, sent a
    heartbeat to the ephemeral port a sender had got again (seen in CI)."""
    out: list[list[Ack]] = [[] for _ in socks]
    with selectors.DefaultSelector() as sel:
        for i, sock in enumerate(socks):
            sel.register(sock, selectors.EVENT_READ, i)
        while ready := sel.select(QUIET):
            for key, _ in ready:
                data, sender = socks[key.data].recvfrom(512)
                if sender != source:
                    continue
                msg = decode(data, nk(claimed_node(data)))
                assert isinstance(msg, Ack)
                out[key.data].append(msg)
    return out


def _drain_until(pool: ReceiverPool, count: int, timeout: float = 10.0) -> list[Received]:
    got: list[Received] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} heartbeats after {timeout}s"
        got += [r for r in pool.server.drain() if isinstance(r, Received)]
        time.sleep(0.02)
    return got


def _refused_nothing_queued(pool: ReceiverPool, reason: str, count: int) -> None:
    """Wait until ``count`` datagrams were refused as ``reason``, none reaching the
    detector meanwhile."""
    deadline = time.monotonic() + 10
    while pool.server.rejected[reason] < count:
        assert time.monotonic() < deadline, pool.server.rejected
        assert pool.server.drain() == []
        time.sleep(0.02)


def test_every_receiver_acks_and_forwards(pool: ReceiverPool,
                                          senders: list[socket.socket]) -> None:
    now = time.time()
    for i, s in enumerate(senders):
        s.sendto(encode(Heartbeat(f"n{i}", 1, 1, now), nk(f"n{i}")), pool.server.address)
    got = _drain_until(pool, SENDERS)
    assert sorted(r.node for r in got) == sorted(f"n{i}" for i in range(SENDERS))
    assert all(r.acked for r in got)
    for i, acks in enumerate(_acks(senders, pool.server.address)):
        assert [(a.node, a.counter, a.leader_revision) for a in acks] == [(f"n{i}", 1, 7)]
    # Some went through the receiver processes, and drain() had them all: the acks and
    # the detector's view agree.
    assert 0 < pool.forwarded < SENDERS, pool.forwarded
    assert pool.server.accepted == SENDERS


def test_a_replay_from_other_ports_never_reaches_the_detector(
        pool: ReceiverPool, senders: list[socket.socket]) -> None:
    datagram = encode(Heartbeat("n1", 1, 1, time.time()), nk("n1"))
    senders[0].sendto(datagram, pool.server.address)
    assert [r.node for r in _drain_until(pool, 1)] == ["n1"]
    for s in senders[1:]:  # the same bytes from every other port: every receiver sees some
        s.sendto(datagram, pool.server.address)
    deadline = time.monotonic() + 10
    while pool.server.rejected["replay"] < SENDERS - 1:
        assert time.monotonic() < deadline, pool.server.rejected
        assert pool.server.drain() == []
        time.sleep(0.02)
    assert pool.server.drain() == [] and pool.server.accepted == 1
    assert pool.forwarded > 0  # a receiver that had not seen n1 took it: the guard here did not


def test_no_ack_unless_the_published_leadership_holds(pool: ReceiverPool,
                                                      senders: list[socket.socket]) -> None:
    pool.publish(7, time.monotonic() - 1)  # the lease may have run out
    pool.server._leader_revision = lambda: 0  # and the coordinator's own thread agrees
    now = time.time()
    for i, s in enumerate(senders):
        s.sendto(encode(Heartbeat(f"n{i}", 1, 1, now), nk(f"n{i}")), pool.server.address)
    got = _drain_until(pool, SENDERS)
    assert not any(r.acked for r in got)
    assert _acks(senders, pool.server.address) == [[] for _ in senders]
    assert pool.forwarded > 0


def test_a_receiver_that_dies_is_replaced(pool: ReceiverPool, senders: list[socket.socket],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(receivers, "RESTART_AFTER_SEC", 0.0)
    victim = pool._procs[0]
    assert victim is not None and victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(5)
    deadline = time.monotonic() + 10
    while pool._procs[0] is victim:
        assert time.monotonic() < deadline, "not restarted"
        pool.collect()
        time.sleep(0.05)
    # Heartbeats from every port are still acked and delivered (the kernel rehashed them
    # while it was down; the new one takes its share again).
    now = time.time()
    for i, s in enumerate(senders):
        s.sendto(encode(Heartbeat(f"n{i}", 1, 2, now), nk(f"n{i}")), pool.server.address)
    got = _drain_until(pool, SENDERS)
    assert sorted(r.node for r in got) == sorted(f"n{i}" for i in range(SENDERS))
    assert [len(acks) for acks in _acks(senders, pool.server.address)] == [1] * len(senders)



def test_a_forget_reaches_every_receiver(pool: ReceiverPool,
                                         senders: list[socket.socket]) -> None:
    """An agent restarted after its clock stepped back (a smaller incarnation): once the
    coordinator forgets the node, every receiver process accepts it again (a receiver
    reads the forgets before each batch it handles)."""
    big, small = time.time_ns(), time.time_ns() - 3600 * 10**9
    for i, s in enumerate(senders):  # n1 from every port: every receiver learns ``big``
        s.sendto(encode(Heartbeat("n1", big, i + 1, time.time()), nk("n1")),
                 pool.server.address)
        assert [r.counter for r in _drain_until(pool, 1)] == [i + 1]
    for s in senders:
        s.sendto(encode(Heartbeat("n1", small, 1, time.time()), nk("n1")),
                 pool.server.address)
    _refused_nothing_queued(pool, "replay", SENDERS)
    assert pool.forwarded > 0
    pool.server.forget("n1")
    for i, s in enumerate(senders):
        s.sendto(encode(Heartbeat("n1", small, i + 2, time.time()), nk("n1")),
                 pool.server.address)
        got = _drain_until(pool, 1)
        assert [(r.incarnation, r.counter) for r in got] == [(small, i + 2)]


def test_receiver_pipes_above_descriptor_1023_are_read_without_spinning(
        senders: list[socket.socket]) -> None:
    """A busy leader's new pipes may get descriptors above select()'s limit of 1023: the
    reading thread must still wait on them, not fail and retry at once."""
    # Every descriptor up to 1100 taken, and no garbage collected meanwhile: an earlier
    # test's unreachable socket closed by the collector would free a low one for the pipes.
    gc.collect()
    gc.disable()
    filler = [os.open(os.devnull, os.O_RDONLY)]
    while filler[-1] < 1100:
        filler.append(os.open(os.devnull, os.O_RDONLY))
    server = HeartbeatServer(("127.0.0.1", 0), KEY, max_skew=5.0, leader_revision=lambda: 7,
                             reuse_port=True)
    server.start()
    p = ReceiverPool(server, 2, KEY, None, 5.0)
    try:
        try:
            p.start()
        finally:
            gc.enable()
        p.publish(7, time.monotonic() + 60)
        assert max(c.fileno() for c in p._conns if c is not None) > 1023
        cpu0, t0 = time.process_time(), time.monotonic()
        time.sleep(1.0)  # idle: the reading thread waits in poll(2)
        used = time.process_time() - cpu0
        assert used < 0.5 * (time.monotonic() - t0), f"{used:.2f}s of CPU while idle"
        now = time.time()
        for i, s in enumerate(senders):
            s.sendto(encode(Heartbeat(f"n{i}", 1, 1, now), nk(f"n{i}")), server.address)
        deadline = time.monotonic() + 10
        while p.forwarded == 0:  # the reading thread, not collect(), brought them in
            assert time.monotonic() < deadline, "nothing forwarded"
            time.sleep(0.02)
    finally:
        p.stop()
        server.stop()
        for fd in filler:
            os.close(fd)


def test_the_cluster_s_node_names_reach_every_receiver(pool: ReceiverPool,
                                                       senders: list[socket.socket]) -> None:
    """A name outside the cluster is refused by whichever receiver the kernel picks, once
    the coordinator learnt the names; a member's heartbeats pass every receiver."""
    pool.server.set_members(["n1", "n2"])
    for i, s in enumerate(senders):
        s.sendto(encode(Heartbeat("stranger", 1, i + 1, time.time()), nk("stranger")),
                 pool.server.address)
    _refused_nothing_queued(pool, "member", SENDERS)
    for i, s in enumerate(senders):
        s.sendto(encode(Heartbeat("n2", 1, i + 1, time.time()), nk("n2")), pool.server.address)
        assert [r.node for r in _drain_until(pool, 1)] == ["n2"]
    assert pool.server.rejected["signature"] == 0


def test_each_receiver_keeps_the_coordinators_budget_per_source(
        senders: list[socket.socket]) -> None:
    """coordinator.heartbeat_source_rate and _burst reach every receiver process: one
    address's refused datagrams cost each socket at most the burst, then are dropped
    unread (``rate``), whichever receiver the kernel hashed each source port to."""
    burst = 5
    server = HeartbeatServer(("127.0.0.1", 0), KEY, max_skew=5.0, leader_revision=lambda: 7,
                             reuse_port=True, source_rate=0.01, source_burst=burst)
    server.start()
    p = ReceiverPool(server, 3, KEY, None, 5.0)
    p.start()
    try:
        sent = 0
        for s in senders:  # wrongly signed, from one address, over every receiver
            for i in range(10):
                s.sendto(encode(Heartbeat("n1", 1, i + 1, time.time()), b"o" * 32),
                         server.address)
                sent += 1
        deadline = time.monotonic() + 10
        while server.rejected["signature"] + server.rejected["rate"] < sent:
            assert time.monotonic() < deadline, (sent, server.rejected)
            server.drain()
            time.sleep(0.02)
        # three sockets (the coordinator's and two receivers'), each its own budget
        assert server.rejected["signature"] <= 3 * burst + 1, server.rejected
        assert server.rejected["rate"] >= sent - 3 * burst - 1, server.rejected
    finally:
        p.stop()
        server.stop()
