"""raps_slurm.wire._udp (C: batched recvmmsg/sendmmsg, HMAC-SHA256 tags) on real loopback
sockets, and against the reference codec (the Python side of the fast path,
parse_heartbeat and ack_body, is tested in test_heartbeat.py)."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raps_slurm.errors import BadDatagram
from raps_slurm.wire import _udp
from raps_slurm.wire.heartbeat import (
    FRAME,
    TAG_BYTES,
    Heartbeat,
    body,
    decode,
    decode_checked,
    encode,
)

KEY = bytes(range(64))
OTHER = bytes(range(1, 65))


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    a.bind(("127.0.0.1", 0))
    b.bind(("127.0.0.1", 0))
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@given(key=st.binary(min_size=1, max_size=200), data=st.binary(max_size=600))
def test_tag_is_hmac_sha256(key: bytes, data: bytes) -> None:
    assert _udp.tag(key, data) == hmac.new(key, data, hashlib.sha256).digest()


def test_recv_batch_says_which_key_signed_each_datagram(
        pair: tuple[socket.socket, socket.socket]) -> None:
    rx, tx = pair
    good = encode(Heartbeat("n1", 1, 1, 5.0), KEY)
    rolled = encode(Heartbeat("n1", 1, 2, 5.0), OTHER)
    forged = good[:-1] + bytes((good[-1] ^ 1,))
    short = b"RPS\x01" + b"x" * 10
    long = b"RPS\x01" + b"x" * 2000
    unprefixed = b"XYZ\x01" + good[4:]
    sent = [good, rolled, forged, short, long, unprefixed, b""]
    for d in sent:
        tx.sendto(d, rx.getsockname())
    got = _udp.recv_batch(rx.fileno(), (KEY, OTHER), *FRAME, True)
    while len(got) < len(sent):
        got += _udp.recv_batch(rx.fileno(), (KEY, OTHER), *FRAME, True)
    assert [s for _, _, s in got] == [0, 1, -1, -2, -2, -2, -2]
    assert [d for d, _, _ in got][:4] == sent[:4]
    assert len(got[4][0]) == 1024  # read no further than anything accepted could be
    assert {a for _, a, _ in got} == {tx.getsockname()}
    # Each then classifies as decode would.
    for data, _, signed in got:
        try:
            ref: object = decode(data, KEY, OTHER)
        except BadDatagram as exc:
            ref = exc.reason
        try:
            fast: object = decode_checked(data, signed)
        except BadDatagram as exc:
            fast = exc.reason
        assert fast == ref
    assert _udp.recv_batch(rx.fileno(), (KEY,), *FRAME, False) == []  # nothing pending


def test_sign_send_signs_and_sends_more_than_one_batch(
        pair: tuple[socket.socket, socket.socket]) -> None:
    rx, tx = pair
    n = 3 * _udp.MAX_BATCH + 5
    items = [(body(Heartbeat("n1", 1, i, 5.0)), rx.getsockname()) for i in range(n)]
    assert _udp.sign_send(tx.fileno(), KEY, items) == 0
    got: list[tuple[bytes, tuple[str, int], int]] = []
    while len(got) < n:
        got += _udp.recv_batch(rx.fileno(), (KEY,), *FRAME, True)
    assert [decode(d, KEY) for d, _, _ in got] == [Heartbeat("n1", 1, i, 5.0) for i in range(n)]


def test_per_item_keys_and_an_unchecked_receive(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """Acks are signed with each node's key (its HMAC state); the coordinator receives
    unchecked (keys ()) and verifies with the key of the node each datagram names."""
    rx, tx = pair
    items = [(body(Heartbeat(f"n{i % 3}", 1, i, 5.0)), rx.getsockname(),
              _udp.hmac_state(KEY if i % 3 else OTHER)) for i in range(7)]
    assert _udp.sign_send(tx.fileno(), None, items) == 0
    got: list[tuple[bytes, tuple[str, int], int]] = []
    while len(got) < len(items):
        got += _udp.recv_batch(rx.fileno(), (), *FRAME, True)
    assert {s for _, _, s in got} == {-2}  # nothing checked
    for i, (d, _, _) in enumerate(got):
        assert _udp.verify(_udp.hmac_state(KEY if i % 3 else OTHER), d)
        assert not _udp.verify(_udp.hmac_state(OTHER if i % 3 else KEY), d)
    assert not _udp.verify(_udp.hmac_state(KEY), b"short")
    with pytest.raises(ValueError, match="HMAC state"):
        _udp.verify(KEY, got[0][0])
    assert [decode(d, KEY if i % 3 else OTHER) for i, (d, _, _) in enumerate(got)] == [
        Heartbeat(f"n{i % 3}", 1, i, 5.0) for i in range(7)]


def test_sign_send_counts_what_the_kernel_refused(
        pair: tuple[socket.socket, socket.socket]) -> None:
    rx, tx = pair
    tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    port = rx.getsockname()[1]
    # A datagram to a port nobody listens on is sent (UDP); one to an address of the other
    # family cannot be: counted, and the rest still go out.
    items = [(b"a" * 10, ("127.0.0.1", port)), (b"b" * 10, ("::1", port)),
             (b"c" * 10, ("127.0.0.1", port))]
    assert _udp.sign_send(tx.fileno(), KEY, items) == 1
    got = _udp.recv_batch(rx.fileno(), (KEY,), b"", TAG_BYTES, 1024, True)
    while len(got) < 2:
        got += _udp.recv_batch(rx.fileno(), (KEY,), b"", TAG_BYTES, 1024, True)
    assert [(d[:10], s) for d, _, s in got] == [(b"a" * 10, 0), (b"c" * 10, 0)]


@pytest.mark.parametrize(("items", "message"), [
    ([(b"x", ("node1", 1))], "not a numeric IPv4 or IPv6 address"),
    ([(b"x", ("127.0.0.1", 70000))], r"port 70000 outside 0\.\.65535"),
    ([(b"x" * 1000, ("127.0.0.1", 1))], "body of 1000 bytes > 992"),
])
def test_sign_send_refuses_what_it_cannot_send(pair: tuple[socket.socket, socket.socket],
                                               items: list[tuple[bytes, tuple[str, int]]],
                                               message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _udp.sign_send(pair[1].fileno(), KEY, items)


def test_bad_arguments_are_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    fd = pair[0].fileno()
    with pytest.raises(ValueError, match=r"need 0\.\.2 keys"):
        _udp.recv_batch(fd, (KEY, KEY, KEY), *FRAME, False)
    with pytest.raises(ValueError, match="empty HMAC key"):
        _udp.recv_batch(fd, (b"",), *FRAME, False)
    with pytest.raises(ValueError, match="min_size"):
        _udp.recv_batch(fd, (KEY,), b"RPS", 8, 2048, False)
    with pytest.raises(OSError):
        _udp.recv_batch(-1, (KEY,), *FRAME, False)
    with pytest.raises(TypeError, match="tuples"):
        _udp.sign_send(fd, KEY, [[b"x", ("127.0.0.1", 1)]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="needs a key"):
        _udp.sign_send(fd, None, [(b"x", ("127.0.0.1", 1))])
    assert struct.calcsize(">5sQQdBB") == 31  # the layout parse_heartbeat reads at once
