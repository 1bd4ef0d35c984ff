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
from raps_slurm.runtime.lanes import FIRST_CHUNK, ROW_BYTES
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
        assert a.log.held == 60 * ROW_BYTES  # a large message's row stays
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
        assert all(e.persisted for e in a.log.after(1, 0))
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
        (1, i + 1, checksum(b"m%d" % i), None) for i in range(HEADS_PER_PART + 10)] + [
        (0, 1, checksum(b"determinant"), b"determinant"), (2, 1, checksum(b"after"), None)]
    assert [(lane.dst, lo, hi) for lane, lo, hi in batch] == [
        (1, 1, HEADS_PER_PART + 10), (0, 1, 1), (2, 1, 1)]


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


def test_a_spill_writes_the_oldest_chunks_whole_then_drops_them_with_their_rows() -> None:
    """A spill plans durable chunks oldest first (in the order they were made, whichever
    peer), writes each message of them with its body, and once written drops the chunk
    and its rows: those messages are then only in the log store (a resend reads them
    there). A planned chunk takes no more bodies."""
    from raps_slurm.runtime.msglog import SenderLog
    log = SenderLog(large_threshold=1 << 20, high_watermark=1 << 30, own=0)
    for i in range(12):
        log.append(1 + i % 3, bytes([i]) * 1000, 1)
    assert log.held == 3 * FIRST_CHUNK + 12 * ROW_BYTES  # a chunk of 4 bodies per peer
    assert log.spill_plan(0) == []  # nothing durable yet
    log.persisted(log.take_unpersisted()[0])
    plan = log.spill_plan(log.held - 1)  # one chunk is enough: the oldest, rank 1's
    assert [c.dst for c in plan] == [1]  # type: ignore[union-attr]
    data = b"".join(bytes(p) for r in log.spill_records(plan) for p in r)
    assert [(e.dst, e.seq, e.body) for e in parse_records(data)] == [
        (1, k + 1, bytes([3 * k]) * 1000) for k in range(4)]
    assert log.spill(log.held - 1) == 0  # not written yet: nothing goes
    log.spill_written(plan)
    assert log.spill(log.held - 1) == FIRST_CHUNK + 4 * ROW_BYTES
    assert log.held == 2 * FIRST_CHUNK + 8 * ROW_BYTES and log.spilled == 4
    assert [(e.seq, e.body) for e in log.after(1, 0)] == [(k + 1, None) for k in range(4)]
    assert log.held_range(1) == [1, 4] and log.count() == 12
    e = log.append(1, b"new", 1)  # into a new chunk, twice the lane's last one
    assert bytes(e.body) == b"new" and log.held == 4 * FIRST_CHUNK + 9 * ROW_BYTES
    assert [(x.seq, x.body) for x in log.after(1, 3)] == [(4, None), (5, b"new")]
    log.persisted(log.take_unpersisted()[0])
    assert log.raise_floor(1, 5) == 5  # the store's four and the new one
    assert log.held == 2 * FIRST_CHUNK + 8 * ROW_BYTES and log.held_range(1) is None


def test_collected_chunks_do_not_pile_up_in_the_spill_queue() -> None:
    from raps_slurm.runtime.msglog import SenderLog
    log = SenderLog(large_threshold=1 << 20, high_watermark=1 << 30, own=0)
    for i in range(20_000):
        log.append(1 + i % 2, b"x" * 3000, 1)
        log.persisted(log.take_unpersisted()[0])
        if i % 2:
            for dst in (1, 2):  # all but the newest collected
                log.raise_floor(dst, log.sent[dst] - 1)
    live = [c for lane in log.lanes.values() for c in lane.chunks]
    assert 1 <= len(live) <= 2 and log._live == len(live)
    assert len(log._aged) <= 2 * log._live + 4096 + 1
    assert log.held == sum(len(c.buf) for c in live) + log.count() * ROW_BYTES
