"""The one framing module: lengths, caps, deadlines per frame, MACs with sequence numbers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from raps_slurm.framing import (
    HEADER,
    TAG_SIZE,
    FrameError,
    FrameMac,
    encode,
    read_frame,
    send_frame,
)

KEY = b"k" * 32


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_frames_round_trip_in_order(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    for body in (b"x", b'{"op":"start"}', bytes(range(256)) * 100):
        send_frame(a, body)
    got = [read_frame(b, frame_timeout=1.0, idle_timeout=1.0) for _ in range(3)]
    assert got == [b"x", b'{"op":"start"}', bytes(range(256)) * 100]


def test_an_oversized_frame_is_refused_from_its_header(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(HEADER.pack(5000))  # no body follows: refused before waiting for it
    with pytest.raises(FrameError) as err:
        read_frame(b, frame_timeout=5.0, max_size=4096)
    assert err.value.kind == "oversized" and "5000" in str(err.value)
    with pytest.raises(FrameError) as err:
        encode(b"y" * 4097, max_size=4096)
    assert err.value.kind == "oversized"


def test_empty_and_truncated_frames(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(HEADER.pack(0))
    with pytest.raises(FrameError) as err:
        read_frame(b, frame_timeout=1.0)
    assert err.value.kind == "empty"
    with pytest.raises(FrameError):
        encode(b"")
    c, d = socket.socketpair()
    try:
        c.sendall(HEADER.pack(10) + b"12345")
        c.close()
        with pytest.raises(FrameError) as err:
            read_frame(d, frame_timeout=1.0)
        assert err.value.kind == "truncated" and "5 of 10" in str(err.value)
    finally:
        d.close()


def test_a_clean_close_between_frames_is_closed_not_truncated(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.close()
    with pytest.raises(FrameError) as err:
        read_frame(b, frame_timeout=1.0)
    assert err.value.kind == "closed"


def test_a_slow_loris_runs_out_of_its_frame_deadline(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    data = encode(b"z" * 40)
    stop = threading.Event()

    def trickle() -> None:  # each byte well within any per-recv timeout
        for byte in data:
            if stop.is_set():
                return
            a.sendall(bytes([byte]))
            time.sleep(0.02)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        start = time.monotonic()
        with pytest.raises(FrameError) as err:
            read_frame(b, frame_timeout=0.3, idle_timeout=1.0)
        took = time.monotonic() - start
        assert err.value.kind == "timeout"
        assert took < 0.6, took  # the deadline of the whole frame, not of each recv
    finally:
        stop.set()
        t.join()


def test_idle_timeout_only_when_asked(pair: tuple[socket.socket, socket.socket]) -> None:
    _, b = pair
    with pytest.raises(FrameError) as err:
        read_frame(b, frame_timeout=1.0, idle_timeout=0.05)
    assert err.value.kind == "timeout" and "0 of 1" in str(err.value)


def test_mac_frames_check_key_sequence_and_content(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    tx, rx = FrameMac(KEY), FrameMac(KEY)
    first, second = encode(b"one", mac=tx), encode(b"two", mac=tx)
    assert len(first) == HEADER.size + 3 + TAG_SIZE
    a.sendall(first + second)
    assert read_frame(b, frame_timeout=1.0, mac=rx) == b"one"
    assert read_frame(b, frame_timeout=1.0, mac=rx) == b"two"
    # replayed: the tag of sequence number 0 again, where 2 is expected
    a.sendall(first)
    with pytest.raises(FrameError) as err:
        read_frame(b, frame_timeout=1.0, mac=rx)
    assert err.value.kind == "mac"


def test_reordered_forged_and_wrong_key_frames_fail() -> None:
    tx = FrameMac(KEY)
    one, two = tx.seal(b"one"), tx.seal(b"two")
    with pytest.raises(FrameError, match="bad MAC"):
        FrameMac(KEY).open(two)  # reordered: two before one
    rx = FrameMac(KEY)
    forged = bytearray(one)
    forged[0] ^= 1
    with pytest.raises(FrameError, match="bad MAC"):
        rx.open(bytes(forged))
    with pytest.raises(FrameError, match="bad MAC"):
        FrameMac(b"o" * 32).open(one)
    with pytest.raises(FrameError, match="shorter than its MAC"):
        FrameMac(KEY).open(b"short")
    assert rx.open(one) == b"one"  # a failed check does not advance the count
    with pytest.raises(ValueError, match="at least 16"):
        FrameMac(b"short")


def test_send_times_out_when_the_peer_reads_nothing(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    with pytest.raises(FrameError) as err:
        for _ in range(10_000):  # fills both socket buffers, then times out
            send_frame(a, b"q" * 65536, timeout=0.05)
    assert err.value.kind == "timeout"
