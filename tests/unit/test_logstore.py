"""The message-log segment store on a local directory: numbering by epoch, refused
collisions, trims that keep the numbering's high mark, and a segment's pages leaving the
page cache once it is on disk (a cold store) or copied (``drop_pages``), and spill
segments stored without fsync and left out of reads once torn."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

from raps_slurm.checkpoint.logstore import LogStore, LogStoreError
from raps_slurm.runtime.msglog import Entry, checksum


def seg(dst: int, *seqs: int) -> bytes:
    out = []
    for seq in seqs:
        body = b"m%d" % seq
        out.extend(bytes(p) for p in Entry(dst, seq, 1, len(body), checksum(body), False,
                                           body).record(with_body=True))
    return b"".join(out)


def test_numbers_grow_within_and_across_epochs(tmp_path: Path) -> None:
    logs = LogStore(tmp_path)
    assert logs.append("7", 0, seg(1, 1)) == 1
    assert logs.append("7", 0, seg(1, 2), epoch=3) == (3 << 32) + 1
    assert logs.append("7", 0, seg(1, 3), epoch=3) == (3 << 32) + 2
    # an older epoch still flushing (fenced, not yet stopped) numbers above everything here
    assert logs.append("7", 0, seg(1, 4), epoch=2) == (3 << 32) + 3
    assert logs.segments("7", 0) == [1, (3 << 32) + 1, (3 << 32) + 2, (3 << 32) + 3]


def test_a_copy_with_other_bytes_under_an_existing_number_is_refused(tmp_path: Path) -> None:
    logs = LogStore(tmp_path)
    logs.append("7", 0, seg(1, 1, 2), number=5)
    assert logs.append("7", 0, seg(1, 1, 2), number=5) == 5  # the same copy again: kept
    with pytest.raises(LogStoreError, match="segment 5 of rank 0 of job 7 is already stored "
                                            "with other bytes"):
        logs.append("7", 0, seg(1, 1, 3), number=5)
    assert logs.segment("7", 0, 5) == seg(1, 1, 2)


def test_trim_keeps_the_newest_segment_so_numbers_never_restart(tmp_path: Path) -> None:
    logs = LogStore(tmp_path)
    for s in range(1, 5):
        logs.append("7", 0, seg(1, s))
    assert logs.trim("7", 0, {1: 10}) == 3
    assert logs.segments("7", 0) == [4]
    assert logs.append("7", 0, seg(1, 11)) == 5
    assert logs.trim("7", 0, {1: 3}) == 0  # segment 4 holds seq 4, above the floor


def test_a_malformed_segment_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LogStoreError, match="malformed log segment"):
        LogStore(tmp_path).append("7", 0, b"\x00" * 7)


def _resident(path: Path) -> int:
    """Bytes of ``path`` in the page cache (mincore over a private mapping)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        head = ctypes.c_char.from_buffer(m)
        vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(head)), ctypes.c_size_t(size),
                        vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        del head
        return sum(v & 1 for v in vec) * mmap.PAGESIZE
    finally:
        m.close()


def _big_segment(dst: int = 0) -> bytes:
    """One record of 1 MiB to ``dst`` (rank 0's own: a determinant, fsync'ed)."""
    body = os.urandom(1 << 20)
    return b"".join(bytes(p) for p in Entry(dst, 1, 1, len(body), checksum(body), True,
                                            body).record(with_body=True))


def test_a_cold_store_leaves_its_segments_out_of_the_page_cache(tmp_path: Path) -> None:
    hot, cold = LogStore(tmp_path / "hot"), LogStore(tmp_path / "cold", cold=True)
    data = _big_segment()
    n_hot, n_cold = hot.append("7", 0, data), cold.append("7", 0, data)
    hot_file = tmp_path / "hot" / "job-7" / "logs" / "0" / f"{n_hot}.seg"
    cold_file = tmp_path / "cold" / "job-7" / "logs" / "0" / f"{n_cold}.seg"
    # the project's machines keep /tmp on a disk file system, whose written pages stay
    # cached: without that, nothing here could tell a dropped page from one never kept
    assert _resident(hot_file) > 0, f"{tmp_path} keeps no written pages cached"
    assert _resident(cold_file) == 0
    hot.drop_pages("7", 0, n_hot)  # the copy lane, once the backup holds it
    assert _resident(hot_file) == 0
    assert hot.segment("7", 0, n_hot) == cold.segment("7", 0, n_cold) == data
    hot.drop_pages("7", 0, n_hot + 5)  # gone or never there: nothing to do


