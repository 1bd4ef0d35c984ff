"""The log's warm memory (runtime/arena.py): copies land in pre-faulted chunks, room
comes back when messages are released and is reused in place, never while pinned; a
log that outgrows the map copies to the heap and says so."""

from __future__ import annotations

import ctypes
import mmap

from raps_slurm.runtime.arena import Arena

KIB = 1 << 10
_libc = ctypes.CDLL(None, use_errno=True)


def _resident(a: Arena) -> int:
    """Bytes of the arena's mapping resident in memory (``mincore``)."""
    page = mmap.PAGESIZE
    pages = a.nchunks * a.chunk // page
    vec = (ctypes.c_ubyte * pages)()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(a._map))
    assert _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(pages * page), vec) == 0
    return sum(b & 1 for b in vec) * page


def test_the_first_copy_faults_the_whole_map_in() -> None:
    a = Arena(8 * 64 * KIB, chunk=64 * KIB)
    assert _resident(a) == 0 and not a.populated  # a rank that logs nothing large
    _, slot = a.copy([b"f" * (10 * KIB)])
    assert slot is not None and a.populated
    assert _resident(a) == 8 * 64 * KIB  # no later copy touches a page first
    _, s2 = a.copy([b"g" * (64 * KIB)])
    assert s2 is not None and _resident(a) == 8 * 64 * KIB


def test_copies_are_whole_and_room_is_reused_in_place() -> None:
    a = Arena(4 * 64 * KIB, chunk=64 * KIB)
    head, body = b"H" * 12, bytes(range(256)) * 100
    view, slot = a.copy([head, memoryview(body)])
    assert slot is not None and bytes(view) == head + body
    # fill and release, many times the map: the same memory, warm, no miss
    for i in range(64):
        v, s = a.copy([bytes([i]) * (40 * KIB)])
        assert s is not None and bytes(v[:3]) == bytes([i]) * 3
        a.release(s)
    a.release(slot)
    assert a.stats()["arena_misses"] == 0
    assert _resident(a) == 4 * 64 * KIB  # the map, no more


def test_a_message_larger_than_a_chunk_takes_a_run_and_a_full_map_goes_to_the_heap() -> None:
    a = Arena(4 * 64 * KIB, chunk=64 * KIB)
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


def test_room_released_while_pinned_is_not_reused_until_the_pin_goes() -> None:
    a = Arena(2 * 64 * KIB, chunk=64 * KIB)
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


def test_messages_just_past_a_chunk_go_on_where_the_last_one_ended() -> None:
    # 4 MiB and an envelope, in 4 MiB chunks: each held two chunks of its own
    a = Arena(8 * 64 * KIB, chunk=64 * KIB)
    size = 64 * KIB + 12
    got = [a.copy([bytes([i]) * size]) for i in range(7)]
    assert all(s is not None for _, s in got)  # 7 of them in 8 chunks
    assert a.stats()["arena_misses"] == 0
    assert all(bytes(v) == bytes([i]) * size for i, (v, _) in enumerate(got))
    # a chunk is free once every message with a part in it is released
    a.release(got[0][1])  # chunk 0 free; chunk 1 still holds the second one's head
    _, none = a.copy([b"x" * (2 * 64 * KIB)])
    assert none is None and a.stats()["arena_misses"] == 1
    a.release(got[1][1])
    two, s = a.copy([b"y" * (2 * 64 * KIB)])  # chunks 0 and 1 again
    assert s is not None and s.first == 0 and bytes(two) == b"y" * (2 * 64 * KIB)
    assert all(bytes(v) == bytes([i]) * size for i, (v, _) in enumerate(got) if i >= 2)
