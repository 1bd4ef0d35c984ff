"""Rank-to-rank traffic is authenticated with the job's key: the four attacks of a
stranger (a HELLO with a far-future epoch, a duplicate seq with other bytes, COVERED
seq 2^63, a header announcing 2 GiB) sent to real running ranks, raw and behind a
handshake with a wrong key, are refused, counted, and change nothing in the job's result;
a recorded handshake replayed fails; frames are checked one by one."""

from __future__ import annotations

import hashlib
import os
import resource
import select
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.runtime.context import Context, Settings
from raps_slurm.runtime.frames import (
    ALIGN,
    COVERED,
    DATA,
    DELIVERED,
    HEADER,
    HELLO,
    Frame,
    encode,
)
from raps_slurm.runtime.msglog import checksum
from raps_slurm.runtime.ports import LocalPort
from raps_slurm.runtime.rankauth import PROTOCOL, Auth
from raps_slurm.runtime.transport import HANDSHAKE_MAX, Listener, Outgoing
from raps_slurm.wire import framing

PARAMS = CodecParams(avg_chunk_kb=4)
SETTINGS = Settings(flush_ms=20, large_threshold=256, high_watermark=1 << 20,
                    buffer_bytes=2 << 20, checkpoint_interval=1e9, max_generations=2,
                    recv_timeout=30.0)
HUGE_EPOCH = 1 << 62
HELLO_BYTES = struct.Struct(f">{len(PROTOCOL)}s16sIIQQB")


def attack_frames(src: int, dst: int) -> list[bytes]:
    """The confirmed attacks, as frame bodies a stranger would send as rank ``src``."""
    def body(*a: object, **kw: object) -> bytes:
        return b"".join(bytes(p) for p in encode(*a, **kw))  # type: ignore[arg-type]
    return [body(HELLO, src, dst, 0, HUGE_EPOCH),
            body(DATA, src, dst, 1, HUGE_EPOCH, b"forged bytes, not what rank sent"),
            body(COVERED, src, dst, 1 << 63, HUGE_EPOCH)]


def two_gib_header() -> bytes:
    return struct.pack(">I", (2 << 30) - 1) + struct.pack(">BIIQQII", DATA, 0, 1, 1, 1,
                                                         (2 << 30) - 1, 0)


def raw_attack(address: tuple[str, int], src: int, dst: int) -> None:
    """Unauthenticated: the frames framed as the stream expects, no handshake at all,
    then the 34-byte header of the old protocol announcing 2 GiB."""
    for data in [struct.pack(">I", len(f)) + f for f in attack_frames(src, dst)] + [
            two_gib_header(),
            struct.pack(">BIIQQII", DATA, src, dst, 1, 1, (1 << 31), 0)]:
        _send_and_close(address, data)


def wrong_key_attack(address: tuple[str, int], src: int, dst: int) -> None:
    """A peer that speaks the handshake with a key of its own, then sends the frames
    MAC'd with the session key it would have had."""
    key = os.urandom(32)
    bad = Auth(key, src)
    with socket.create_connection(address, timeout=10) as s:
        nc = os.urandom(16)
        framing.send_parts(s, [HELLO_BYTES.pack(PROTOCOL, nc, src, dst, 1, 1, bad.mode)])
        answer = bytes(framing.FrameReader(s, max_size=HANDSHAKE_MAX).read(idle_timeout=10))
        ns = answer[:16]
        framing.send_parts(s, [bad.proof(key, b"c", nc, ns, src, dst, 1, 1)])
        mac = framing.FrameMac(bad.proof(key, b"k", nc, ns, src, dst, 1, 1), "blake3", b"c")
        try:
            for f in attack_frames(src, dst):
                framing.send_parts(s, [f], mac=mac)
            s.sendall(struct.pack(">I", (2 << 30) - 1))
            s.settimeout(10)
            assert s.recv(1) == b""  # the rank closed the connection
        except (OSError, framing.FrameError):
            pass  # closed while we were still writing


def _send_and_close(address: tuple[str, int], data: bytes) -> None:
    with socket.create_connection(address, timeout=10) as s:
        try:
            s.sendall(data)
            s.settimeout(10)
            assert s.recv(1) == b""
        except OSError:
            pass


