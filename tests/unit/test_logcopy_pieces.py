"""Log segments larger than one transfer frame: copied to the log backup in pieces and
pulled back page by page, against a real transfer server."""

from __future__ import annotations

import os
import queue
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.logcopy import LogCopier
from raps_slurm.checkpoint.logstore import LogStore, LogStoreError
from raps_slurm.checkpoint.transfer import (
    BATCH_BYTES,
    TokenBucket,
    TransferClient,
    TransferError,
    TransferServer,
)
from raps_slurm.checkpoint.transfer_wire import MAX_FRAME
from raps_slurm.model import BackupGroup
from raps_slurm.runtime.msglog import Entry, checksum

KEY = secrets.token_bytes(32)


def _segment(dst: int, seq: int, size: int) -> bytes:
    body = bytes([seq % 251]) * size
    return b"".join(Entry(dst, seq, 1, len(body), checksum(body), False, body).record(True))


@pytest.fixture
def backup(tmp_path: Path) -> Iterator[TransferServer]:
    server = TransferServer(ChunkStore(tmp_path / "backup"), KEY, "b", ("127.0.0.1", 0),
                            max_generations=2)
    server.start()
    yield server
    server.stop()


def _copier(root: Path, node: str, backup: TransferServer) -> LogCopier:
    group = BackupGroup(rank=0, primary="p", log_backup="b")
    return LogCopier(node, KEY, LogStore(root), lambda job, rank: group,
                     lambda: {"b": backup.address}, TokenBucket(0), max_lag=0.0)


def _drain(q: queue.Queue) -> None:
    while not q.empty():
        work = q.get_nowait()
        if work is not None:
            work()


def test_a_segment_larger_than_a_frame_is_backed_and_pulled_back(tmp_path, backup) -> None:
    big = _segment(1, 2, MAX_FRAME + (3 << 20))  # one message: one segment, over a frame
    small = [_segment(1, 1, 1000), _segment(1, 3, 5000), _segment(2, 1, 10)]
    primary = _copier(tmp_path / "p", "p", backup)
    numbers = [primary.logs.append("9", 0, d) for d in (small[0], big, *small[1:])]
    primary.kick("9", 0)
    _drain(primary.queue)
    assert primary.wait_backed("9", 0, numbers[-1], timeout=0)
    assert backup.logs.segments("9", 0) == numbers
    assert backup.logs.segment("9", 0, numbers[1]) == big
    assert not list((tmp_path / "backup" / "job-9" / "tmp").glob(".part-*"))

    spare = _copier(tmp_path / "s", "s", backup)  # a spare reloads the log, page by page
    assert spare.read("9", 0) == small[0] + big + small[1] + small[2]
    assert spare.logs.segments("9", 0) == numbers
    primary.close()
    spare.close()


def test_log_get_pages_stay_within_a_frame(backup) -> None:
    sizes = [5 << 20, 9 << 20, 40 << 20, 1 << 20]
    segs = [_segment(1, i + 1, n) for i, n in enumerate(sizes)]
    for i, d in enumerate(segs):
        backup.logs.append("9", 0, d, number=i + 1)
    pages = []
    with TransferClient(KEY, "c", backup.address) as c:
        cursor = [0, 0]
        while True:
            reply, body = c.call({"op": "log_get", "job": "9", "rank": 0, "from": cursor})
            assert len(body) <= BATCH_BYTES
            pages.append([item[:3] for item in reply["segments"]])
            n, off, size, total = reply["segments"][-1]
            cursor = [n + 1, 0] if off + size == total else [n, off + size]
            if not reply["more"]:
                break
    whole = lambda i: [i + 1, 0, len(segs[i])]  # noqa: E731
    assert pages == [[whole(0), whole(1)],
                     [[3, 0, BATCH_BYTES]], [[3, BATCH_BYTES, BATCH_BYTES]],
                     [[3, 2 * BATCH_BYTES, len(segs[2]) - 2 * BATCH_BYTES], whole(3)]]


@pytest.mark.parametrize("part, body, msg", [
    ([1, 0], b"x", "field .part.: expected"),
    ([0, 0, 5], b"x", "field .part.: expected"),
    ([1, 0, 3], b"xxxx", "outside the segment's 3 bytes"),
    ([1, 5, 8], b"xx", "0 bytes are held"),
    ([1, 0, (256 << 20) + 1], b"x", "expected 1.."),
    ([1, 0, 8], b"", "outside the segment"),
])
def test_malformed_pieces_are_refused_and_store_nothing(backup, part, body, msg) -> None:
    with TransferClient(KEY, "c", backup.address) as c:
        with pytest.raises(TransferError, match=msg):
            c.call({"op": "log_put", "job": "9", "rank": 0, "part": part}, body)
        assert c.call({"op": "log_have", "job": "9", "rank": 0})[0]["segments"] == []