def _meta(dst: int, seq: int) -> bytes:
    return b"".join(bytes(p) for p in Entry(dst, seq, 1, 5, 0, False, None).record(
        with_body=False))


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The descriptors os.fsync was called with (it still syncs)."""
    calls: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return calls


@pytest.mark.parametrize("cold", [False, True])
def test_only_a_spill_segment_is_stored_without_fsync(tmp_path: Path, fsyncs: list[int],
                                                      cold: bool) -> None:
    logs = LogStore(tmp_path, cold=cold)
    spill, own = _big_segment(dst=1), _big_segment(dst=0)
    stored = {}
    for name, data in [("spill", spill), ("determinant", own),
                       ("metadata", _meta(1, 2)), ("mixed", spill + _meta(1, 3))]:
        before = len(fsyncs)
        n = logs.append("7", 0, data)
        stored[name] = (n, len(fsyncs) - before)
        assert logs.segment("7", 0, n) == data
    assert {k: v[1] > 0 for k, v in stored.items()} == {
        "spill": False, "determinant": True, "metadata": True, "mixed": True}
    # a backup's copy in pieces: the same rule
    before = len(fsyncs)
    assert LogStore(tmp_path / "b").put_part("7", 0, 9, 0, len(spill), spill)
    assert len(fsyncs) == before + 1  # the directory's rename only
    assert LogStore(tmp_path / "b").segment("7", 0, 9) == spill


def test_a_torn_spill_segment_is_left_out_of_reads(tmp_path: Path) -> None:
    logs = LogStore(tmp_path)
    first = logs.append("7", 0, _meta(1, 1))
    spill = logs.append("7", 0, seg(1, 2, 3))
    last = logs.append("7", 0, seg(0, 4))
    d = tmp_path / "job-7" / "logs" / "0"
    whole = (d / f"{spill}.seg").read_bytes()
    for cut in (0, 10, len(whole) - 1):  # as a crash of the kernel may leave it
        (d / f"{spill}.seg").write_bytes(whole[:cut])
        assert logs.torn("7", 0, spill) == (cut > 0)
        assert logs.read("7", 0) == _meta(1, 1) + seg(0, 4)
    (d / f"{spill}.seg").write_bytes(whole)
    assert not logs.torn("7", 0, spill)
    assert logs.read("7", 0) == _meta(1, 1) + whole + seg(0, 4)
    # a cut segment of another kind was fsync'ed: never left out, its reader fails loudly
    (d / f"{last}.seg").write_bytes(seg(0, 4)[:-1])
    assert not logs.torn("7", 0, last)
    assert logs.read("7", 0, after=spill) == seg(0, 4)[:-1]
    assert logs.segments("7", 0) == [first, spill, last]


def test_numbering_lists_the_directory_once_and_again_only_when_the_number_is_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush every 100 ms listed the whole directory to number its segment: 12.7 ms of
    CPU at 6,000 segments (600 s between checkpoints). The store lists it once, then
    numbers above the highest it wrote; a number another writer took sends it back to
    the listing."""
    logs = LogStore(tmp_path)
    listed: list[int] = []
    real = LogStore.segments
    monkeypatch.setattr(LogStore, "segments",
                        lambda self, job, rank: listed.append(1) or real(self, job, rank))
    assert [logs.append("7", 0, seg(1, s)) for s in range(1, 6)] == [1, 2, 3, 4, 5]
    assert len(listed) == 1
    assert logs.append("7", 0, seg(1, 6), number=9) == 9  # a copy: numbers go above it
    assert logs.append("7", 0, seg(1, 7)) == 10
    other = LogStore(tmp_path)  # not the only writer: its segment takes number 11
    assert other.append("7", 0, seg(1, 8)) == 11
    assert logs.append("7", 0, seg(1, 9), epoch=0) == 12
    assert real(logs, "7", 0) == [1, 2, 3, 4, 5, 9, 10, 11, 12]
    assert logs.segment("7", 0, 11) == seg(1, 8)  # not overwritten
