"""The one framing module: lengths, caps, deadlines per frame, MACs with sequence numbers;
FrameReader.poll: whole frames only, never waiting."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from raps_slurm.wire.framing import (
    HEADER,
    STREAM_AT,
    STREAM_PIECE,
    TAG_SIZE,
    FrameError,
    FrameMac,
    FrameReader,
    encode,
    read_frame,
    send_frame,
    send_parts,
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


# --- FrameReader.poll ---------------------------------------------------------------


def _reader(sock: socket.socket, **kw: object) -> FrameReader:
    r = FrameReader(sock, **kw)  # type: ignore[arg-type]
    r.nonblocking()
    return r


def test_small_frames_come_whole_and_in_order(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r = _reader(b, buffer_size=64)
    assert r.poll() is None  # nothing yet, and no wait
    for body in (b"one", b"two", b"x" * 50):
        send_parts(a, [body])
    got = []
    while (body := r.poll()) is not None:
        got.append(bytes(body))
        assert not r.owned
    assert got == [b"one", b"two", b"x" * 50]
    assert not r.pending()


def test_a_frame_sent_in_pieces_comes_once_whole(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r = _reader(b, buffer_size=64)
    wire = HEADER.pack(10) + b"0123456789"
    for i in range(len(wire) - 1):
        a.send(wire[i:i + 1])
        assert r.poll() is None, f"a frame after {i + 1} of {len(wire)} bytes"
    a.send(wire[-1:])
    assert bytes(r.poll() or b"") == b"0123456789"


def test_a_frame_larger_than_the_buffer_gets_its_own(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r = _reader(b, buffer_size=64, max_size=1 << 20)
    body = bytes(range(256)) * 40  # 10 KiB
    a.sendall(HEADER.pack(len(body)) + body[:3000])
    assert r.poll() is None
    a.sendall(body[3000:] + HEADER.pack(2) + b"ok")
    got = r.poll()
    assert got is not None and r.owned and bytes(got) == body
    assert bytes(r.poll() or b"") == b"ok" and not r.owned


def test_a_frame_that_fills_the_buffer_exactly_is_read(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r = _reader(b, buffer_size=64)
    for n in (60, 61, 64):  # 60 + header fits the buffer; 61 and 64 do not
        a.sendall(HEADER.pack(n) + b"z" * n)
        assert bytes(r.poll() or b"") == b"z" * n


def test_caps_and_ends_as_read(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r = _reader(b, max_size=100)
    a.sendall(HEADER.pack(101))
    with pytest.raises(FrameError) as e:
        r.poll()
    assert e.value.kind == "oversized"
    c, d = socket.socketpair()
    r = _reader(d)
    c.sendall(HEADER.pack(0))
    with pytest.raises(FrameError) as e:
        r.poll()
    assert e.value.kind == "empty"
    c.close()
    d.close()
    c, d = socket.socketpair()
    r = _reader(d)
    c.close()
    with pytest.raises(FrameError) as e:
        r.poll()
    assert e.value.kind == "closed"
    d.close()
    c, d = socket.socketpair()
    r = _reader(d)
    c.sendall(HEADER.pack(10) + b"abc")
    c.close()
    with pytest.raises(FrameError) as e:
        r.poll()
    assert e.value.kind == "truncated"
    d.close()


def test_a_stalled_frame_runs_out_of_its_deadline(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r = _reader(b, frame_timeout=0.2, min_rate=1e6)
    a.sendall(HEADER.pack(1000) + b"x" * 10)
    assert r.poll() is None
    assert not r.overdue(time.monotonic())
    time.sleep(0.25)
    assert r.overdue(time.monotonic())
    with pytest.raises(FrameError) as e:
        r.poll()
    assert e.value.kind == "timeout"


def test_macs_are_checked_in_order(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r = _reader(b)
    r.mac = FrameMac(KEY, "blake3", b"c")
    tx = FrameMac(KEY, "blake3", b"c")
    send_parts(a, [b"first"], mac=tx)
    send_parts(a, [b"second"], mac=tx)
    assert bytes(r.poll() or b"") == b"first"
    assert bytes(r.poll() or b"") == b"second"
    send_parts(a, [b"forged"], mac=FrameMac(b"f" * 32, "blake3", b"c"))
    with pytest.raises(FrameError) as e:
        r.poll()
    assert e.value.kind == "mac"


def _wire(body: bytes, tx: FrameMac) -> bytes:
    """The bytes ``send_parts`` puts on the wire for ``body`` as one MAC'd frame."""
    c, d = socket.socketpair()
    try:
        t = threading.Thread(target=send_parts, args=(c, [body[:1000], body[1000:]]),
                             kwargs={"mac": tx, "max_size": 8 << 20})
        t.start()
        want = HEADER.size + len(body) + TAG_SIZE
        raw = bytearray()
        while len(raw) < want:
            got = d.recv(want - len(raw))
            assert got, f"the sender closed after {len(raw)} of {want} bytes"
            raw += got
        t.join()
        return bytes(raw)
    finally:
        c.close()
        d.close()


