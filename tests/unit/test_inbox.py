"""The receiver's bookkeeping and the sender's resend lookup: only seqs that have not
arrived are a gap (messages waiting for the application to take them are not), and a
resend finds its entries by bisection, holes from a reload included."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from raps_slurm.runtime.context import Context, Settings
from raps_slurm.runtime.inbox import Inbox
from raps_slurm.runtime.lanes import FIRST_CHUNK, ROW_BYTES
from raps_slurm.runtime.msglog import Entry, NotDeterministic, SenderLog
from raps_slurm.testing.ranks import local_pair


def test_arrived_but_unread_messages_are_not_a_gap() -> None:
    inbox = Inbox()
    assert inbox.offer(0, 1, 1, 11, b"a") == ("ok", 0, 0)
    assert inbox.offer(0, 2, 1, 12, b"b") == ("ok", 0, 0)  # 1 waits unread: no gap
    assert inbox.offer(0, 3, 1, 13, b"c") == ("ok", 0, 0)
    assert [inbox.pop(0) for _ in range(4)] == [b"a", b"b", b"c", None]


class _Counting(dict):  # type: ignore[type-arg]
    """An ``early`` map that counts its membership tests."""

    tests = 0

    def __contains__(self, key: object) -> bool:
        _Counting.tests += 1
        return super().__contains__(key)


def test_messages_the_application_has_not_taken_cost_each_new_one_no_scan() -> None:
    """A rank busy computing while 20,000 messages come: each frame's gap check looks
    past what came in order, not over the whole queue (it took in 600 frames a second
    with 10,000 queued)."""
    inbox = Inbox()
    src = inbox._src(0)
    src.early = _Counting()
    n = 20_000
    for seq in range(1, n + 1):
        assert inbox.offer(0, seq, 1, seq, b"m") == ("ok", 0, 0)
    assert _Counting.tests <= 3 * n, _Counting.tests
    assert inbox.offer(0, n + 3, 1, 0, b"x") == ("gap", n + 1, n + 2)
    assert [inbox.pop(0) for _ in range(n)] == [b"m"] * n and inbox.pop(0) is None
    assert inbox.offer(0, n + 1, 1, 0, b"y") == ("ok", 0, 0)
    assert inbox.offer(0, n + 2, 1, 0, b"z") == ("ok", 0, 0)
    assert [inbox.pop(0) for _ in range(4)] == [b"y", b"z", b"x", None]


def test_a_gap_names_exactly_the_missing_seqs_once() -> None:
    inbox = Inbox()
    assert inbox.offer(0, 1, 1, 11, b"a") == ("ok", 0, 0)
    assert inbox.offer(0, 4, 1, 14, b"d") == ("gap", 2, 3)
    assert inbox.offer(0, 5, 1, 15, b"e") == ("ok", 0, 0)  # 2..3 asked already
    assert inbox.offer(0, 3, 1, 13, b"c") == ("ok", 0, 0)
    assert inbox.offer(0, 8, 1, 18, b"h") == ("gap", 6, 7)
    assert inbox.offer(0, 2, 1, 12, b"b") == ("ok", 0, 0)
    assert [inbox.pop(0) for _ in range(6)] == [b"a", b"b", b"c", b"d", b"e", None]


def test_a_gap_below_arrived_seqs_skips_them() -> None:
    inbox = Inbox()
    inbox.offer(0, 3, 1, 13, b"c")  # 1..2 missing
    inbox.offer(0, 1, 1, 11, b"a")
    inbox.offer(0, 2, 1, 12, b"b")
    inbox.offer(0, 5, 1, 15, b"e")  # 4 missing, 1..3 arrived (asked up to 2)
    assert inbox.offer(0, 7, 1, 17, b"g") == ("gap", 6, 6)


def _log(seqs: list[int]) -> SenderLog:
    log = SenderLog(large_threshold=1 << 20, high_watermark=1 << 30)
    log.reload([Entry(1, s, 1, 1, 0, False, b"x") for s in seqs], {1: max(seqs)}, {}, {})
    return log


def test_after_finds_the_tail_even_with_holes() -> None:
    log = _log([1, 2, 3, 5, 6, 9])
    assert [e.seq for e in log.after(1, 0)] == [1, 2, 3, 5, 6, 9]
    assert [e.seq for e in log.after(1, 3)] == [5, 6, 9]
    assert [e.seq for e in log.after(1, 4)] == [5, 6, 9]
    assert [e.seq for e in log.after(1, 8)] == [9]
    assert log.after(1, 9) == []


def test_entries_past_the_checkpoint_are_kept_ahead_until_sent_again() -> None:
    # The lost incarnation (epoch 1) logged seqs 1..6 to rank 1 and 1..2 to rank 2; the
    # restored checkpoint had sent 1..3 and 1..1. Seq 6 was logged twice (epochs 1 and 2
    # of an earlier recovery): the newest copy counts; a large entry has no body here.
    old = [Entry(1, s, 1, 1, s, False, b"%d" % s) for s in range(1, 7)]
    old += [Entry(1, 6, 2, 1, 66, False, b"6'"), Entry(2, 1, 1, 1, 0, False, b"a"),
            Entry(2, 2, 1, 1, 0, False, None)]
    log = SenderLog(large_threshold=1 << 20, high_watermark=1 << 30)
    log.reload(old, {1: 3, 2: 1}, {}, {})
    assert [e.seq for e in log.after(1, 0)] == [1, 2, 3]
    assert [(e.seq, e.body) for e in log.ahead_after(1, 0)] == [(4, b"4"), (5, b"5"),
                                                                 (6, b"6'")]
    assert [e.seq for e in log.ahead_after(1, 4)] == [5, 6]  # the peer had up to 4
    assert log.ahead_after(1, 6) == [] and log.ahead_after(2, 0) == []  # no body: a hole
    # two lanes' first chunks and four rows: bodies ahead are not the log's, not counted
    assert log.held == 2 * FIRST_CHUNK + 4 * ROW_BYTES
    e = log.append(1, b"4", 2)  # re-execution sends seq 4 again: it leaves the ahead set
    assert e.seq == 4 and [x.seq for x in log.ahead_after(1, 0)] == [5, 6]
    log.append(1, b"5", 2)
    log.append(1, b"6'", 2)
    assert 1 not in log.ahead and [x.seq for x in log.after(1, 3)] == [4, 5, 6]


def _arrived(ctx: Context, src: int) -> int:
    """Messages from ``src`` delivered or waiting unread."""
    with ctx._mu:
        st = ctx.inbox.sources.get(src)
        return 0 if st is None else st.next - 1 + len(st.early)


def test_messages_queued_while_the_application_is_busy_are_not_sent_twice(
        tmp_path: Path) -> None:
    s = Settings(flush_ms=20, large_threshold=1024, high_watermark=8 << 20,
                 buffer_bytes=16 << 20, recv_timeout=30.0)
    with local_pair(tmp_path, s) as (a, b):
        b.send(0, b"hello")
        assert a.recv(1) == b"hello"
        for round_ in range(2):  # the first sets up the connections (their HELLOs resend)
            resent, dups = a.resent, b.inbox.duplicates
            for i in range(40):
                a.send(1, bytes([i]) * 3000)
            deadline = time.monotonic() + 20
            while _arrived(b, 0) < 40 * (round_ + 1):
                assert time.monotonic() < deadline, "the 40 messages did not all arrive"
                time.sleep(0.01)
            # Nothing to wait for when all is well: a tenth of a second (five flush ticks)
            # for a spurious request, sent as the frames arrived, to reach the sender.
            time.sleep(0.1)
            assert [b.recv(0) for _ in range(40)] == [bytes([i]) * 3000 for i in range(40)]
        assert (a.resent, b.inbox.duplicates) == (resent, dups)


def test_a_checksum_that_follows_its_message_is_compared_as_one_in_its_frame() -> None:
    inbox = Inbox()
    assert inbox.offer(0, 1, 1, 0, b"large") == ("ok", 0, 0)  # sent with none
    inbox.checksums(0, 1, [(1, 0xAB)])
    assert inbox.pop(0) == b"large"
    assert inbox.sources[0].crcs == {1: 0xAB}  # kept, not overwritten by the frame's 0
    # the sender re-executes: its duplicate comes with none, then its checksum
    assert inbox.offer(0, 1, 2, 0, b"other") == ("dup", 0, 0)
    inbox.checksums(0, 2, [(1, 0xAB)])  # the same: piecewise deterministic
    with pytest.raises(NotDeterministic, match="re-sent seq 1 with checksum 000000cd"):
        inbox.checksums(0, 2, [(1, 0xCD)])
    # an older incarnation's are not compared; trimmed ones not kept again
    inbox.checksums(0, 1, [(1, 0xEF)])
    assert inbox.refused_epoch == 1
    inbox.trim_checksums(0, 1)
    inbox.checksums(0, 2, [(1, 0xEF)])
    assert inbox.sources[0].crcs == {}
    # one for a message that never came is not kept (a peer cannot grow this at will)
    inbox.checksums(0, 2, [(99, 0x99)])
    assert 99 not in inbox.sources[0].crcs
    # one for a message still waiting to be delivered, whose frame had another
    assert inbox.offer(0, 2, 2, 0x11, b"next") == ("ok", 0, 0)
    with pytest.raises(NotDeterministic, match="seq 2 twice with different checksums"):
        inbox.checksums(0, 2, [(2, 0x22)])
