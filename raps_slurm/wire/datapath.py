"""A logged message's send and its copy into the log, in one pass.

A sender-based log copies every message it sends. Copied first and sent after, the copy
is time the receiver waits. :func:`send_copy` writes the frame straight from the
application's buffer with non-blocking ``sendmsg`` calls and copies the message into the
log between them, a piece at a time: while the peer reads what was just sent, and while
the socket is full. The compiled module (``_datapath.c``) does it with the GIL released;
the pure-Python fallback here takes the same steps (``RAPS_DATAPATH=python`` selects it,
and the tests run both). Where the CPU has AVX-512 and VPCLMULQDQ, the compiled copy also
takes the message's CRC-32C in the same pass (:func:`folds`); elsewhere :func:`send_frame`
sums the parts apart, a step each time the socket is full and the rest once the frame is
out (``RAPS_DATAPATH=nofold`` makes the compiled path do so too, for the tests). The
frame's length prefix is :mod:`raps_slurm.wire.framing`'s, and :func:`send_frame` does the
waiting, in Python.
"""

from __future__ import annotations

import errno
import os
import select
import socket
from collections.abc import Callable, Sequence
from types import ModuleType

import crc32c

from raps_slurm.wire import framing

Buffer = bytes | bytearray | memoryview

_compiled: ModuleType | None
try:
    from raps_slurm.wire import _datapath as _compiled
except ImportError:  # not built: the fallback
    _compiled = None

PIECE = 256 << 10  # bytes copied into the log between two sends
# bytes checksummed each time the socket is full (some 11 us here: less than the peer
# takes to read what fills it)
SUM_STEP = 256 << 10
ENV = "RAPS_DATAPATH"  # "python": the fallback even where the compiled module is built;
# "nofold": the compiled path without its CRC
# ENV as the process started (tests set both): a lookup in os.environ costs 0.8 us, and a
# large message's send asked several times
mode = os.environ.get(ENV, "")


def compiled() -> bool:
    """Whether the compiled path is in use."""
    return _compiled is not None and mode != "python"


def folds() -> bool:
    """Whether the compiled copy takes the CRC-32C as it copies (AVX-512 and VPCLMULQDQ)."""
    return _compiled is not None and bool(_compiled.FOLDING) and mode not in ("python", "nofold")


FOLD_AT = 64 << 10  # a checksum of at least this many bytes is folded where it can be


def checksum(data: Buffer, start: int = 0) -> int:
    """The CRC-32C of ``data`` (contiguous), continuing ``start``: folded by carry-less
    multiplication where the CPU can and ``data`` is large (1.6 times the crc32c package's
    speed from 64 KiB on, on the project's test machine), else the crc32c package's."""
    n = data.nbytes if isinstance(data, memoryview) else len(data)
    if n >= FOLD_AT and folds():
        assert _compiled is not None
        return int(_compiled.sum(data, start))
    return int(crc32c.crc32c(data, start))


def _tracked(obj: object) -> None:
    """The fallback's :data:`untrack`: Python has no way to do it."""


# Takes an object in no reference cycle out of the garbage collector's sight (the
# compiled module's; the fallback leaves it there). The sender's log holds an entry per
# message until a checkpoint covers it, millions at the shipped 600 s: a full collection
# visited each (357 ms per million on the test machine), pausing the application.
untrack: Callable[[object], None] = (_compiled.untrack if _compiled is not None
                                     and mode != "python" else _tracked)


def address(buf: Buffer) -> int:
    """Where the bytes of ``buf`` (a contiguous buffer) start in memory; 0 where that
    cannot be told (the compiled module not built and no numpy)."""
    if _compiled is not None:
        return int(_compiled.address(buf))
    try:
        import numpy
    except ImportError:
        return 0
    return int(numpy.frombuffer(buf, numpy.uint8).ctypes.data)


def _views(parts: Sequence[Buffer]) -> list[memoryview]:
    return [memoryview(p).cast("B") for p in parts]


def _copy_range(views: list[memoryview], dst: memoryview, start: int, end: int) -> None:
    """Copy bytes [start, end) of ``views`` joined into ``dst`` at the same offsets."""
    base = 0
    for v in views:
        top = base + v.nbytes
        if start < top and base < end:
            a, b = max(start, base), min(end, top)
            dst[a:b] = v[a - base:b - base]
        base = top


def copy(dst: memoryview, parts: Sequence[Buffer]) -> int | None:
    """Copy ``parts`` joined into ``dst`` (exactly their size); their CRC-32C where the
    copy takes it (:func:`folds`), else None."""
    if compiled():
        assert _compiled is not None
        got = _compiled.copy(dst, parts, folds())
        return None if got is None else int(got)
    views = _views(parts)
    n = sum(v.nbytes for v in views)
    if dst.nbytes != n:
        raise ValueError(f"dst of {dst.nbytes} bytes for parts of {n}")
    _copy_range(views, dst.cast("B"), 0, n)
    return None


