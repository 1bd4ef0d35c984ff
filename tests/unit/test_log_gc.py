"""The sender's log and the garbage collector: entries held until a checkpoint covers
them (millions at the shipped 600 s interval) are out of the cyclic collector's sight
with the compiled module, and stay whole and reachable through collections; the
fallback keeps them in sight, with the same contents."""

from __future__ import annotations

import gc

import pytest

from raps_slurm.runtime import msglog
from raps_slurm.runtime.arena import Arena
from raps_slurm.runtime.msglog import ARENA_AT, SenderLog, checksum
from raps_slurm.wire import datapath


@pytest.fixture(params=["compiled", "python"])
def untracks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the log takes its entries out of the collector's sight."""
    if request.param == "python":
        monkeypatch.setattr(msglog, "untrack", datapath._tracked)
        return False
    if datapath._compiled is None:
        pytest.fail("raps_slurm.wire._datapath is not built (pip install -e .)")
    assert msglog.untrack is datapath._compiled.untrack
    return True


def _fill(log: SenderLog, n: int) -> list[bytes]:
    bodies = [f"message {i}".encode() * 3 for i in range(n)]
    for i, body in enumerate(bodies):
        log.append(1 + i % 3, body, 1)
    return bodies


def test_held_small_messages_are_no_objects_and_survive_collections(untracks: bool) -> None:
    log = SenderLog(large_threshold=1 << 20, high_watermark=1 << 30, own=0)
    before = len(gc.get_objects())
    bodies = _fill(log, 3000)
    batch, _ = log.take_unpersisted()
    log.persisted(batch)
    grown = len(gc.get_objects()) - before
    assert log.count() == 3000
    # rows in arrays and bodies in chunks: a few objects per peer, none per message
    assert grown < 100, f"{grown} more objects tracked after logging 3000 messages"
    assert gc.is_tracked(log._aged) is not untracks
    gc.collect()
    for dst in (1, 2, 3):  # a resend after collections finds every body, in order
        got = log.after(dst, 0)
        assert [e.body for e in got] == bodies[dst - 1::3]
        assert [e.seq for e in got] == list(range(1, 1001))
        assert all(e.crc == checksum(e.body) for e in got)


def test_an_arena_body_outlives_collections_while_only_an_untracked_entry_holds_it(
        untracks: bool) -> None:
    log = SenderLog(large_threshold=1 << 20, high_watermark=1 << 30,
                    arena=Arena(16 << 20), own=0)
    data = bytearray(range(256)) * (ARENA_AT // 256 + 1)
    e = log.append(2, memoryview(data), 1)
    assert isinstance(e.body, memoryview) and e.slot is not None
    assert gc.is_tracked(e) is not untracks
    data[:] = bytes(len(data))  # the application reuses its buffer
    del data
    gc.collect()
    (again,) = log.after(2, 0)
    assert again is e
    assert bytes(again.body[:4]) == bytes([0, 1, 2, 3])
    assert checksum(again.body) == again.crc


def test_a_restored_log_is_out_of_sight_as_well(untracks: bool) -> None:
    log = SenderLog(large_threshold=1 << 20, high_watermark=1 << 30, own=0)
    _fill(log, 30)
    batch, records = log.take_unpersisted()
    log.persisted(batch)
    blob = b"".join(bytes(p) for rec in records for p in rec)
    restored = SenderLog(large_threshold=1 << 20, high_watermark=1 << 30, own=0)
    restored.reload(msglog.parse_records(blob), log.sent_vector(), {}, {})
    entries = [e for dst in (1, 2, 3) for e in restored.after(dst, 0)]
    assert len(entries) == 30 and all(e.body is None for e in entries)  # metadata only
    assert all(gc.is_tracked(e) is not untracks for e in entries)
    assert gc.is_tracked(restored._aged) is not untracks