def test_a_piece_out_of_order_is_refused_and_a_copy_starts_over(tmp_path) -> None:
    logs = LogStore(tmp_path)
    seg = _segment(1, 1, 100)
    assert not logs.put_part("9", 0, 4, 0, len(seg), seg[:50])
    with pytest.raises(LogStoreError, match="50 bytes are held"):
        logs.put_part("9", 0, 4, 60, len(seg), seg[60:])
    assert not logs.put_part("9", 0, 4, 0, len(seg), seg[:10])  # starts over
    assert logs.put_part("9", 0, 4, 10, len(seg), seg[10:])
    assert logs.segment("9", 0, 4) == seg
    bad = bytearray(seg)
    bad[-1] ^= 1
    assert not logs.put_part("9", 0, 5, 0, len(bad), bytes(bad[:3]))
    with pytest.raises(LogStoreError):  # a damaged copy of a stored number is refused
        logs.put_part("9", 0, 4, 0, len(bad), bytes(bad))
    assert logs.segment("9", 0, 4) == seg
    assert logs.put_part("9", 0, 4, 0, len(seg), seg)  # the same bytes again: kept
    junk = b"\xff" * 64
    with pytest.raises(LogStoreError, match="malformed log segment"):
        logs.put_part("9", 0, 6, 0, len(junk), junk)
    assert logs.segments("9", 0) == [4]
    held = sorted(p.name for p in (tmp_path / "job-9" / "tmp").iterdir())
    assert held == [".part-0-5"]  # only the unfinished copy's pieces


@pytest.mark.parametrize("cursor", [[1], "x", [0, -1], [True, 0]])
def test_malformed_log_get_cursor_is_refused(backup, cursor) -> None:
    with TransferClient(KEY, "c", backup.address) as c, \
            pytest.raises(TransferError, match="field 'from'"):
        c.call({"op": "log_get", "job": "9", "rank": 0, "from": cursor})


def test_a_spare_fetches_the_log_onto_its_disk_and_log_read_never_holds_it_whole(
        tmp_path, backup) -> None:
    """A rank on a spare reads a log its node does not hold: it is pulled onto the
    spare's disk page by page (nothing returned), and ``log_read`` copies it from there
    a piece at a time, charged first: a log larger than the uid's share is refused
    before any of it is copied."""
    from raps_slurm.agent.msg_api import copy_log
    from raps_slurm.agent.uid_limits import LOG, UidLimits
    from raps_slurm.errors import Refused

    segs = [_segment(1, i + 1, n) for i, n in enumerate((3 << 20, 70 << 20, 5000))]
    for i, d in enumerate(segs):
        backup.logs.append("9", 0, d, number=i + 1)
    spare = _copier(tmp_path / "s", "s", backup)
    assert spare.fetch("9", 0) is True
    assert spare.logs.segments("9", 0) == [1, 2, 3]
    whole = sum(len(d) for d in segs)
    limits = UidLimits(1, 1, memory_bytes=whole - 1)
    with limits.op(LOG, 1000, "log_read") as charge, pytest.raises(Refused) as e:
        copy_log(spare.logs, "9", 0, charge)
    assert e.value.kind == "quota" and limits.held(1000) == 0
    limits = UidLimits(1, 1, memory_bytes=whole)
    with limits.op(LOG, 1000, "log_read") as charge:
        fd, size = copy_log(spare.logs, "9", 0, charge)
    try:
        assert size == whole and os.pread(fd, 64, len(segs[0]) + len(segs[1])) == segs[2][:64]
    finally:
        os.close(fd)
    nowhere = _copier(tmp_path / "n", "n", backup)
    assert nowhere.fetch("9", 1) is False and nowhere.read("9", 1) == b""
    spare.close()
    nowhere.close()


def test_passes_to_a_known_backup_copy_fresh_segments_without_listing_the_directory(
        tmp_path: Path, backup: TransferServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """With checkpoints minutes apart a rank keeps thousands of segments, and every flush
    listed them all to find what to copy (12.7 ms of CPU at 6,000). The first pass to a
    backup lists the directory; later ones copy the segments appended since, in order,
    and the backup ends with every one."""
    primary = _copier(tmp_path / "p", "p", backup)
    listed: list[str] = []
    real = LogStore.segments
    monkeypatch.setattr(LogStore, "segments", lambda self, job, rank: (
        listed.append(str(self.root)), real(self, job, rank))[1])
    numbers = []
    for seq in range(1, 41):
        numbers.append(primary.append("9", 0, _segment(1, seq, 100)))
        if seq % 3 == 0:  # passes find one to three new segments each
            _drain(primary.queue)
    _drain(primary.queue)
    assert primary.wait_backed("9", 0, numbers[-1], timeout=0)
    assert real(backup.logs, "9", 0) == numbers == list(range(1, 41))
    # once each: the store's first numbering, the copier's first sight, the first pass
    assert listed.count(str(tmp_path / "p")) == 3
    primary.close()