def ring_rank(root: Path, rank: int, n: int, rounds: int, kill_at: int | None,
              hook: list[Context]) -> bytes:
    """Rank ``rank`` of a ring: each round send to the next, receive from the previous;
    checkpoint every 3 rounds; the first incarnation dies at ``kill_at`` if set."""
    epoch = 1
    while True:
        ctx = Context(LocalPort(root, "1", rank, epoch, PARAMS, max_generations=2),
                      rank, n, epoch, SETTINGS)
        hook.append(ctx)
        restored = ctx.restore()
        state, start = (hashlib.sha256(b"start").digest(), 0) if restored is None else (
            bytes(restored["h"]), int(restored["round"][0]))
        try:
            for rnd in range(start, rounds):
                if rnd == kill_at and epoch == 1:
                    raise InterruptedError
                ctx.send((rank + 1) % n, hashlib.sha256(state + bytes([rnd])).digest() * 8)
                state = hashlib.sha256(state + ctx.recv((rank - 1) % n)).digest()
                if (rnd + 1) % 3 == 0:
                    import numpy as np
                    ctx.checkpoint({"h": np.frombuffer(state, dtype=np.uint8).copy(),
                                    "round": np.array([rnd + 1], dtype=np.int64)})
                time.sleep(0.01)
            ctx.finalize()
            return state
        except InterruptedError:
            ctx.close()
            epoch += 1


def run_ring(root: Path, n: int = 4, rounds: int = 24, kill: tuple[int, int] | None = None,
             attack: bool = False) -> tuple[list[bytes | BaseException], list[Context]]:
    out: list[bytes | BaseException] = [b""] * n
    contexts: list[Context] = []
    stop = threading.Event()

    def one(r: int) -> None:
        try:
            out[r] = ring_rank(root, r, n, rounds, kill[1] if kill and kill[0] == r else None,
                               contexts)
        except BaseException as exc:  # reported by the test
            out[r] = exc

    def attacker() -> None:
        # Every live rank, again and again while the job runs, as a neighbour would be.
        while not stop.is_set():
            for ctx in list(contexts):
                if stop.is_set():
                    return
                with _quiet():
                    src = (ctx.rank - 1) % n
                    raw_attack(ctx.listener.address, src, ctx.rank)
                    wrong_key_attack(ctx.listener.address, src, ctx.rank)
            time.sleep(0.05)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    bad = threading.Thread(target=attacker)
    for t in threads:
        t.start()
    if attack:
        bad.start()
    for t in threads:
        t.join(120)
    stop.set()
    if attack:
        bad.join(60)
    return out, contexts


