"""The pump: the waiting application thread reads, else the background thread; a send
whose socket is full reads on the sending thread; a stalled connection delays no other; a
frame handler's error ends only its connection."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.runtime import pump as pump_mod
from raps_slurm.runtime.pump import HANDOFF, MISS_STREAK, MISSED_SKIP, Conn, Pump
from raps_slurm.wire.framing import HEADER, FrameReader, send_parts


class Sink:
    """What the pump delivered, by connection, with the thread that read it."""

    def __init__(self) -> None:
        self.got: list[tuple[int, bytes, str]] = []
        self.ended: list[tuple[int, str]] = []
        self.cv = threading.Condition()

    def body(self, c: Conn, body: memoryview, owned: bool) -> None:
        if bytes(body) == b"poison":
            raise ValueError("a frame its handler refuses")
        with self.cv:
            self.got.append((c.cid, bytes(body), threading.current_thread().name))
            self.cv.notify_all()

    def end(self, c: Conn, exc: BaseException) -> None:
        with self.cv:
            self.ended.append((c.cid, type(exc).__name__))
            self.cv.notify_all()

    def until(self, what: str, pred: object, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        with self.cv:
            while not pred():  # type: ignore[operator]
                left = deadline - time.monotonic()
                assert left > 0, f"{what}: got {self.got}, ended {self.ended}"
                self.cv.wait(left)


@pytest.fixture
def rig() -> Iterator[tuple[Pump, Sink, list[socket.socket]]]:
    sink = Sink()
    pump = Pump(sink.body, sink.end)
    writers: list[socket.socket] = []
    for cid in (1, 2):
        a, b = socket.socketpair()
        reader = FrameReader(b, frame_timeout=30.0)
        reader.nonblocking()
        pump.add(Conn(cid, b, reader, src=cid))
        writers.append(a)
    try:
        yield pump, sink, writers
    finally:
        pump.close()
        for w in writers:
            w.close()


def test_the_waiting_thread_reads_and_the_background_takes_over(
        rig: tuple[Pump, Sink, list[socket.socket]]) -> None:
    pump, sink, (w1, _) = rig
    # Sent while this thread waits (before, the background thread may read it first).
    threading.Timer(0.1, lambda: send_parts(w1, [b"a"])).start()
    deadline = time.monotonic() + 5
    while not sink.got and time.monotonic() < deadline:
        pump.wait(0.5)
    assert sink.got == [(1, b"a", threading.current_thread().name)]
    assert pump.frames_app == 1
    # Out of its waits for longer than HANDOFF: the background thread reads.
    time.sleep(HANDOFF * 3)
    send_parts(w1, [b"b"])
    sink.until("b read by the background thread", lambda: len(sink.got) == 2)
    assert sink.got[1][:2] == (1, b"b") and sink.got[1][2] == "raps-read"
    assert pump.frames_background == 1


def test_release_hands_reading_back_at_once(rig: tuple[Pump, Sink, list[socket.socket]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Without release() the background thread would wait for this long:
    monkeypatch.setattr(pump_mod, "HANDOFF", 30.0)
    pump, sink, (w1, _) = rig
    threading.Timer(0.1, lambda: send_parts(w1, [b"a"])).start()
    deadline = time.monotonic() + 5
    while not sink.got and time.monotonic() < deadline:
        pump.wait(0.5)
    assert sink.got[0][2] == threading.current_thread().name
    pump.release()
    send_parts(w1, [b"b"])
    t0 = time.monotonic()
    sink.until("b after release", lambda: len(sink.got) == 2)
    assert sink.got[1][2] == "raps-read"
    assert time.monotonic() - t0 < 1.0


def test_a_stalled_frame_delays_no_other_connection(
        rig: tuple[Pump, Sink, list[socket.socket]]) -> None:
    _, sink, (w1, w2) = rig
    w1.sendall(HEADER.pack(1000) + b"x" * 10)  # a frame that stops half way
    for i in range(20):
        send_parts(w2, [f"m{i}".encode()])
    sink.until("connection 2's frames", lambda: len(sink.got) == 20, timeout=2.0)
    assert [g[1] for g in sink.got] == [f"m{i}".encode() for i in range(20)]
    w1.sendall(b"y" * 990)
    sink.until("connection 1's frame once whole", lambda: len(sink.got) == 21)
    assert sink.got[-1][:2] == (1, b"x" * 10 + b"y" * 990)


def test_a_handler_error_ends_that_connection_only(
        rig: tuple[Pump, Sink, list[socket.socket]]) -> None:
    _, sink, (w1, w2) = rig
    send_parts(w1, [b"poison"])
    sink.until("connection 1 ended", lambda: sink.ended == [(1, "ValueError")])
    send_parts(w2, [b"still"])
    sink.until("connection 2 read", lambda: (2, b"still") in [g[:2] for g in sink.got])
    w2.close()
    sink.until("connection 2 ended", lambda: (2, "FrameError") in sink.ended)


def test_a_closed_pump_returns_from_waits(rig: tuple[Pump, Sink, list[socket.socket]]) -> None:
    pump, _, _ = rig
    pump.close()
    t0 = time.monotonic()
    pump.wait(0.05)
    assert time.monotonic() - t0 < 1.0


def test_spinning_stops_after_spins_in_a_row_that_found_nothing() -> None:
    # A scripted pass (frames found or not) and a clock that lets each spin make one.
    # Held as a wait holds it, the pump's lock keeps its own thread out of the script.
    ticks = itertools.count()
    sink = Sink()
    pump = Pump(sink.body, sink.end, spin=1.0, clock=lambda: next(ticks) * 0.5)
    found: list[int] = []
    pump._lock.acquire()
    pump._pass = lambda timeout, app: found.pop(0)  # type: ignore[method-assign]
    try:
        def spin(result: int) -> bool:
            found.append(result)
            spun = pump._spun()
            if not spun and found:  # the wait did not spin at all
                found.clear()
                return False
            return spun

        for missed in range(1, MISS_STREAK):  # one miss alone (a preemption) goes on spinning
            assert not spin(0) and pump.spins_missed == missed
        assert spin(1)  # a spin that finds a frame starts the count again
        for _ in range(MISS_STREAK - 1):
            spin(0)
        assert pump.spins_missed == 2 * (MISS_STREAK - 1)  # still spinning
        spin(0)  # the streak is complete: the next waits do not spin
        assert pump.spins_missed == 2 * MISS_STREAK - 1
        for _ in range(MISSED_SKIP):
            assert not spin(1)
        assert pump.spins_missed == 2 * MISS_STREAK - 1
        spin(0)  # then it tries again, and one more miss stops it again
        assert pump.spins_missed == 2 * MISS_STREAK and not spin(1)
    finally:
        del pump._pass  # the real pass again, before its thread may take the lock
        pump._lock.release()
        pump.close()


def test_ranks_spin_only_where_each_can_have_a_core(tmp_path: Path) -> None:
    from raps_slurm.runtime import settings_from

    cfg = tmp_path / "raps.yaml"
    cfg.write_text("messagelog:\n  spin_us: 150\n")
    cores = os.cpu_count() or 1
    env = {"RAPS_CONFIG": str(cfg), "RAPS_LISTEN_ADDRESS": "127.0.0.1"}
    assert settings_from(env).spin_us == 150  # no count given: the config's
    assert settings_from({**env, "RAPS_LOCAL_SIZE": str(cores)}).spin_us == 150
    assert settings_from({**env, "RAPS_LOCAL_SIZE": str(cores + 1)}).spin_us == 0


def test_a_rank_refuses_a_malformed_config_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from raps_slurm.errors import ConfigError
    from raps_slurm.runtime import settings_from

    cfg = tmp_path / "raps.yaml"
    cfg.write_text("messagelog:\n  spin_us: 150\n  buffer_high_watermark_mb: 8000\n")
    env = {"RAPS_CONFIG": str(cfg), "RAPS_LISTEN_ADDRESS": "127.0.0.1"}
    # its settings were meant: a rank that took the defaults instead would run on others
    with pytest.raises(ConfigError, match="buffer_high_watermark_mb: 8000 must be below"):
        settings_from(env)
    cfg.write_text("messagelog:\n  spin_us: 150\n")
    # a site may keep the file from users (root reads it all: the check is os.access)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert settings_from(env).spin_us != 150
    assert f"raps: {cfg}: not readable by this user: built-in defaults" in capsys.readouterr().err


def test_a_frame_handled_before_the_wait_ends_it_at_once(
        rig: tuple[Pump, Sink, list[socket.socket]]) -> None:
    # The caller looked (nothing there) at events count `since`; the background thread
    # then handled a frame before the caller got into wait(): without `since` the wait
    # would sleep until the next frame or its timeout (seen: 100 ms stalls, until the
    # next tick's control frame, in a 1 MiB ping-pong).
    pump, sink, (w1, _) = rig
    pump.release()
    since = pump.events
    send_parts(w1, [b"a"])
    sink.until("a read by the background thread", lambda: len(sink.got) == 1)
    deadline = time.monotonic() + 5
    while pump.events == since:  # counted once its handler returned
        assert time.monotonic() < deadline, "the frame handled was never counted"
        time.sleep(0.001)
    t0 = time.monotonic()
    pump.wait(3.0, since)
    assert time.monotonic() - t0 < 1.0
    # With nothing new since the look, the wait does wait. It may return early once: a
    # wait that takes reading back wakes the pump's thread, and on a loaded machine its
    # own pass can see that wake-up first.
    t0, waits = time.monotonic(), 0
    while time.monotonic() - t0 < 0.3:
        pump.wait(0.3, pump.events)
        waits += 1
    assert waits <= 2, f"{waits} waits returned within 0.3 s"
    # A connection that ends counts too.
    since = pump.events
    pump.release()
    w1.close()
    sink.until("the end of connection 1", lambda: len(sink.ended) == 1)
    while pump.events == since:
        assert time.monotonic() < deadline, "the end was never counted"
        time.sleep(0.001)


def test_a_full_send_reads_on_the_sending_thread(
        rig: tuple[Pump, Sink, list[socket.socket]], monkeypatch: pytest.MonkeyPatch) -> None:
    # The background thread would not read for this long: only the sender itself can.
    monkeypatch.setattr(pump_mod, "HANDOFF", 30.0)
    pump, sink, (w1, _) = rig
    threading.Timer(0.1, lambda: send_parts(w1, [b"a"])).start()
    deadline = time.monotonic() + 5
    while not sink.got and time.monotonic() < deadline:
        pump.wait(0.5)  # this thread reads now
    assert sink.got, "the first frame never came"
    out, peer = socket.socketpair()
    peer.settimeout(10.0)
    w1.settimeout(10.0)
    for s in (out, peer, w1):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    big = os.urandom(1000 << 10)  # more than both ends' socket buffers hold
    seen: list[bytes] = []

    def the_peer() -> None:
        # Sends its own large frame first, as two ranks exchanging halos do: it reads
        # ours only once this rank has taken in its frame.
        send_parts(w1, [big])
        reader = FrameReader(peer, frame_timeout=10.0)
        seen.append(bytes(reader.read()))

    t = threading.Thread(target=the_peer)
    t.start()
    # a send stuck for good fails instead of hanging the test
    watchdog = threading.Timer(10.0, lambda: peer.shutdown(socket.SHUT_RDWR))
    watchdog.start()
    try:
        send_parts(out, [big[::-1]], on_full=pump.stalled)
        t.join(10.0)
        assert not t.is_alive(), f"the peer is stuck; got {[len(g[1]) for g in sink.got]}"
        assert seen == [big[::-1]]
        sink.until("the peer's frame", lambda: len(sink.got) == 2)
        assert sink.got[1] == (1, big, threading.current_thread().name)
    finally:
        watchdog.cancel()
        out.close()
        peer.close()
