"""A large message read straight into the waiting receive's buffer: the reader's split,
the inbox's hold on a copy that comes another way, and a rank pair end to end."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.runtime.context import Context, Settings
from raps_slurm.runtime.inbox import Inbox, Placed
from raps_slurm.runtime.msglog import NotDeterministic
from raps_slurm.runtime.ports import LocalPort
from raps_slurm.wire import framing

BODY = bytes(range(256)) * 1024  # 256 KiB: larger than the reader's 64 KiB buffer


def _read(reader: framing.FrameReader, sock: socket.socket, body: bytes
          ) -> memoryview:
    """Send ``body`` as one frame from ``sock`` on a thread; poll ``reader`` until whole."""
    sender = threading.Thread(target=_send, args=(sock, body))
    sender.start()
    deadline = time.monotonic() + 10
    try:
        while (got := reader.poll()) is None:
            assert time.monotonic() < deadline, "the frame did not come whole in 10 s"
            time.sleep(0.001)
        return got
    except BaseException:
        reader.sock.shutdown(socket.SHUT_RDWR)  # the sender waits for room no more
        raise
    finally:
        sender.join(10)


def _send(sock: socket.socket, body: bytes, mac: framing.FrameMac | None = None) -> None:
    with contextlib.suppress(framing.FrameError):  # a reader that refused the frame left
        framing.send_parts(sock, [body], mac=mac)


@pytest.fixture
def pair() -> tuple[socket.socket, framing.FrameReader]:
    a, b = socket.socketpair()
    reader = framing.FrameReader(b, buffer_size=64 << 10)
    reader.nonblocking()
    yield a, reader
    a.close()
    b.close()


def test_a_placed_frame_is_split_between_its_head_and_the_target(pair) -> None:
    sock, reader = pair
    target = bytearray(len(BODY) - 100)
    asked: list[tuple[bytes, int]] = []

    def place(buffered: memoryview, n: int) -> tuple[int, memoryview]:
        asked.append((bytes(buffered[:100]), n))
        return 100, memoryview(target)

    reader.place = place
    head = _read(reader, sock, BODY)
    assert bytes(head) == BODY[:100] and reader.placed is not None
    assert reader.placed.obj is target and bytes(target) == BODY[100:]
    assert asked == [(BODY[:100], len(BODY))]  # asked once, when the frame began
    # declined: the frame comes whole in a buffer of its own, as before
    reader.place = lambda buffered, n: None
    assert bytes(_read(reader, sock, BODY)) == BODY and reader.placed is None


def test_a_place_that_does_not_add_up_ends_the_frame(pair) -> None:
    sock, reader = pair
    reader.place = lambda buffered, n: (10, memoryview(bytearray(n)))  # 10 bytes too many
    with pytest.raises(ValueError, match="place: 10 \\+ 262144 bytes for a frame of 262144"):
        _read(reader, sock, BODY)


def test_a_frame_under_a_mac_is_never_placed(pair) -> None:
    sock, reader = pair
    key = bytes(32)
    reader.mac = framing.FrameMac(key, "blake3", b"c")
    reader.place = lambda buffered, n: pytest.fail("a tagged frame was offered to place")
    sender = threading.Thread(target=_send, args=(sock, BODY,
                                                  framing.FrameMac(key, "blake3", b"c")))
    sender.start()
    deadline = time.monotonic() + 10
    while (got := reader.poll()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    sender.join(10)
    assert bytes(got) == BODY and reader.placed is None


def test_a_copy_from_another_connection_waits_for_the_one_being_placed() -> None:
    inbox = Inbox()
    assert inbox.can_place(0, 1, 1)
    inbox.placing(0, 1, 7)
    assert not inbox.can_place(0, 1, 1)  # one placement at a time
    assert inbox.offer(0, 1, 1, 11, b"resent on a new connection") == ("ok", 0, 0)
    assert inbox.pop(0) is None  # its bytes are going into the receive's buffer
    placed = Placed(b"h", memoryview(bytearray(b"tail")))
    assert inbox.offer(0, 1, 1, 11, placed) == ("ok", 0, 0)
    assert inbox.pop(0) is placed and inbox.placed == 1
    assert not inbox.can_place(0, 1, 1) and not inbox.can_place(0, 3, 1)  # only the next
    # the placing connection ended half way: the copy is delivered instead
    inbox.placing(0, 2, 9)
    assert inbox.offer(0, 2, 1, 12, b"copy") == ("ok", 0, 0)
    assert inbox.pop(0) is None
    inbox.cancel(9)
    assert inbox.pop(0) == b"copy"
    # a copy with another checksum: the sender is not deterministic
    inbox.placing(0, 3, 5)
    assert inbox.offer(0, 3, 1, 13, b"one") == ("ok", 0, 0)
    with pytest.raises(NotDeterministic, match="seq 3 twice with different checksums"):
        inbox.offer(0, 3, 1, 99, Placed(b"h", memoryview(bytearray(b"other"))))


def test_a_waiting_rank_reads_a_large_message_into_its_buffer(tmp_path: Path) -> None:
    settings = Settings(recv_timeout=30.0)
    params = CodecParams(avg_chunk_kb=4)
    size = 1 << 20
    payloads = [bytes([b]) * size for b in (7, 1, 9)]
    target = bytearray(size)
    offered: list[int] = []

    def into(buffered: memoryview, length: int) -> tuple[int, memoryview] | None:
        offered.append(length)
        if bytes(buffered[:1]) == b"\x01":  # the second message: the usual way
            return None
        return 1, memoryview(target)[:length - 1]

    a = Context(LocalPort(tmp_path, "1", 0, 1, params), 0, 2, 1, settings)
    b = Context(LocalPort(tmp_path, "1", 1, 1, params), 1, 2, 1, settings)
    got: list[bytes | memoryview | Placed] = []
    try:
        for i, p in enumerate(payloads):
            t = threading.Thread(target=lambda: got.append(b.recv_buffer(0, into=into)))
            t.start()
            deadline = time.monotonic() + 10
            while not b._into:  # the receive waits, ready to place: now send
                assert time.monotonic() < deadline and t.is_alive(), "recv did not wait"
                time.sleep(0.001)
            a.send_parts(1, [memoryview(bytearray(p))])
            t.join(30)
            assert not t.is_alive()
            if i == 0:
                first = got[0]
                assert isinstance(first, Placed) and first.head == b"\x07"
                assert first.tail.obj is target and bytes(target[:size - 1]) == p[1:]
        assert not isinstance(got[1], Placed) and bytes(got[1]) == payloads[1]
        assert isinstance(got[2], Placed) and bytes(got[2]) == payloads[2]
        assert offered == [size] * 3
        assert b.stats()["messages_read_in_place"] == 2
    finally:
        a.close()
        b.close()


def test_a_rank_waiting_for_several_sources_reads_each_into_its_buffer(tmp_path: Path
                                                                       ) -> None:
    settings = Settings(recv_timeout=30.0)
    params = CodecParams(avg_chunk_kb=4)
    size = 1 << 20
    targets = {0: bytearray(size), 2: bytearray(size)}

    def into(src: int) -> Callable[[memoryview, int], tuple[int, memoryview] | None]:
        return lambda buffered, length: (1, memoryview(targets[src])[:length - 1])

    ranks = [Context(LocalPort(tmp_path, "1", r, 1, params), r, 3, 1, settings)
             for r in range(3)]
    b = ranks[1]
    got: list[tuple[int, bytes | memoryview | Placed]] = []
    try:
        for src in (2, 0):  # the first wait is on both sources: the frame of 2 comes
            t = threading.Thread(target=lambda: got.append(
                b.recv_any_buffer([0, 2], into={0: into(0), 2: into(2)})))
            t.start()
            deadline = time.monotonic() + 10
            while len(b._into) < 2:  # waiting, ready to place from either: now send
                assert time.monotonic() < deadline and t.is_alive(), "recv did not wait"
                time.sleep(0.001)
            ranks[src].send_parts(1, [memoryview(bytearray([src + 5]) * size)])
            t.join(30)
            assert not t.is_alive()
            assert not b._into, "the wait left its placements behind"
        assert [s for s, _ in got] == [2, 0]
        for src, msg in got:
            assert isinstance(msg, Placed) and msg.tail.obj is targets[src]
            assert bytes(msg) == bytes([src + 5]) * size
        assert b.stats()["messages_read_in_place"] == 2
    finally:
        for c in ranks:
            c.close()


def _placed_run(program: str, ranks: int, cwd: Path) -> tuple[str, int]:
    """Run ``tests/data/mpi/<program>`` under the local launcher: its output, and how many
    messages the rank that says so read in place."""
    repo = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", "-n", str(ranks),
                        "--mpi4py", "--", sys.executable,
                        str(repo / "tests/data/mpi" / program)],
                       capture_output=True, text=True, timeout=90, cwd=cwd)
    assert p.returncode == 0, p.stderr[-2000:]
    [placed] = [int(x.split(":")[1]) for x in p.stderr.splitlines()
                if x.startswith("read in place:")]
    return p.stdout, placed


def test_a_waitall_reads_a_message_in_place_while_it_waits_for_another(tmp_path: Path
                                                                      ) -> None:
    """Its output is compared with Open MPI's in test_mpi_programs; here: rank 2's
    message, which comes while the Waitall still waits for rank 1's (the first in its
    list), is read into its buffer too. A wait in list order read at most one of the
    two in each of the six rounds."""
    out, placed = _placed_run("waitall_recv.py", 3, tmp_path)
    assert out.count("[True, True] [(1, 131072), (2, 131072)]") == 6, out
    assert 6 < placed <= 12, placed


def test_an_mpi4py_ping_pong_reads_its_large_messages_in_place(tmp_path: Path) -> None:
    """The program's output is compared with Open MPI's in test_mpi_programs; here: its
    receives did take the way without a copy (rank 1 waits for each ping as it comes)."""
    out, placed = _placed_run("large_recv.py", 2, tmp_path)
    assert "larger (65536, True, True) order (True, True)" in out
    assert 1 <= placed <= 11, placed  # 8 pings, 3 more; not those sent ahead


def test_an_any_source_receive_reads_the_message_that_begins_first_in_place(
        tmp_path: Path) -> None:
    """Its output is compared with Open MPI's in test_mpi_programs (also with rank 0 lost
    and replayed); here: of the 12 receives, those of the 1 MiB messages that began while
    rank 0 waited were read into its buffer (one per round at least: the small message of
    an odd round is whole first, and goes to the round's next receive)."""
    out, placed = _placed_run("anysource_recv.py", 3, tmp_path)
    for k in range(6):
        second = (2, 8, True) if k % 2 else (2, 131072, True)
        assert f"round {k} {[(1, 131072, True), second]}" in out, out
    assert 3 <= placed <= 9, placed  # 0 before: such a receive was never read into