class _quiet:
    """A rank that just closed its listener refuses the connection, or closes it before
    answering the handshake: not our concern (the attacks go on against the others)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(
            exc[0], (OSError, framing.FrameError))  # type: ignore[arg-type]


def test_four_attacks_on_running_ranks_change_nothing(tmp_path: Path) -> None:
    clean, _ = run_ring(tmp_path / "clean", kill=(2, 10))
    assert all(isinstance(x, bytes) for x in clean), clean
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    attacked, contexts = run_ring(tmp_path / "attacked", kill=(2, 10), attack=True)
    assert attacked == clean
    refused: dict[str, int] = {}
    for ctx in contexts:
        for kind, count in ctx.listener.auth.refusals().items():
            refused[kind] = refused.get(kind, 0) + count
    # raw frames fail the handshake (no hello, a 2 GiB length refused from 4 bytes);
    # the wrong key fails its proof; nothing reached a rank's frame handling
    assert refused.get("handshake", 0) >= 5 * len(contexts) // 2, refused
    assert refused.get("authentication", 0) >= len(contexts) // 2, refused
    assert set(refused) <= {"handshake", "authentication", "epoch", "connections"}, refused
    for ctx in contexts:  # no forged epoch was ever believed
        assert all((p["peer_epoch"] or 0) < 10 for p in ctx.stats()["peers"].values())
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    assert grown_mib < 512, f"peak RSS grew by {grown_mib:.0f} MiB: a 2 GiB frame was allocated"


@pytest.fixture
def listener() -> tuple[Listener, list[Frame]]:
    got: list[Frame] = []
    lst = Listener("127.0.0.1", lambda f, cid: got.append(f), lambda cid: None,
                   Auth(b"K" * 32, 1, max_message=1024))
    yield lst, got  # type: ignore[misc]
    lst.close()


def wait_for(cond: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


class Recorder:
    """A client socket that keeps every byte it sends."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.sent = bytearray()

    def handshake(self, auth: Auth, src: int, dst: int, epochs: tuple[int, int] = (1, 0)
                  ) -> framing.FrameMac:
        """As rank ``src`` of epoch ``epochs[0]`` calling ``dst`` of epoch ``epochs[1]``."""
        nc, key = os.urandom(16), auth.keys_for(dst).connect
        bound = (src, dst, *epochs)
        self.send(framing.HEADER.pack(HELLO_BYTES.size) + HELLO_BYTES.pack(
            PROTOCOL, nc, *bound, auth.mode))
        answer = bytes(framing.FrameReader(self.sock, max_size=HANDSHAKE_MAX).read(idle_timeout=10))
        ns = answer[:16]
        assert answer[16:] == auth.proof(key, b"s", nc, ns, *bound)  # the listener holds it
        proof = auth.proof(key, b"c", nc, ns, *bound)
        self.send(framing.HEADER.pack(len(proof)) + proof)
        return framing.FrameMac(auth.proof(key, b"k", nc, ns, *bound), "blake3", b"c")

    def send(self, data: bytes) -> None:
        self.sent += data
        self.sock.sendall(data)


def framed(body: list[bytes | memoryview], mac: framing.FrameMac | None) -> bytes:
    """One frame as it goes on the wire, tagged unless ``mac`` is None."""
    tag = mac.tag_parts(body) if mac is not None else b""
    data = b"".join(bytes(p) for p in body) + tag
    return framing.HEADER.pack(len(data)) + data


def test_a_replayed_handshake_and_a_replayed_frame_are_refused(
        listener: tuple[Listener, list[Frame]]) -> None:
    lst, got = listener
    auth = Auth(b"K" * 32, 0)
    rec = Recorder(lst.address)
    mac = rec.handshake(auth, 0, 1)
    hello = framed(encode(HELLO, 0, 1, 0, 1), mac)
    rec.send(hello)
    rec.send(framed(encode(DATA, 0, 1, 1, 1, b"one"), None))  # frame_mac control
    wait_for(lambda: len(got) == 2)
    # the same bytes again on a new connection: the listener's nonce is new, so the
    # recorded proof is wrong for it
    with socket.create_connection(lst.address, timeout=10) as s:
        s.sendall(bytes(rec.sent))
        s.settimeout(10)
        with pytest.raises(OSError):
            while s.recv(4096):
                pass
            raise ConnectionResetError
    wait_for(lambda: lst.auth.refusals().get("authentication") == 1)
    # a frame of this connection sent again: its number is past
    rec.send(hello)
    wait_for(lambda: lst.auth.refusals().get("mac") == 1)
    assert [(f.kind, f.payload) for f in got] == [(HELLO, b""), (DATA, b"one")]
    rec.sock.close()


def test_frames_are_bound_to_the_authenticated_rank_and_the_bound(
        listener: tuple[Listener, list[Frame]]) -> None:
    lst, got = listener
    auth = Auth(b"K" * 32, 0)
    for frame_src, length, kind, n in ((2, 3, "frame", 1), (0, 1025, "oversized", 1),
                                       (0, 1025, "payload", 2)):
        rec = Recorder(lst.address)
        rec.handshake(auth, 0, 1)
        if kind == "oversized":  # a header past the bound: refused before the body comes
            # the bound: the header, a DATA frame's padding, the payload and a tag
            assert lst.auth.max_frame == HEADER.size + ALIGN - 1 + length - 1 + 32
            rec.send(framing.HEADER.pack(lst.auth.max_frame + 1))
        else:  # another source than the handshake's; a payload past the bound, unpadded
            rec.send(framed(encode(DATA, frame_src, 1, 1, 1, b"x" * length), None))
            kind = "oversized" if kind == "payload" else kind
        wait_for(lambda k=kind, n=n: lst.auth.refusals().get(k) == n)  # type: ignore[misc]
        rec.sock.close()
    assert got == []


