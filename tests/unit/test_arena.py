"""The log's warm memory (runtime/arena.py): copies land in pre-faulted chunks, room
comes back when messages are released and is reused in place, never while pinned; a
log that outgrows the map copies to the heap and says so."""

from __future__ import annotations

import time

from raps_slurm.runtime.arena import Arena

KIB = 1 << 10


def _wait(cond: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


def test_the_whole_map_is_readied_before_any_copy() -> None:
    a = Arena(8 * 64 * KIB, chunk=64 * KIB)
    try:
        _wait(lambda: a.stats()["arena_faulted"] == 8 * 64 * KIB)
        for _ in range(8):
            _, slot = a.copy([b"w" * (64 * KIB)])
            assert slot is not None
        assert a.stats()["arena_cold_chunks"] == 0  # no copy touched a page first
    finally:
        a.close()


def test_a_copy_ahead_of_the_prefaulter_takes_a_chunk_it_then_leaves() -> None:
    a = Arena(64 * 1024 * KIB, chunk=64 * KIB)
    try:
        slots = [a.copy([b"c" * (64 * KIB)])[1] for _ in range(64)]
        assert all(s is not None for s in slots)
        _wait(lambda: a.stats()["arena_faulted"] == 64 * 1024 * KIB)
        st = a.stats()
        # what the copies took first they faulted themselves; the rest was readied
        assert st["arena_cold_chunks"] <= 64 and st["arena_misses"] == 0
    finally:
        a.close()


def test_copies_are_whole_and_room_is_reused_in_place() -> None:
    a = Arena(4 * 64 * KIB, chunk=64 * KIB)
    try:
        head, body = b"H" * 12, bytes(range(256)) * 100
        _wait(lambda: a.stats()["arena_faulted"] == 4 * 64 * KIB)
        view, slot = a.copy([head, memoryview(body)])
        assert slot is not None and bytes(view) == head + body
        start = a.stats()["arena_faulted"]
        # fill and release, many times the map: the same memory, warm, no miss
        for i in range(64):
            v, s = a.copy([bytes([i]) * (40 * KIB)])
            assert bytes(v[:3]) == bytes([i]) * 3
            a.release(s)
        a.release(slot)
        st = a.stats()
        assert st["arena_misses"] == 0 and st["arena_faulted"] == start
    finally:
        a.close()


def test_a_message_larger_than_a_chunk_takes_a_run_and_a_full_map_goes_to_the_heap() -> None:
    a = Arena(4 * 64 * KIB, chunk=64 * KIB)
    try:
        _wait(lambda: a.stats()["arena_faulted"] == 4 * 64 * KIB)  # no chunk held warming
        big, slot = a.copy([b"b" * (150 * KIB)])  # three chunks in a row
        assert slot is not None and slot.count == 3 and bytes(big) == b"b" * (150 * KIB)
        rest, s2 = a.copy([b"r" * (64 * KIB)])
        assert s2 is not None
        heap, none = a.copy([b"h" * (64 * KIB)])  # nothing free: the heap, counted
        assert none is None and bytes(heap) == b"h" * (64 * KIB)
        assert a.stats()["arena_misses"] == 1
        a.release(slot)
        again, s3 = a.copy([b"a" * (100 * KIB)])
        assert s3 is not None and bytes(again) == b"a" * (100 * KIB)
        assert bytes(rest) == b"r" * (64 * KIB)  # a live message is never written over
    finally:
        a.close()


def test_room_released_while_pinned_is_not_reused_until_the_pin_goes() -> None:
    a = Arena(2 * 64 * KIB, chunk=64 * KIB)
    try:
        _wait(lambda: a.stats()["arena_faulted"] == 2 * 64 * KIB)
        first, s1 = a.copy([b"1" * (64 * KIB)])
        second, s2 = a.copy([b"2" * (64 * KIB)])
        assert s1 is not None and s2 is not None
        with a.pin():
            a.release(s1)  # a writer may still be reading it
            _, none = a.copy([b"3" * (64 * KIB)])
            assert none is None  # not reused: the heap
            assert bytes(first) == b"1" * (64 * KIB)
        third, s3 = a.copy([b"3" * (64 * KIB)])
        assert s3 is not None and s3.first == s1.first  # free again once unpinned
        assert bytes(third) == b"3" * (64 * KIB)
        assert bytes(second) == b"2" * (64 * KIB)
    finally:
        a.close()
