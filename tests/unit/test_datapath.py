"""raps_slurm.wire.datapath on real sockets, compiled and fallback: a frame written from
the application's buffer while it is copied into the log."""

from __future__ import annotations

import errno
import os
import select
import socket
import threading

import crc32c
import pytest

from raps_slurm.wire import datapath, framing


@pytest.fixture(params=["compiled", "nofold", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The compiled path (its copy taking the CRC where the CPU can), the compiled path
    summing apart, and the fallback."""
    monkeypatch.setenv(datapath.ENV, request.param)
    monkeypatch.setattr(datapath, "mode", request.param)  # read at import
    if request.param != "python" and not datapath.compiled():
        pytest.fail("raps_slurm.wire._datapath is not built (pip install -e .)")
    assert datapath.compiled() == (request.param != "python")
    assert not datapath.folds() or request.param == "compiled"
    return str(request.param)


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    for s in (a, b):  # small buffers: the sender meets a full socket many times
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    return a, b


def _read_all(sock: socket.socket, out: bytearray) -> None:
    while chunk := sock.recv(1 << 20):
        out += chunk


def test_a_frame_sent_while_copied_arrives_whole_and_the_log_holds_it(path: str) -> None:
    parts = [b"envelope", os.urandom(3 << 20), memoryview(bytearray(os.urandom(70001)))]
    body = b"".join(bytes(p) for p in parts)
    log = memoryview(bytearray(len(body)))
    tx, rx = _pair()
    got = bytearray()
    reader = threading.Thread(target=_read_all, args=(rx, got))
    reader.start()
    fulls: list[int] = []

    def on_full(sock: socket.socket) -> None:
        fulls.append(1)
        select.select([], [sock], [], 5.0)

    crc = datapath.send_frame(tx, b"HEAD", parts, log, max_size=8 << 20, on_full=on_full)
    tx.close()
    reader.join(30)
    assert bytes(got) == framing.HEADER.pack(4 + len(body)) + b"HEAD" + body
    assert bytes(log) == body
    assert fulls, "the socket was never full: the test's buffers are too large"
    # the parts' checksum: taken by the copy, or in steps while the socket was full and
    # the rest once the frame was out
    assert crc == crc32c.crc32c(body)


def test_the_log_is_whole_when_the_peer_is_gone(path: str) -> None:
    parts = [os.urandom(2 << 20)]
    log = memoryview(bytearray(2 << 20))
    tx, rx = _pair()
    rx.close()
    with pytest.raises(framing.FrameError) as err:
        datapath.send_frame(tx, b"H", parts, log, max_size=8 << 20,
                               on_full=lambda s: None)
    assert err.value.kind == "closed"
    assert bytes(log) == parts[0]
    tx.close()


def test_a_full_socket_returns_eagain_with_everything_copied(path: str) -> None:
    parts = [os.urandom(1 << 20)]
    log = memoryview(bytearray(1 << 20))
    tx, rx = _pair()
    sent, copied, err, crc = datapath.send_copy(tx, b"x" * 10, parts, log, piece=4096)
    assert err == errno.EAGAIN and copied == 1 << 20 and 0 < sent < 10 + (1 << 20)
    assert bytes(log) == parts[0]
    assert crc == (crc32c.crc32c(parts[0]) if datapath.folds() else None)
    tx.close()
    rx.close()


def test_offsets_out_of_range_are_refused(path: str) -> None:
    tx, rx = _pair()
    with pytest.raises(ValueError, match="sent"):
        datapath.send_copy(tx, b"h", [b"abc"], memoryview(bytearray(2)))
    with pytest.raises(ValueError, match="sent"):
        datapath.send_copy(tx, b"h", [b"abc"], memoryview(bytearray(3)), sent=5)
    with pytest.raises(ValueError):
        datapath.copy(memoryview(bytearray(4)), [b"abc"])
    tx.close()
    rx.close()


def test_an_oversized_frame_is_refused_before_a_byte_is_sent(path: str) -> None:
    tx, rx = _pair()
    log = memoryview(bytearray(100))
    with pytest.raises(framing.FrameError) as err:
        datapath.send_frame(tx, b"H", [b"y" * 100], log, max_size=50)
    assert err.value.kind == "oversized" and bytes(log) == b"y" * 100
    rx.setblocking(False)
    with pytest.raises(BlockingIOError):
        rx.recv(10)
    tx.close()
    rx.close()


def test_a_send_copy_continued_from_a_checksum_sums_the_rest_only(path: str) -> None:
    parts = [b"env", os.urandom(300_000)]
    body = b"".join(parts)
    log = memoryview(bytearray(len(body)))
    log[:5000] = body[:5000]
    tx, rx = _pair()
    sent, copied, err, crc = datapath.send_copy(tx, b"h", parts, log, sent=len(body) + 1,
                                                copied=5000, crc=crc32c.crc32c(body[:5000]))
    assert (sent, copied, err) == (len(body) + 1, len(body), 0) and bytes(log) == body
    assert crc == (crc32c.crc32c(body) if datapath.folds() else None)
    tx.close()
    rx.close()


def test_copies_around_the_streaming_size_are_exact(path: str) -> None:
    """Copies of 256 KiB or more bypass the cache on the compiled path (x86-64 with
    AVX2), and where the CPU has AVX-512 and VPCLMULQDQ the copy takes the CRC-32C in
    the same pass (folded 256 bytes at a time, the last 64 summed by the CRC instruction):
    every byte lands and the sum is the crc32c package's, whatever the alignment of
    either end, the size's tail or where a part ends."""
    streaming = getattr(datapath._compiled, "STREAMING", 0) if path == "compiled" else 0
    assert path == "python" or streaming in (0, 1)
    for size in (0, 1, 511, 512, 575, 576, 767, 768, 100_003, (256 << 10) - 1, 256 << 10,
                 (256 << 10) + 127, (3 << 20) + 1):
        src = memoryview(bytearray(os.urandom(size + 64)))
        for skew in (0, 1, 31, 45):
            parts = [b"envelope!", src[skew:skew + size]]
            room = memoryview(bytearray(size + 9 + 64))
            for at in (0, 7, 32):
                dst = room[at:at + size + 9]
                body = b"envelope!" + bytes(src[skew:skew + size])
                crc = datapath.copy(dst, parts)
                assert bytes(dst) == body
                assert crc == (crc32c.crc32c(body) if datapath.folds() else None)


def test_a_checksum_is_the_packages_folded_or_not(path: str) -> None:
    """Large checksums are folded where the CPU can (the log's and the replay's checks
    of immutable and resent bodies), small ones and the fallback use the crc32c package."""
    data = os.urandom((1 << 20) + 77)
    for n in (0, 100, datapath.FOLD_AT - 1, datapath.FOLD_AT, 300_001, len(data)):
        for skew in (0, 5):
            view = memoryview(data)[skew:skew + n]
            assert datapath.checksum(view) == crc32c.crc32c(view)
            assert datapath.checksum(bytes(view), 99) == crc32c.crc32c(view, 99)