def test_a_listener_for_another_rank_or_key_is_not_connected_to(
        listener: tuple[Listener, list[Frame]]) -> None:
    lst, _ = listener
    other = Listener("127.0.0.1", lambda f, c: None, lambda c: None, Auth(b"X" * 32, 0))
    with pytest.raises(OSError, match="failed authentication"):
        other.connect(lst.address, 0, 1)  # the listener cannot prove the key we hold
    assert other.auth.refusals() == {"authentication": 1}
    other.close()
    good = Listener("127.0.0.1", lambda f, c: None, lambda c: None,
                    Auth(b"K" * 32, 0, max_message=1024))
    with pytest.raises(OSError, match="handshake"):  # this listener is rank 1, not 3
        good.connect(lst.address, 0, 3)
    wait_for(lambda: lst.auth.refusals() == {"handshake": 1})
    out = good.connect(lst.address, 0, 1)
    with pytest.raises(OSError, match="at most"):
        out.send(encode(DATA, 0, 1, 1, 1, b"y" * 1025))  # refused here, nothing written
    out.send(encode(HELLO, 0, 1, 0, 1))
    out.close()
    good.close()


def test_a_send_over_the_bound_is_refused_before_it_is_logged(tmp_path: Path) -> None:
    small = Settings(**{**SETTINGS.__dict__, "max_message": 1024})
    ctx = Context(LocalPort(tmp_path, "1", 0, 1, PARAMS), 0, 2, 1, small)
    try:
        with pytest.raises(ValueError, match="message of 1025 bytes: at most 1024"):
            ctx.send(1, bytes(1025))
        assert ctx.log.sent == {}
    finally:
        ctx.close()


def test_the_local_key_is_made_once_and_private(tmp_path: Path) -> None:
    a, b = LocalPort(tmp_path, "1", 0, 1), LocalPort(tmp_path, "1", 1, 1)
    key = a.job_key()
    assert len(key) == 32 and b.job_key() == key
    assert (tmp_path / "job.key").stat().st_mode & 0o777 == 0o600
    assert not list((tmp_path / "tmp").iterdir())


def test_frames_must_carry_the_handshakes_epoch(
        listener: tuple[Listener, list[Frame]]) -> None:
    """The source's epoch is bound at the handshake: a frame claiming another (a HELLO
    from a far-future incarnation, a DATA frame of an older one) closes the connection;
    a hello for another incarnation of the listener is refused before any proof."""
    lst, got = listener
    auth = Auth(b"K" * 32, 0)
    for n, frame in enumerate(([HELLO, 0, 1, 0, HUGE_EPOCH], [DATA, 0, 1, 1, 0, b"old"]), 1):
        rec = Recorder(lst.address)
        mac = rec.handshake(auth, 0, 1, epochs=(1, 0))
        kind = frame[0]
        rec.send(framed(encode(*frame), mac if kind != DATA else None))  # type: ignore[arg-type]
        wait_for(lambda n=n: lst.auth.refusals().get("frame") == n)  # type: ignore[misc]
        rec.sock.close()
    with socket.create_connection(lst.address, timeout=10) as s:
        s.sendall(framing.HEADER.pack(HELLO_BYTES.size) + HELLO_BYTES.pack(
            PROTOCOL, os.urandom(16), 0, 1, 1, 7, auth.mode))  # listener's epoch is 0
        s.settimeout(10)
        assert s.recv(4096) == b""
    wait_for(lambda: lst.auth.refusals().get("handshake") == 1)
    assert got == []


