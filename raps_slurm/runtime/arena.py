"""The sender's log memory: pre-faulted chunks, reused in place between checkpoints.

A logged message is copied once, into memory the rank keeps until the receiver's
checkpoint covers it. Copied into fresh memory, that copy costs ten times a copy into
warm memory (the kernel zeroes and maps every new page on first touch: 0.44-0.68 ms per
MiB against 0.04 on the project's test machine, docs/benchmarks.md). So the log copies
into an :class:`Arena`: one anonymous mapping of ``size`` bytes (the config's
``messagelog.buffer_size_mb``) cut into chunks of :data:`CHUNK` bytes. A message takes
the next bytes of the current chunk (a message larger than a chunk takes a run of free
chunks, and the next messages the rest of its last); each chunk counts the live messages
it holds a part of and is free again once the last of them is
released (collected when a checkpoint covers it, or spilled to the log store), and its
pages stay mapped, warm for the next ones.

No page is touched for the first time on the data path but once: the first message
that needs room faults the whole mapping in (``madvise(MADV_POPULATE_WRITE)``, else a
``memset``, with the GIL released), with huge pages where the kernel has them
(``MADV_HUGEPAGE``: fewer faults and TLB misses on the copy); populating 256 MiB takes
20-200 ms on the project's test machine (up to 1 s on a freshly started VM). From then
on the memory is the rank's, the log's configured size of it; a rank that never logs a
large message never holds it.
Faulting chunks in only ahead of use, from a background thread, as this module did
first, left that work inside the program's time: it competed with the ranks for the
cores, and an 8 MiB allreduce on four ranks took 33-38 ms against 20-22 ms with the map
populated before (docs/benchmarks.md, MPI). A copy that finds no free room (every chunk
live: the log holds more than the mapping) is made on the heap instead and counted in
:attr:`Arena.misses`.

Freed room is reused only when no one may still be reading it: a writer that reads
bodies outside the rank's lock (a spill, a checkpoint) :meth:`pin` s the arena, and a
chunk freed meanwhile waits for the last pin to go.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

CHUNK = 4 << 20
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@dataclass(slots=True, eq=False)
class Slot:
    """One message's room: chunks ``first`` .. ``first + count - 1`` (each counts the
    messages it holds a part of)."""

    first: int
    count: int


def _populate(addr: int, length: int) -> None:
    """Map and write-fault ``length`` bytes at ``addr`` (no GIL held: a ctypes call)."""
    if _libc.madvise(addr, length, MADV_POPULATE_WRITE) != 0:
        ctypes.memset(addr, 0, length)  # an older kernel: touch every page


class Arena:
    """Pre-faulted memory for logged bodies (see the module docstring). Thread-safe."""

    def __init__(self, size: int, chunk: int = CHUNK) -> None:
        self.chunk = max(1, min(chunk, size))  # a small log: one chunk of its size
        self.nchunks = max(1, size // self.chunk)
        length = self.nchunks * self.chunk
        self._map = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)
        self._cbuf = ctypes.c_char.from_buffer(self._map)  # held: the address stays valid
        self._base = ctypes.addressof(self._cbuf)
        # best effort: a kernel without transparent huge pages keeps small ones
        _libc.madvise(self._base, length, MADV_HUGEPAGE)
        self.populated = False
        self._populating = threading.Lock()
        self._live = [0] * self.nchunks  # messages in each chunk
        # free | current (being filled) | used | limbo (freed while pinned)
        self._state = ["free"] * self.nchunks
        self._cur = -1  # the chunk being filled
        self._off = 0  # its next free byte
        self._pins = 0
        self._lock = threading.Lock()
        self.misses = 0  # copies that found no free room (made on the heap)
        self.copied = 0  # bytes copied in

    # --- the data path ---------------------------------------------------------------

    def copy(self, parts: Sequence[bytes | bytearray | memoryview]
             ) -> tuple[memoryview | bytes, Slot | None]:
        """``parts`` joined, copied into the arena: the copy and its slot (None when it
        went to the heap: no room)."""
        views = [memoryview(p).cast("B") for p in parts]
        n = sum(v.nbytes for v in views)
        self._ready()
        with self._lock:
            slot, start = self._take(n)
        if slot is None:
            self.misses += 1
            return b"".join(views), None
        out = self._view[start:start + n]
        pos = 0
        for v in views:
            out[pos:pos + v.nbytes] = v
            pos += v.nbytes
        self.copied += n
        return out, slot

    def room(self, n: int) -> tuple[memoryview, Slot] | None:
        """Room for a message of ``n`` bytes that the caller fills itself (as it sends
        it: wire/datapath.py): the view and its slot, None when there is none."""
        self._ready()
        with self._lock:
            slot, start = self._take(n)
        if slot is None:
            self.misses += 1
            return None
        self.copied += n
        return self._view[start:start + n], slot

    def _ready(self) -> None:
        """The whole mapping faulted in, once (the first caller does it, others wait)."""
        if self.populated:
            return
        with self._populating:
            if not self.populated:
                _populate(self._base, self.nchunks * self.chunk)
                self.populated = True

    def release(self, slot: Slot | None) -> None:
        """One message's room is not needed any more."""
        if slot is None:
            return
        with self._lock:
            for j in range(slot.first, slot.first + slot.count):
                self._live[j] -= 1
                if self._live[j]:
                    continue
                if self._state[j] == "current":
                    if not self._pins:
                        self._off = 0  # empty: filled again from its start, warm
                    continue
                self._state[j] = "limbo" if self._pins else "free"

    @contextlib.contextmanager
    def pin(self) -> Iterator[None]:
        """While held, room released is not reused (a reader outside the rank's lock
        may still be reading it)."""
        with self._lock:
            self._pins += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins -= 1
                if not self._pins:
                    for j, st in enumerate(self._state):
                        if st == "limbo":
                            self._state[j] = "free"

    def _take(self, n: int) -> tuple[Slot | None, int]:
        """Room for ``n`` bytes (the lock held): a slot and its offset in the map. A
        message goes on from where the last one ended, into the chunks after the current
        one while they are free: one that began each in chunks of its own left most of
        its last empty, and a log of 4 MiB messages (and their envelopes) in 4 MiB chunks
        held half as many as its memory could."""
        cur, chunk = self._cur, self.chunk
        if cur >= 0:
            end = self._off + n
            if end <= chunk:  # the usual case: the current chunk has room
                self._off = end
                self._live[cur] += 1
                return Slot(cur, 1), cur * chunk + end - n
            start = cur * chunk + self._off
            first, last = start // chunk, (start + n - 1) // chunk
            if last < self.nchunks and self._state[cur + 1:last + 1].count("free") == last - cur:
                if first > cur:  # the current chunk is full
                    self._retire(cur)
                return self._run(first, last - first + 1, start + n - first * chunk), start
        count = max(1, -(-n // chunk))
        first = self._find(count)
        if first < 0:
            return None, 0
        if cur >= 0:
            self._retire(cur)
        return self._run(first, count, n), first * chunk

    def _retire(self, j: int) -> None:
        """Chunk ``j`` stops being the current one."""
        self._state[j] = "used" if self._live[j] else "limbo" if self._pins else "free"

    def _run(self, first: int, count: int, end: int) -> Slot:
        """Chunks ``first`` .. ``first + count - 1`` hold a part of one more message,
        which ends ``end`` bytes from the start of ``first``; the last is current."""
        for j in range(first, first + count):
            self._state[j] = "used"
            self._live[j] += 1
        last = first + count - 1
        self._state[last] = "current"
        self._cur, self._off = last, end - (count - 1) * self.chunk
        return Slot(first, count)

    def _find(self, count: int) -> int:
        """The first of ``count`` free chunks in a row, searched from the current one
        on (round the map): the order the prefaulter readies them in."""
        start = self._cur + 1 if self._cur >= 0 else 0
        run = 0
        for k in range(self.nchunks + count):
            j = (start + k) % self.nchunks
            if j == 0:
                run = 0  # a run does not wrap round the end of the map
            if self._state[j] == "free":
                run += 1
                if run == count:
                    return j - count + 1
            else:
                run = 0
        return -1

    def stats(self) -> dict[str, int]:
        """Figures for the rank's statistics."""
        with self._lock:
            live = sum(1 for s in self._state if s in ("used", "current"))
        return {"arena_bytes": self.nchunks * self.chunk, "arena_chunks_live": live,
                "arena_misses": self.misses}
