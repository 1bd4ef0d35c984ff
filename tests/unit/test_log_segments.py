"""The message log's writes to its store: records grouped into segments under the
store's size bound (a spill of more than one segment's worth used to fail at every
flush), a batch whose write failed written again by the next flush, a logged message
always fits one segment, parts go to a sealed memory file
without a joining copy, and a large frame's payload is handed on without a copy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raps_slurm.checkpoint.logstore import MAX_SEGMENT
from raps_slurm.checkpoint.pack import IOV_MAX, sealed_parts
from raps_slurm.runtime.context import Settings
from raps_slurm.runtime.frames import DATA, MAX_MESSAGE, decode, encode
from raps_slurm.runtime.msglog import RECORD, checksum, parse_records, segments
from raps_slurm.runtime.ports import LocalPort
from raps_slurm.testing.ranks import PARAMS, local_pair


def _rec(n: int, fill: int) -> list[bytes | memoryview]:
    return [bytes([fill]) * 3, bytes([fill]) * (n - 3)]


def test_segments_keep_order_never_split_a_record_and_stay_under_the_limit() -> None:
    records = [_rec(n, i) for i, n in enumerate([40, 40, 30, 100, 5, 60, 60, 60])]
    segs = list(segments(records, 100))
    sizes = [sum(len(p) for p in seg) for seg in segs]
    assert sizes == [80, 30, 100, 65, 60, 60]
    assert b"".join(b"".join(s) for s in segs) == b"".join(b"".join(r) for r in records)
    assert list(segments([], 100)) == []


def test_a_logged_message_fits_one_log_segment() -> None:
    assert Settings().max_message == MAX_MESSAGE == MAX_SEGMENT - RECORD.size


def test_checksum_is_crc32c() -> None:
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert checksum(memoryview(bytearray(b"123456789"))) == 0xE3069283


def test_a_spill_larger_than_a_segment_is_written_as_several(tmp_path: Path) -> None:
    s = Settings(flush_ms=5000, large_threshold=1024, high_watermark=256 << 10,
                 buffer_bytes=512 << 10, recv_timeout=30.0)
    with local_pair(tmp_path, s) as (a, b):
        a.segment_limit = 20 << 10  # five 4 KiB records a segment
        sent = [bytes([i]) * 4096 for i in range(60)]
        for m in sent:
            a.send(1, m)
        a._spill(0)  # every body out of memory: 240 KiB in one plan
        assert a.log.held == 0
        seg_dir = tmp_path / "logs"
        files = [f for f in seg_dir.rglob("*.seg")]
        assert len(files) >= 12, files
        assert max(f.stat().st_size for f in files) <= a.segment_limit
        bodies = {e.seq: e.body for e in parse_records(a.port.log_read()) if e.body}
        assert [bodies[i + 1] for i in range(60)] == sent
        # A resend now comes from the store: the receiver still gets every message.
        assert [b.recv(0) for _ in range(60)] == sent


def test_sealed_parts_writes_more_parts_than_one_writev_takes() -> None:
    parts: list[bytes | memoryview] = [bytes([i % 251]) * (i % 7 + 1) for i in range(3 * IOV_MAX)]
    parts.append(memoryview(bytearray(b"tail")))
    fd = sealed_parts(parts, "test")
    try:
        want = b"".join(parts)
        assert os.pread(fd, len(want) + 1, 0) == want
    finally:
        os.close(fd)


def test_a_large_frame_payload_is_a_view_a_small_one_a_copy() -> None:
    payload = os.urandom(1 << 16)
    body = bytearray(b"".join(encode(DATA, 1, 2, 3, 4, payload)))
    owned = decode(body, owned=True)
    assert isinstance(owned.payload, memoryview) and owned.payload == payload
    copied = decode(body, owned=False)
    assert isinstance(copied.payload, bytes) and copied.payload == payload
    body[-1] ^= 1  # the caller's buffer changes: only the view sees it
    assert copied.payload == payload and owned.payload != payload


def test_recv_returns_bytes_for_a_large_message(tmp_path: Path) -> None:
    s = Settings(flush_ms=20, large_threshold=1024, high_watermark=8 << 20,
                 buffer_bytes=16 << 20, recv_timeout=30.0)
    with local_pair(tmp_path, s) as (a, b):
        a.send(1, b"x" * (1 << 20))  # past the reader's buffer: read into its own
        a.send(1, b"y" * 10)
        got = [b.recv(0), b.recv(0)]
        assert got == [b"x" * (1 << 20), b"y" * 10]
        assert all(type(m) is bytes for m in got)


class _FailingOnce(LocalPort):
    """A local port whose log store refuses its first write (as a full disk would)."""

    failed = 0

    def log_append(self, parts: list[bytes | memoryview]) -> None:
        if not self.failed:
            self.failed += 1
            raise OSError("no space left on device")
        super().log_append(parts)


def test_a_failed_log_write_is_written_again_by_the_next_flush(tmp_path: Path) -> None:
    s = Settings(flush_ms=5000, large_threshold=1 << 20, high_watermark=8 << 20,
                 buffer_bytes=16 << 20, recv_timeout=30.0)
    port = _FailingOnce(tmp_path, "1", 0, 1, PARAMS)
    with local_pair(tmp_path, s, port) as (a, b):
        sent = [bytes([i]) * 100 for i in range(5)]
        for m in sent:
            a.send(1, m)
        a.record(b"a determinant")  # flushed with its body (messages: metadata only)
        with pytest.raises(OSError, match="no space"):
            a._flush()
        assert port.failed == 1 and port.log_read() == b""
        a._flush()
        got = {(e.dst, e.seq): e for e in parse_records(port.log_read())}
        assert [(got[(1, i + 1)].crc, got[(1, i + 1)].body) for i in range(5)] == [
            (checksum(m), None) for m in sent]
        assert got[(0, 1)].body == b"a determinant"
        assert all(e.persisted for e in a.log.entries[1])
        assert [b.recv(0) for _ in range(5)] == sent


def test_a_flush_writes_a_run_of_metadata_records_as_one_part() -> None:
    """A part per record cost a writev entry and a pass of the segmenting and framing
    checks each: 1,250 records a flush at 4 KiB ping-pong pace took 3-4 ms of CPU. A run
    of metadata records is one part (at most HEADS_PER_PART records); a determinant, with
    its body, ends a run; the bytes are the same records in the same order."""
    from raps_slurm.runtime.msglog import HEADS_PER_PART, SenderLog
    log = SenderLog(large_threshold=1 << 20, high_watermark=1 << 30, own=0)
    for i in range(HEADS_PER_PART + 10):
        log.append(1, b"m%d" % i, 1)
    log.append(0, b"determinant", 1)
    log.append(2, b"after", 1)
    batch, records = log.take_unpersisted()
    assert [len(r) for r in records] == [1, 1, 2, 1]
    assert [sum(len(p) for p in r) // RECORD.size for r in (records[0], records[1], records[3])] \
        == [HEADS_PER_PART, 10, 1]
    parsed = list(parse_records(b"".join(b"".join(bytes(p) for p in r) for r in records)))
    assert [(e.dst, e.seq, e.crc, e.body) for e in parsed] == [
        (e.dst, e.seq, e.crc, e.body if e.dst == 0 else None) for e in batch]


def test_runs_join_small_records_and_keep_large_ones_and_the_bytes() -> None:
    """A spill's records of small bodies go as runs of one part each (a part per record
    cost the write path Python work per message), at most ``most`` bytes, in order; a
    record of ARENA_AT bytes or more stays as it is; the bytes are the same."""
    from raps_slurm.runtime.msglog import ARENA_AT, runs
    records = [_rec(100, i) for i in range(30)]
    records[10] = _rec(ARENA_AT, 10)
    records[20] = [memoryview(bytes([20]) * 3), bytes([20]) * 97]
    out = list(runs(records, 1000))
    assert [len(r) for r in out] == [1, 2, 1, 1]
    assert out[1] == records[10]  # as it was: no copy of a large body
    assert [sum(len(p) for p in r) for r in out] == [1000, ARENA_AT, 1000, 900]
    assert b"".join(b"".join(bytes(p) for p in r) for r in out) == \
        b"".join(b"".join(bytes(p) for p in r) for r in records)
    assert list(runs([])) == []


def test_a_spill_takes_the_oldest_bodies_first_and_collected_ones_do_not_pile_up() -> None:
    """Bodies go oldest first, in the order they were sent to whichever peer; entries
    collected without a spill are forgotten by the spill's queue as the log goes on."""
    from raps_slurm.runtime.msglog import SenderLog
    log = SenderLog(large_threshold=1 << 20, high_watermark=10_000, own=0)
    for i in range(12):
        log.append(1 + i % 3, bytes([i]) * 1000, 1)
    batch, _ = log.take_unpersisted()
    log.persisted(batch)
    for e in batch:
        e.body_persisted = True  # as a spill's write does
    assert log.spill(6000) == 6000
    assert [e.body is None for e in batch] == [True] * 6 + [False] * 6
    for dst in (1, 2, 3):
        log.raise_floor(dst, log.sent[dst])  # every entry collected: no spill needed
    for i in range(20_000):
        log.append(1, b"x", 1)
        log.persisted(log.take_unpersisted()[0])
        if i % 2:
            log.raise_floor(1, log.sent[1] - 1)  # all but the newest collected
    assert log._bodies == sum(e.body is not None for e in log._aged) == 1
    assert len(log._aged) <= 2 * log._bodies + 4096 + 1