@pytest.mark.parametrize("mode", ["control", "all"])
def test_a_data_frame_sent_whole_at_once_is_the_frame_send_writes(mode: str) -> None:
    """``Outgoing.send_data`` (a small message's send: prefix and header packed at once)
    writes what ``send`` writes: the listener takes every frame, in order, with its
    fields and checksum, also when the socket was full half way through a frame (the
    listener reads nothing more until it is); under ``all`` it is tagged as any DATA
    frame."""
    got: list[Frame] = []
    fulls: list[int] = []
    release = threading.Event()

    def on_frame(f: Frame, cid: int) -> None:
        if f.kind == DATA and not release.is_set():
            release.wait(30)  # the listener stops reading: the sender's socket fills
        got.append(f)

    def full(sock: socket.socket) -> None:
        fulls.append(1)
        release.set()
        select.select([], [sock], [], 1.0)

    lst = Listener("127.0.0.1", on_frame, lambda cid: None,
                   Auth(b"K" * 32, 1, max_message=1 << 20, frame_mac=mode))
    try:
        auth = Auth(b"K" * 32, 0, frame_mac=mode, epoch=1)
        out = Outgoing(lst.address, 0, auth, 1, on_full=full)
        out.send(encode(HELLO, 0, 1, 0, 1))
        # 24 MB: more than loopback TCP's buffers hold with the reader stopped
        bodies = [bytes([i % 251]) * (60_000 + i) for i in range(400)]
        for i, body in enumerate(bodies, 1):
            out.send_data(0, 1, i, 1, checksum(body), body)
        wait_for(lambda: len(got) == 401, timeout=30)
        assert fulls, "the socket never filled: the partial write went untested"
        assert [(f.kind, f.seq, f.epoch, f.crc, bytes(f.payload)) for f in got[1:]] == [
            (DATA, i, 1, checksum(b), b) for i, b in enumerate(bodies, 1)]
        assert out.mac.seq == (1 if mode == "control" else 401)
    finally:
        release.set()
        lst.close()


@pytest.mark.parametrize("mode", ["control", "all"])
def test_frame_mac_says_which_frames_are_tagged(mode: str) -> None:
    """Under ``control`` a DATA frame travels untagged and control frames keep their own
    count; under ``all`` a DATA frame without its tag is refused. Either way a peer set to
    the other mode is refused at the handshake, naming the setting."""
    got: list[Frame] = []
    lst = Listener("127.0.0.1", lambda f, cid: got.append(f), lambda cid: None,
                   Auth(b"K" * 32, 1, max_message=1 << 20, frame_mac=mode))
    try:
        auth = Auth(b"K" * 32, 0, frame_mac=mode, epoch=1)
        out = Outgoing(lst.address, 0, auth, 1)
        out.send(encode(HELLO, 0, 1, 0, 1))
        out.send(encode(DATA, 0, 1, 1, 1, b"m" * 600_000))  # larger than a read buffer
        out.send(encode(DATA, 0, 1, 2, 1, b"small"))
        out.send(encode(DELIVERED, 0, 1, 5, 1))
        wait_for(lambda: len(got) == 4)
        assert [(f.kind, bytes(f.payload)[:5]) for f in got] == [
            (HELLO, b""), (DATA, b"mmmmm"), (DATA, b"small"), (DELIVERED, b"")]
        assert out.mac.seq == (2 if mode == "control" else 4)
        rec = Recorder(lst.address)
        rec.handshake(auth, 0, 1, epochs=(1, 0))
        rec.send(framed(encode(DATA, 0, 1, 1, 1, b"an untagged message, long enough"), None))
        refusal = "frame" if mode == "control" else "mac"  # control: the tag it lacks is
        # not the point; all: the last 32 bytes read as a tag fail
        if mode == "control":  # it is accepted; an untagged control frame is not
            wait_for(lambda: len(got) == 5)
            rec.send(framed(encode(HELLO, 0, 1, 0, 1), None))
            refusal = "mac"
        wait_for(lambda: lst.auth.refusals().get(refusal) == 1)
        rec.sock.close()
        other = Auth(b"K" * 32, 0, frame_mac="all" if mode == "control" else "control")
        with pytest.raises(OSError, match="handshake"):
            Outgoing(lst.address, 0, other, 1)
        wait_for(lambda: lst.auth.refusals().get("handshake") == 1)
    finally:
        lst.close()
