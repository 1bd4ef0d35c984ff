"""Receive buffers for rank traffic: where in its page a received byte lands, and large
frames' buffers, reused rather than faulted in anew (:class:`BufferPool`). Used by
:mod:`raps_slurm.wire.framing`'s reader; only the standard library is imported at load
time, as there."""

from __future__ import annotations

import sys
from typing import Any

PAGE = 4096
# Where in its page a received frame's first byte goes (a reader's buffer), and its
# body's (a large frame's own buffer: BufferPool.get). The kernel's copy out of a socket
# ran at a quarter of its speed (2.3-3 against 7-14 GB/s on the test machine) when each
# byte landed a few bytes past the page offset it was read from (most likely the CPU
# taking stores 4 KiB apart from later loads as dependent). A frame sent alone starts a
# page of the socket's buffer, so its body comes from page offset 4 on; numpy's large
# buffers start at offset 16, which put every byte 12 bytes past its source. Half a
# page away, each byte is as far from that as it can be.
FRAME_AT = PAGE // 2
BODY_AT = FRAME_AT + 4  # past the frame's 4-byte length (framing.HEADER)


def unfilled(n: int) -> bytearray | Any:
    """A writable buffer of ``n`` bytes whose content is undefined, for bytes about to be
    received over all of it: numpy's ``empty`` (a bytearray is zeroed first, 0.4 ms per
    8 MiB here); a bytearray where numpy is not installed (a supervisor's interpreter)."""
    try:
        import numpy
    except ImportError:
        return bytearray(n)
    return numpy.empty(n, numpy.uint8)


def placed(buf: Any, n: int, at: int = BODY_AT) -> memoryview:
    """``n`` bytes of ``buf`` (at least ``n + PAGE`` long, writable) whose first byte
    sits at offset ``at`` in its page (where its address can be told: datapath.address)."""
    from raps_slurm.wire import datapath  # it imports this module: not at load time

    start = (at - datapath.address(buf)) % PAGE
    return memoryview(buf)[start:start + n]


class BufferPool:
    """Receive buffers for frames larger than a reader's own buffer, reused once nobody
    holds a view of them any more: a frame read into fresh memory pays for the kernel
    mapping every page (ten times a copy into warm memory on the project's test machine).
    Whether a buffer is free is its reference count (CPython's views of it hold it), so
    a body the caller keeps is never written over. At most ``keep`` buffers of at most
    ``limit`` bytes each are kept; a frame that finds none free gets a new one."""

    def __init__(self, keep: int = 8, limit: int = 64 << 20) -> None:
        self.keep, self.limit = keep, limit
        self._bufs: list[Any] = []
        self.reused = 0
        self.fresh = 0

    def get(self, n: int) -> memoryview:
        """A buffer of ``n`` bytes (content undefined), :func:`placed` in its page."""
        for buf in self._bufs:
            # references: the list, this loop's name, getrefcount's argument
            if n + PAGE <= len(buf) <= 2 * n + PAGE and sys.getrefcount(buf) <= 3:
                self.reused += 1
                return placed(buf, n)
        self.fresh += 1
        buf = unfilled(n + PAGE)
        if n <= self.limit:
            if len(self._bufs) >= self.keep:
                # the smallest free one goes (a busy one stays: someone reads it)
                # references: the list, getrefcount's argument
                free = [i for i in range(len(self._bufs))
                        if sys.getrefcount(self._bufs[i]) <= 2]
                if free:
                    # by position: list.remove compares, and numpy compares element-wise
                    # (a ValueError that ended every connection bringing a large frame)
                    del self._bufs[min(free, key=lambda i: len(self._bufs[i]))]
            if len(self._bufs) < self.keep:
                self._bufs.append(buf)
        return placed(buf, n)
