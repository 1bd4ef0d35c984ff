"""The chunk transfer protocol against hostile and broken peers (loopback only)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest
import zstandard

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.codec import CodecParams, Decoder
from raps_slurm.checkpoint.local import LocalCheckpoints
from raps_slurm.checkpoint.transfer import (
    TokenBucket,
    TransferClient,
    TransferError,
    TransferServer,
    encode_records,
)
from raps_slurm.checkpoint.transfer_wire import verify_chunk
from raps_slurm.checkpoint.writer import encode_state
from raps_slurm.runtime.msglog import Entry, checksum

KEY = secrets.token_bytes(32)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TransferServer, LocalCheckpoints]]:
    store = ChunkStore(tmp_path / "server")
    server = TransferServer(store, KEY, "srv", ("127.0.0.1", 0), max_generations=2)
    server.start()
    yield server, LocalCheckpoints(store)
    server.stop()


def saved(local: LocalCheckpoints, seed: int = 1):
    a = np.random.default_rng(seed).standard_normal(30_000)
    s, _ = local.begin("9", 0, 1, None)
    m, _ = encode_state(a, job="9", rank=0, epoch=1, params=CodecParams(avg_chunk_kb=8),
                        previous=None, sink=lambda p: local.ingest(s, p.fd))
    local.finish(s, m, 1)
    local.end(s)
    return m.with_generation(1)


def still_serves(server: TransferServer) -> None:
    with TransferClient(KEY, "good", server.address) as c:
        assert c.call({"op": "has", "job": "9", "digests": []})[0]["missing"] == []


def test_wrong_key_is_refused_both_ways(served) -> None:
    server, _ = served
    with pytest.raises(TransferError, match="failed authentication"):
        TransferClient(secrets.token_bytes(32), "intruder", server.address)
    still_serves(server)


def test_push_then_pull_round_trip(served, tmp_path: Path) -> None:
    server, _ = served
    mine = LocalCheckpoints(ChunkStore(tmp_path / "client"))
    m = saved(mine)
    with TransferClient(KEY, "c", server.address) as c:
        res = c.push(mine.store, m)
        assert res.sent_chunks == len(m.digests()) and res.ok
        again = c.push(mine.store, m)  # delta: nothing left to send
        assert again.sent_chunks == 0
        assert c.manifest("9", 0, 1) == m.to_json()
        got = list(c.fetch("9", sorted(m.digests()), dict(m.chunks)))
        assert {d for d, _, _ in got} == m.digests()
        assert c.verify("9", 0, 1)["bad"] == []
        assert c.manifest("9", 0, 2) is None


def test_corrupt_chunk_in_a_put_is_refused_and_not_stored(served) -> None:
    server, local = served
    with TransferClient(KEY, "c", server.address) as c:
        digest = "ab" * 32
        reply, _ = c.call({"op": "put", "job": "9"}, encode_records([(digest, 5, b"\x00hello")]))
        assert reply["bad"] == [digest] and reply["stored"] == 0
        assert not local.store.has("9", digest)


def test_manifest_naming_absent_chunks_is_refused(served, tmp_path: Path) -> None:
    server, _ = served
    mine = LocalCheckpoints(ChunkStore(tmp_path / "client"))
    m = saved(mine)
    with TransferClient(KEY, "c", server.address) as c:
        with pytest.raises(TransferError, match="chunk\\(s\\) missing"):
            c.call({"op": "put_manifest", "job": "9"}, m.to_json())
        with pytest.raises(TransferError, match="bad job id"):
            c.call({"op": "get", "job": "../etc", "digests": []})
        with pytest.raises(TransferError, match="expected a list of 64-hex-digit"):
            c.call({"op": "get", "job": "9", "digests": ["../../x"]})


@pytest.mark.parametrize("garbage", [
    b"",                                      # connect and close
    b"\x00\x00\x00\x05hello",                 # not JSON
    struct.pack(">I", 1 << 30),               # absurd length
    b'\x00\x00\x00\x02{}',                    # no name, no nonce
    os.urandom(4096),
])
def test_garbage_handshakes_leave_the_server_serving(served, garbage: bytes) -> None:
    server, _ = served
    before = server.errors
    # The server may hang up in the middle of the garbage: that is the point.
    with socket.create_connection(server.address, timeout=5) as s, \
            contextlib.suppress(OSError):
        s.sendall(garbage)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        while s.recv(4096):
            pass
    still_serves(server)
    if garbage:
        deadline = time.monotonic() + 5
        while server.errors == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.errors > before


def test_tampered_frame_closes_the_connection(served) -> None:
    server, _ = served
    c = TransferClient(KEY, "c", server.address)
    chan = c._chan
    chan._key = secrets.token_bytes(32)  # frames now carry a wrong MAC
    with pytest.raises(TransferError):
        c.call({"op": "has", "job": "9", "digests": []})
    c.close()
    still_serves(server)


def test_token_bucket_paces_bytes() -> None:
    now = [0.0]
    bucket = TokenBucket(1000.0, clock=lambda: now[0])
    t = time.monotonic()
    bucket.take(50)   # 0.05 s of budget: waits 0 now, next send at 0.05
    bucket.take(50)   # waits until 0.05 (clock frozen: sleeps 0.05)
    assert time.monotonic() - t >= 0.04


def test_key_rollover_both_keys_are_accepted_while_it_lasts(tmp_path: Path) -> None:
    old, new = secrets.token_bytes(32), secrets.token_bytes(32)
    store = ChunkStore(tmp_path / "rollover")
    # step 2 of a rollover: this server signs with the new key and still accepts the old
    server = TransferServer(store, new, "srv", ("127.0.0.1", 0), accepted_key=old)
    server.start()
    try:
        for key in (old, new):  # a peer not yet switched, and one already switched
            with TransferClient(key, "peer", server.address) as c:
                assert c.call({"op": "has", "job": "9", "digests": []})[0]["missing"] == []
        with pytest.raises(TransferError, match="failed authentication"):
            TransferClient(secrets.token_bytes(32), "intruder", server.address)
    finally:
        server.stop()
    # without the accepted key the old one is refused
    server = TransferServer(store, new, "srv", ("127.0.0.1", 0))
    server.start()
    try:
        with pytest.raises(TransferError, match="failed authentication"):
            TransferClient(old, "peer", server.address)
    finally:
        server.stop()


def test_large_frames_of_incompressible_chunks_round_trip(served, tmp_path: Path) -> None:
    """Frames of a MiB and more are received into anonymous maps (both the server's put
    and the client's get): the chunks come back byte for byte."""
    server, _ = served
    mine = LocalCheckpoints(ChunkStore(tmp_path / "client"))
    state = np.frombuffer(np.random.default_rng(5).bytes(6 << 20), np.uint8)
    s, _ = mine.begin("9", 0, 1, None)
    m, _ = encode_state(state, job="9", rank=0, epoch=1, params=CodecParams(),
                        previous=None, sink=lambda p: mine.ingest(s, p.fd))
    mine.finish(s, m, 1)
    mine.end(s)
    m = m.with_generation(1)
    with TransferClient(KEY, "c", server.address) as c:
        assert c.push(mine.store, m).ok
        got = {d: bytes(stored) for d, _, stored in
               c.fetch("9", sorted(m.digests()), dict(m.chunks))}
    assert got.keys() == m.digests()
    assert all(got[d] == bytes(mine.store.read("9", d)) for d in got)
    assert all(got[d][0] == 0 for d in got)  # stored raw: noise does not compress
    still_serves(server)


def test_verify_chunk_checks_raw_and_compressed_chunks() -> None:
    noise = np.random.default_rng(3).bytes(4096)
    name = blake3.blake3(noise).hexdigest()
    raw = b"\x00" + noise
    dec = Decoder()
    assert verify_chunk("blake3", name, len(noise), raw, dec) is None
    flipped = bytearray(raw)
    flipped[100] ^= 1
    assert verify_chunk("blake3", name, len(noise), bytes(flipped), dec) == \
        "content does not match its digest"
    assert "raw chunk of 4096 bytes, expected 4095" in str(
        verify_chunk("blake3", name, len(noise) - 1, raw, dec))
    text = b"abc" * 2000
    packed = b"\x01" + zstandard.ZstdCompressor().compress(text)
    assert verify_chunk("blake3", blake3.blake3(text).hexdigest(), len(text), packed,
                        dec) is None
    assert verify_chunk("blake3", name, len(text), packed, dec) == \
        "content does not match its digest"


def _segment(dst: int, seq: int) -> bytes:
    body = f"m{dst}-{seq}".encode()
    return b"".join(Entry(dst, seq, 1, len(body), checksum(body), False, body)
                    .record(True))


def test_log_put_stores_a_batch_of_segments(served) -> None:
    server, _ = served
    segs = [(3, _segment(1, 1)), (4, _segment(1, 2)), (7, _segment(2, 1))]
    with TransferClient(KEY, "c", server.address) as c:
        reply, _ = c.call({"op": "log_put", "job": "9", "rank": 0,
                           "segs": [[n, len(d)] for n, d in segs]}, b"".join(d for _, d in segs))
        assert reply["segs"] == [3, 4, 7]
        assert c.call({"op": "log_have", "job": "9", "rank": 0})[0]["segments"] == [3, 4, 7]
        got, body = c.call({"op": "log_get", "job": "9", "rank": 0})
        assert bytes(body) == b"".join(d for _, d in segs)
        assert got["segments"] == [[n, 0, len(d), len(d)] for n, d in segs]
        assert got["more"] is False
        # the same copy again is accepted; other bytes under a stored number are not
        c.call({"op": "log_put", "job": "9", "rank": 0, "segs": [[3, len(segs[0][1])]]},
               segs[0][1])
        with pytest.raises(TransferError, match="already stored with other bytes"):
            c.call({"op": "log_put", "job": "9", "rank": 0, "segs": [[4, len(segs[0][1])]]},
                   segs[0][1])


@pytest.mark.parametrize("segs, msg", [
    (None, "expected 1..4096"),
    ([], "expected 1..4096"),
    ([[1, 5]] * 4097, "expected 1..4096"),
    ([[1]], "pairs"),
    ([[0, 5]], "pairs"),
    ([[1, -1]], "pairs"),
    ([[1, True]], "pairs"),
    ([[2, 1], [1, 1]], "must ascend"),
    ([[1, 3]], "sizes add up to 3, the body has"),
])
def test_malformed_log_put_is_refused_and_stores_nothing(served, segs, msg: str) -> None:
    server, _ = served
    data = _segment(1, 1)
    with TransferClient(KEY, "c", server.address) as c:
        with pytest.raises(TransferError, match=msg):
            c.call({"op": "log_put", "job": "9", "rank": 0, "segs": segs}, data)
        assert c.call({"op": "log_have", "job": "9", "rank": 0})[0]["segments"] == []
    still_serves(server)