def send_copy(sock: socket.socket, head: Buffer, parts: Sequence[Buffer], dst: memoryview,
              sent: int = 0, copied: int = 0, piece: int = PIECE, crc: int = 0
              ) -> tuple[int, int, int, int | None]:
    """Write ``head`` and ``parts`` joined to ``sock`` from byte ``sent`` on, never
    waiting, and copy ``parts`` joined into ``dst`` from byte ``copied`` on, ``piece``
    bytes between two sends. Returns the new ``sent`` and ``copied``; 0 (all sent and
    copied), ``EAGAIN`` (the socket is full; all copied) or the errno of a failed send
    (all copied: the log keeps the message whole whatever the socket did); and, where the
    copy takes the CRC-32C (:func:`folds`; ``crc``: that of the first ``copied`` bytes),
    that of all bytes copied so far, else None."""
    if compiled():
        assert _compiled is not None
        got: tuple[int, int, int, int | None] = _compiled.send_copy(
            sock.fileno(), head, parts, dst, sent, copied, piece, crc, folds())
        return got
    views = _views([head, *parts])
    out = dst.cast("B")
    src = views[1:]
    srclen = out.nbytes
    total = views[0].nbytes + srclen
    if sum(v.nbytes for v in src) != srclen or not 0 <= sent <= total or not (
            0 <= copied <= srclen) or piece <= 0:
        raise ValueError(f"dst of {srclen} bytes, sent {sent} of {total}, copied {copied}, "
                         f"piece {piece}")
    while sent < total or copied < srclen:
        if sent == total:
            _copy_range(src, out, copied, srclen)
            return sent, srclen, 0, None
        n = -1
        try:
            n = sock.sendmsg(_left(views, sent), (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        except OSError as exc:
            _copy_range(src, out, copied, srclen)
            return sent, srclen, exc.errno or errno.EPIPE, None
        if n > 0:
            sent += n
        if copied < srclen:  # the peer reads what was sent meanwhile
            top = min(srclen, copied + piece)
            _copy_range(src, out, copied, top)
            copied = top
        elif n < 0:
            return sent, copied, errno.EAGAIN, None
    return sent, copied, 0, None


def _left(views: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of ``views`` after ``sent`` bytes."""
    out, base = [], 0
    for v in views:
        top = base + v.nbytes
        if sent < top and v.nbytes:
            out.append(v[max(0, sent - base):])
        base = top
    return out


class _Sum:
    """The CRC-32C of ``parts`` joined, taken a step at a time."""

    def __init__(self, parts: Sequence[Buffer]) -> None:
        self._views = [v for v in _views(parts) if v.nbytes]
        self._at = 0  # bytes of the first view left in _views taken
        self.crc = 0

    def step(self, most: int) -> None:
        """Take up to ``most`` more bytes."""
        while most > 0 and self._views:
            v = self._views[0]
            piece = v[self._at:self._at + most]
            self.crc = crc32c.crc32c(piece, self.crc)
            self._at += piece.nbytes
            most -= piece.nbytes
            if self._at == v.nbytes:
                self._views.pop(0)
                self._at = 0

    def rest(self) -> int:
        """Take what is left; the CRC-32C."""
        self.step(1 << 62)
        return self.crc


def send_frame(sock: socket.socket, head: bytes, parts: Sequence[Buffer], log: memoryview,
               *, max_size: int = framing.MAX_FRAME,
               on_full: Callable[[socket.socket], None] | None = None) -> int:
    """Write one untagged frame whose body is ``head`` and ``parts`` joined, and copy
    ``parts`` joined into ``log`` (a sender's log room of their size) as it goes
    (:func:`send_copy`): the copy fills the time the peer reads. While the
    socket is full, ``on_full(sock)`` runs (else a wait for room). Once this returns or
    raises, ``log`` holds the parts whole. Returns the CRC-32C of ``parts`` joined: taken
    by the copy where it can (:func:`folds`), else :data:`SUM_STEP` bytes at a time while
    the socket is full (the peer reads what fills it meanwhile), the rest once the frame
    is out.

    FrameError ``oversized`` before anything is written; ``closed`` if the write fails
    (the stream is then unusable)."""
    n = len(head) + log.nbytes
    if n > max_size:
        copy(log, parts)
        raise framing.FrameError("oversized", f"frame of {n} bytes: at most {max_size}")
    prefix = framing.HEADER.pack(n) + head
    sent = copied = 0
    crc: int | None = 0
    summed = None if folds() else _Sum(parts)
    try:
        while True:
            sent, copied, err, crc = send_copy(sock, prefix, parts, log, sent, copied,
                                               crc=crc or 0)
            if err == 0:
                if summed is not None:
                    return summed.rest()
                assert crc is not None
                return crc
            if err != errno.EAGAIN:
                raise framing.FrameError("closed", f"send failed: {os.strerror(err)}")
            if summed is not None:
                summed.step(SUM_STEP)
            if on_full is not None:
                on_full(sock)
            else:
                wait = select.poll()
                wait.register(sock.fileno(), select.POLLOUT)
                wait.poll()
    except BaseException:
        if copied < log.nbytes:  # an on_full that raised: the log is whole all the same
            copy(log, parts)
        raise