def _streamed(a: socket.socket, r: FrameReader, body: bytes, tx: FrameMac) -> bytes:
    """``body``'s frame fed to ``r`` in 128 KiB pieces, polling after each: before the
    last piece poll returns nothing yet the MAC has taken the bytes come so far."""
    raw = _wire(body, tx)
    step = 128 << 10
    got = None
    for at in range(0, len(raw), step):
        assert got is None, f"poll returned the frame after {at} of {len(raw)} bytes"
        a.sendall(raw[at:at + step])
        got = r.poll()
        if at + step < len(raw) and at > STREAM_PIECE:
            # the MAC was fed as the pieces came, not at the end
            assert 0 < r._hashed <= at + step, (r._hashed, at)
    assert got is not None, "the whole frame was sent but poll returned nothing"
    return bytes(got)


def test_a_large_frame_is_macd_as_it_goes_and_checked_as_it_comes(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r = _reader(b, max_size=8 << 20)
    r.mac = FrameMac(KEY, "blake3", b"c")
    tx = FrameMac(KEY, "blake3", b"c")
    body = bytes(range(256)) * (3 * STREAM_AT // 256 + 7)  # several STREAM_PIECEs
    assert len(body) > STREAM_AT + STREAM_PIECE
    assert _streamed(a, r, body, tx) == body and r.owned
    # the sequence moved on both sides: the next (small) frame checks too
    send_parts(a, [b"after"], mac=tx)
    assert bytes(r.poll() or b"") == b"after"
    assert tx.seq == r.mac.seq == 2
    # and the blocking reader checks a streamed frame the same way
    c, d = socket.socketpair()
    try:
        blocking = FrameReader(d, max_size=8 << 20, mac=FrameMac(KEY, "blake3", b"c"))
        t = threading.Thread(target=send_parts, args=(c, [body]),
                             kwargs={"mac": FrameMac(KEY, "blake3", b"c"), "max_size": 8 << 20})
        t.start()
        assert bytes(blocking.read()) == body
        t.join()
    finally:
        c.close()
        d.close()


def test_a_large_frame_changed_on_the_way_fails_its_mac(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r = _reader(b, max_size=8 << 20)
    r.mac = FrameMac(KEY, "blake3", b"c")
    body = b"m" * (2 * STREAM_AT)
    # The true frame, with one byte in its middle piece changed by someone on the path.
    wire = bytearray(HEADER.pack(len(body) + TAG_SIZE) + body
                     + FrameMac(KEY, "blake3", b"c").tag_parts([body]))
    wire[HEADER.size + STREAM_AT + 12345] ^= 1
    t = threading.Thread(target=a.sendall, args=(bytes(wire),))
    t.start()
    deadline = time.monotonic() + 10
    with pytest.raises(FrameError) as e:
        while r.poll() is None:
            assert time.monotonic() < deadline
    t.join()
    assert e.value.kind == "mac" and r.mac.seq == 0
    # A frame too short for its MAC is refused as soon as its length is known.
    c, d = socket.socketpair()
    try:
        short = _reader(d, buffer_size=16)
        short.mac = FrameMac(KEY, "blake3", b"c")
        c.sendall(HEADER.pack(20) + b"s" * 20)
        with pytest.raises(FrameError) as e:
            short.poll()
        assert e.value.kind == "mac"
    finally:
        c.close()
        d.close()


def test_a_stream_may_tag_only_some_frames_counted_among_themselves(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """``tagged`` (rank traffic under ``frame_mac: control``): frames whose first byte it
    accepts carry a tag, numbered only among themselves; the others carry none, small or
    larger than the buffer; a frame that should be tagged and is not fails."""
    a, b = pair
    r = _reader(b, max_size=8 << 20)
    r.mac, r.tagged = FrameMac(KEY, "blake3", b"c"), lambda first: first != 1
    tx = FrameMac(KEY, "blake3", b"c")
    big = b"\x01" + bytes(range(256)) * (STREAM_AT // 256 + 3)
    send_parts(a, [b"\x02control"], mac=tx)
    send_parts(a, [b"\x01data"])
    got = [bytes(r.poll() or b""), bytes(r.poll() or b"")]
    t = threading.Thread(target=send_parts, args=(a, [big]), kwargs={"max_size": 8 << 20})
    t.start()
    deadline = time.monotonic() + 10
    while (whole := r.poll()) is None:
        assert time.monotonic() < deadline, "the untagged large frame never came whole"
    t.join()
    assert bytes(whole) == big and r.owned
    send_parts(a, [b"\x02again"], mac=tx)  # the second tagged frame: number 1
    got.append(bytes(r.poll() or b""))
    assert got == [b"\x02control", b"\x01data", b"\x02again"]
    assert tx.seq == r.mac.seq == 2
    send_parts(a, [b"\x02no tag at all, but long enough to hold one"])
    with pytest.raises(FrameError) as e:
        r.poll()
    assert e.value.kind == "mac"


def test_small_frames_of_bytes_come_whole_through_a_full_socket(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """A frame of bytes parts goes out in one sendmsg when the socket takes it; when the
    socket is full, or takes part of it, ``on_full`` runs and the rest follows."""
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    fulls = []
    frames = [(b"h" * 12, bytes([i % 256]) * (100 + 37 * i)) for i in range(400)]

    def on_full(sock: socket.socket) -> None:
        fulls.append(1)
        got.extend(_drained(r))  # the reader makes room, as the peer would

    r = _reader(b, max_size=1 << 20)
    got: list[bytes] = []
    for head, body in frames:
        send_parts(a, [head, body], on_full=on_full)
    got.extend(_drained(r))
    assert fulls, "the socket never filled: the test sent too little"
    assert got == [h + p for h, p in frames]
    for nothing in ([b"", b""], []):
        with pytest.raises(FrameError) as e:
            send_parts(a, nothing, on_full=on_full)
        assert e.value.kind == "empty"
    with pytest.raises(FrameError) as e:
        send_parts(a, [b"x" * 10, b"y" * 10], max_size=19, on_full=on_full)
    assert e.value.kind == "oversized"


def _drained(r: FrameReader) -> list[bytes]:
    """Every whole frame the reader's socket holds now."""
    out = []
    while (body := r.poll()) is not None:
        out.append(bytes(body))
    return out


def test_a_full_pool_drops_its_smallest_free_buffer_for_a_new_size() -> None:
    """Its buffers are numpy arrays where numpy is installed: dropping one by value
    compared arrays element-wise, and the ValueError ended every connection that brought
    a large frame once the pool was full (a 4-rank allreduce on a loaded machine)."""
    from raps_slurm.wire.pool import BufferPool

    pool = BufferPool(keep=3)
    held = [pool.get(n << 20) for n in (3, 1, 2)]  # full, every buffer in use
    assert pool.get(5 << 20) is not None and len(pool._bufs) == 3  # none free: not kept
    del held[1]  # the 1 MiB one, second in the pool, is free now: it goes for a 7 MiB one
    seven = pool.get(7 << 20)
    assert sorted(len(b) >> 20 for b in pool._bufs) == [2, 3, 7]
    assert pool.fresh == 5 and len(seven) == 7 << 20


def test_large_frames_land_half_a_page_from_where_the_kernel_reads_them() -> None:
    """A reader's buffer starts at FRAME_AT in its page and a large frame's own buffer at
    BODY_AT: a frame that starts a page of the socket's buffer lands every byte half a
    page from its source (a few bytes past it, the kernel's copy ran at a quarter of its
    speed). The pool hands a buffer out again only once nobody holds a view of it."""
    from raps_slurm.wire.datapath import address as _address
    from raps_slurm.wire.pool import BODY_AT, FRAME_AT, PAGE, BufferPool

    assert (BODY_AT - HEADER.size) % PAGE == FRAME_AT == PAGE // 2
    pool = BufferPool()
    first = pool.get(3 << 20)
    assert len(first) == 3 << 20 and _address(first) % PAGE == BODY_AT
    first[-1] = 7  # writable to its last byte
    held = pool.get(3 << 20)  # the first is held: a new one
    assert (pool.fresh, pool.reused) == (2, 0)
    assert _address(held) % PAGE == BODY_AT
    del first
    again = pool.get(2 << 20)  # the first is free and not twice as large: reused
    assert (pool.fresh, pool.reused) == (2, 1) and _address(again) % PAGE == BODY_AT
    a, b = socket.socketpair()
    with a, b:
        r = FrameReader(b)
        assert _address(r._view) % PAGE == FRAME_AT
        a.sendall(encode(b"x" * 1000))
        assert bytes(r.read()) == b"x" * 1000  # through the placed buffer


def test_a_socket_closed_by_another_thread_is_a_closed_frame_not_an_oserror() -> None:
    """The control server's reader found its channel's socket closed between two reads:
    settimeout raised EBADF, which nothing caught, and the reader thread died without
    counting the supervisor's ranks as lost (a test of the supervisor timed out in CI)."""
    a, b = socket.socketpair()
    a.close()
    with pytest.raises(FrameError) as sent:
        send_frame(a, b"x")
    assert sent.value.kind == "closed"
    with pytest.raises(FrameError) as read:
        read_frame(a, frame_timeout=1.0)
    assert read.value.kind == "closed"
    b.close()
