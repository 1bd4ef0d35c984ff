"""Length-prefixed frames over a stream socket: the project's one framing module.

A frame is a 4-byte big-endian length N (1..``max_size``) and N bytes. With a
:class:`FrameMac` the last :data:`TAG_SIZE` of those bytes are an HMAC-SHA256 over an
8-byte sequence number and the body; each side counts its frames, so a frame replayed,
dropped or reordered by someone on the path fails the check like a forged one.

Reading has two limits: how long to wait for a frame to begin (``idle_timeout``, None
waits for ever: a quiet peer is not an error) and how long the whole frame may take once
its first byte arrived (``frame_timeout``). The second is a deadline, not a per-``recv``
timeout: a peer that trickles one byte a second (slow loris) still runs out of time.

Every failure is a :class:`FrameError` whose ``kind`` says what happened (``closed``,
``truncated``, ``oversized``, ``empty``, ``timeout``, ``mac``); after one the stream is
unusable and the caller closes it. Only the standard library is imported at load time:
a rank's supervisor loads this before anything else (``blake3`` is imported by the one
MAC that uses it, when it is made).

Streams with many frames (rank-to-rank messages) use :class:`FrameReader`, which reads
through one buffer (many small frames per ``recv``, a large one straight into its own
buffer once its length passed the cap) and :func:`send_parts`, which writes header, body
parts and tag with one ``sendmsg`` and copies nothing. Their MAC is keyed blake3
(``FrameMac(key, algo="blake3")``): several GB/s where HMAC-SHA256 costs a second per
copied GiB. A large frame's MAC is computed as it goes: :func:`send_parts` hashes and
sends it in pieces, :meth:`FrameReader.poll` hashes what came while the rest comes, so
the two ends hash at once instead of in turn (the body is still returned only once its
tag checked).

A stream may MAC only some of its frames (rank traffic under ``frame_mac: control``: its
control frames, not its data): the reader's ``tagged`` says, from a frame's first body
byte, whether that frame carries a tag; the tagged frames are counted on their own.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from raps_slurm.errors import RapsError
from raps_slurm.wire.pool import FRAME_AT, PAGE, BufferPool, placed, unfilled

HEADER = struct.Struct(">I")
TAG_SIZE = 32  # HMAC-SHA256
MAX_FRAME = 1 << 20
# A MAC'd frame over STREAM_AT bytes is hashed and sent in STREAM_PIECE pieces, and one
# larger than a FrameReader's buffer is checked as its bytes arrive.
STREAM_AT, STREAM_PIECE = 1 << 20, 512 << 10
_SEQ = struct.Struct(">Q")
class FrameError(RapsError):
    """A frame could not be read or written; ``kind`` names why."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class FrameMac:
    """One direction's keyed MAC: tags frames in order, checks them in order.

    ``algo`` is ``hmac-sha256`` (key of 16 bytes or more) or ``blake3`` (keyed blake3,
    a key of exactly 32 bytes); ``label`` is MAC'd before the sequence number, so the two
    directions of one session key cannot be swapped."""

    def __init__(self, key: bytes, algo: str = "hmac-sha256", label: bytes = b"") -> None:
        if algo == "blake3":
            if len(key) != 32:
                raise ValueError(f"blake3 MAC key of {len(key)} bytes: exactly 32 are needed")
            import blake3  # not at module load: supervisors import only the standard library

            self._blake3: Any = blake3.blake3
        elif algo == "hmac-sha256":
            if len(key) < 16:
                raise ValueError(f"MAC key of {len(key)} bytes: at least 16 are needed")
            self._blake3 = None
        else:
            raise ValueError(f"MAC algorithm {algo!r}: expected hmac-sha256 or blake3")
        self._key, self._label = key, label
        self.seq = 0

    def _start(self, seq: int) -> Any:
        head = self._label + _SEQ.pack(seq)
        if self._blake3 is not None:
            return self._blake3(head, key=self._key)
        return hmac.new(self._key, head, hashlib.sha256)

    def _tag(self, seq: int, body: bytes | memoryview) -> bytes:
        h = self._start(seq)
        h.update(body)
        return bytes(h.digest())

    def hasher(self) -> Any:
        """The MAC of the next frame, to be fed its body piece by piece (``update``) as it
        is sent (:meth:`finish`) or received (:meth:`verify`)."""
        return self._start(self.seq)

    def finish(self, h: Any) -> bytes:
        """The tag of :meth:`hasher` ``h``, fed the whole body (counts the frame)."""
        self.seq += 1
        return bytes(h.digest())

    def verify(self, h: Any, tag: bytes | memoryview) -> None:
        """Check a received ``tag`` against :meth:`hasher` ``h``, fed the whole body;
        FrameError (kind ``mac``) if it differs, and the count does not move."""
        if not hmac.compare_digest(tag, bytes(h.digest())):
            raise FrameError("mac", f"frame {self.seq}: bad MAC (forged, replayed or "
                             "reordered)")
        self.seq += 1

    def tag_parts(self, parts: Sequence[bytes | memoryview]) -> bytes:
        """The tag of the next sequence number over ``parts`` as one body (counts it)."""
        h = self.hasher()
        for part in parts:
            h.update(part)
        return self.finish(h)

    def seal(self, body: bytes) -> bytes:
        """``body`` + the tag of the next sequence number."""
        tag = self._tag(self.seq, body)
        self.seq += 1
        return body + tag

    def check(self, payload: bytes | bytearray | memoryview) -> memoryview:
        """The body of ``payload`` (a view) if its tag is the next sequence number's;
        FrameError (kind ``mac``) otherwise, and the count does not move."""
        if len(payload) < TAG_SIZE:
            raise FrameError("mac", f"frame of {len(payload)} bytes is shorter than its MAC")
        view = memoryview(payload)
        body = view[:-TAG_SIZE]
        h = self.hasher()
        h.update(body)
        self.verify(h, view[-TAG_SIZE:])
        return body

    def open(self, payload: bytes) -> bytes:
        """The body of ``payload`` if its tag is the next sequence number's; FrameError."""
        return bytes(self.check(payload))


def encode(body: bytes, *, mac: FrameMac | None = None, max_size: int = MAX_FRAME) -> bytes:
    """One frame; FrameError (``empty``/``oversized``) if ``body`` does not fit."""
    payload = mac.seal(body) if mac is not None else body
    if not body and mac is None:
        raise FrameError("empty", "empty frame")
    if len(payload) > max_size:
        raise FrameError("oversized", f"frame of {len(payload)} bytes: at most {max_size}")
    return HEADER.pack(len(payload)) + payload


def send_frame(sock: socket.socket, body: bytes, *, mac: FrameMac | None = None,
               max_size: int = MAX_FRAME, timeout: float | None = 10.0) -> None:
    """Write one frame within ``timeout`` seconds (None: blocking); FrameError."""
    data = encode(body, mac=mac, max_size=max_size)
    try:
        sock.settimeout(timeout)  # a socket closed meanwhile fails here: "closed" too
        sock.sendall(data)
    except TimeoutError:
        raise FrameError("timeout", f"frame not sent within {timeout:g}s") from None
    except OSError as exc:
        raise FrameError("closed", f"send failed: {exc}") from None


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None,
              what: str = "body") -> None:
    """Fill ``view`` from ``sock`` by ``deadline`` (a ``time.monotonic()`` instant, None:
    no limit), however the peer spreads its bytes; FrameError ``timeout``, ``closed`` (no
    byte of a ``header`` came) or ``truncated``. The socket's timeout is changed."""
    got, n = 0, len(view)
    while got < n:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise FrameError("timeout", f"{what}: {got} of {n} bytes before the deadline")
        try:
            # A socket another thread closed fails here (EBADF): "closed" as any other.
            sock.settimeout(left)
            k = sock.recv_into(view[got:])
        except TimeoutError:
            raise FrameError("timeout", f"{what}: {got} of {n} bytes before the "
                             "deadline") from None
        except OSError as exc:
            raise FrameError("closed", f"{what}: {exc}") from None
        if not k:
            if not got and what == "header":
                raise FrameError("closed", "connection closed by the peer")
            raise FrameError("truncated", f"{what}: connection closed after {got} of {n} "
                             "bytes")
        got += k


def read_frame(sock: socket.socket, *, frame_timeout: float, idle_timeout: float | None = None,
               mac: FrameMac | None = None, max_size: int = MAX_FRAME,
               deadline: float | None = None) -> bytes:
    """The next frame's body (MAC checked and removed when ``mac`` is given).

    Waits up to ``idle_timeout`` for its first byte (None: for ever), then at most
    ``frame_timeout`` for the rest of it, and never past ``deadline`` (a
    ``time.monotonic()`` instant for the whole frame, e.g. one request per connection);
    a length above ``max_size`` is refused before anything is read past the header."""
    head = memoryview(bytearray(HEADER.size))
    first = None if idle_timeout is None else time.monotonic() + idle_timeout
    if deadline is not None:
        first = deadline if first is None else min(first, deadline)
    recv_into(sock, head[:1], first, "header")
    end = time.monotonic() + frame_timeout
    deadline = end if deadline is None else min(end, deadline)
    recv_into(sock, head[1:], deadline, "length")
    (n,) = HEADER.unpack(head)
    if n == 0:
        raise FrameError("empty", "empty frame")
    if n > max_size:
        raise FrameError("oversized", f"frame length {n}: at most {max_size}")
    body = bytearray(n)
    recv_into(sock, memoryview(body), deadline, "body")
    return mac.open(bytes(body)) if mac is not None else bytes(body)


def send_parts(sock: socket.socket, parts: Sequence[bytes | memoryview], *,
               mac: FrameMac | None = None, max_size: int = MAX_FRAME,
               on_full: Callable[[socket.socket], None] | None = None) -> None:
    """Write one frame whose body is ``parts`` joined, with one ``sendmsg`` per kernel
    buffer and no copy; the socket keeps its mode (blocking or its timeout). ``on_full``
    (a blocking socket): called whenever the socket is full, instead of blocking in
    ``sendmsg``; it returns once the socket may take more (:func:`send_views`).

    FrameError ``empty``/``oversized`` before anything is written; ``timeout``/``closed``
    if the write fails (the stream is then unusable)."""
    if mac is None and 0 < len(parts) <= 2 and type(parts[0]) is bytes and (
            len(parts) == 1 or type(parts[1]) is bytes):
        # A small message's frame (its header and body are bytes): one sendmsg of the
        # parts as they are; memoryviews of them cost a microsecond, as much again.
        n = sum(map(len, parts))
        if not 0 < n <= max_size:
            raise FrameError(*(("empty", "empty frame") if n == 0 else (
                "oversized", f"frame of {n} bytes: at most {max_size}")))
        views: list[Any] = [HEADER.pack(n), *parts]
        try:
            if on_full is not None and sock.gettimeout() is None:
                # the usual case: the socket takes it all at once
                try:
                    sent = sock.sendmsg(views, (), socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                if sent == n + HEADER.size:
                    return
                views = [memoryview(b"".join(views))[sent:]]
            send_views(sock, views, on_full)
        except TimeoutError:
            raise FrameError("timeout", "frame not sent within the socket's timeout") from None
        except OSError as exc:
            raise FrameError("closed", f"send failed: {exc}") from None
        return
    body = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    n = sum(v.nbytes for v in body) + (TAG_SIZE if mac is not None else 0)
    if n == 0:
        raise FrameError("empty", "empty frame")
    if n > max_size:
        raise FrameError("oversized", f"frame of {n} bytes: at most {max_size}")
    head = memoryview(HEADER.pack(n))
    try:
        if mac is None:
            send_views(sock, [head, *body], on_full)
        elif n <= STREAM_AT:
            send_views(sock, [head, *body, memoryview(mac.tag_parts(body))], on_full)
        else:
            # MAC'd piece by piece as it goes: the receiver checks each piece while the
            # next is hashed here, instead of both ends hashing the whole in turn.
            h = mac.hasher()
            pieces = [v[i:i + STREAM_PIECE] for v in body
                      for i in range(0, v.nbytes, STREAM_PIECE)]
            for i, piece in enumerate(pieces):
                h.update(piece)
                views = [head, piece] if i == 0 else [piece]
                if i == len(pieces) - 1:
                    views.append(memoryview(mac.finish(h)))
                send_views(sock, views, on_full)
    except TimeoutError:
        raise FrameError("timeout", "frame not sent within the socket's timeout") from None
    except OSError as exc:
        raise FrameError("closed", f"send failed: {exc}") from None


def send_views(sock: socket.socket, views: list[memoryview],
               on_full: Callable[[socket.socket], None] | None = None) -> None:
    """Write ``views`` in order with ``sendmsg`` until all is sent (no copy); consumes
    the list. ``on_full`` (a blocking socket only): each ``sendmsg`` takes what fits
    without waiting, and ``on_full(sock)`` runs while the socket is full (a rank reads
    its own incoming connections meanwhile: runtime/pump.py) instead of a wait in the
    kernel."""
    if on_full is not None and sock.gettimeout() is not None:
        on_full = None  # with a timeout, Python's sendmsg waits and retries itself
    while views:
        if on_full is None:
            sent = sock.sendmsg(views)
        else:
            try:
                sent = sock.sendmsg(views, (), socket.MSG_DONTWAIT)
            except BlockingIOError:
                on_full(sock)
                continue
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


class FrameReader:
    """Reads the frames of one stream through a buffer (see the module docstring).

    ``max_size``, ``mac`` and ``frame_timeout`` may change between frames (a handshake
    in plain small frames, then MAC'd ones): bytes already buffered stay. The deadline of
    a frame is ``frame_timeout`` plus its length over ``min_rate`` bytes/s (0: no
    allowance), counted from its first byte. After a :meth:`read`, ``owned`` says whether
    the body returned lives in a buffer of its own (a frame larger than the buffer),
    which the caller may keep without a copy.

    :meth:`poll` is the non-blocking way to read (after :meth:`nonblocking`): one thread
    can read many streams, taking each frame once it is whole, and a stream whose frame
    stalls half way delays no other (its deadline is checked by :meth:`overdue`). A stream
    is read with :meth:`read` or with :meth:`poll`, not both.

    ``tagged`` (with ``mac``): a frame carries a tag only if ``tagged(first body byte)``
    (None: every frame does)."""

    def __init__(self, sock: socket.socket, *, max_size: int = MAX_FRAME,
                 frame_timeout: float = 10.0, min_rate: float = 0.0,
                 mac: FrameMac | None = None, buffer_size: int = 256 << 10,
                 tagged: Callable[[int], bool] | None = None) -> None:
        self.sock, self.max_size, self.mac, self.tagged = sock, max_size, mac, tagged
        self.pool: BufferPool | None = None  # poll()'s large frames: their buffers
        self.frame_timeout, self.min_rate = frame_timeout, min_rate
        self._view = placed(bytearray(buffer_size + PAGE), buffer_size, FRAME_AT)
        self._start = self._end = 0
        self._timeout: float | None = -1.0  # the socket's, as last set here
        self._flags = 0  # poll()'s recv flags: MSG_DONTWAIT after nonblocking()
        self.owned = False
        # poll(): the frame under way (its own buffer when large) and its deadline
        self._big: memoryview | None = None
        self._got = 0
        self._due: float | None = None
        self._sized = False  # _due includes the frame's length allowance
        self._hash: Any = None  # the MAC of _big, fed its first _hashed bytes
        self._hashed = 0
        self._tagged: bool | None = None  # whether _big carries a tag, once known
        # poll(): a large untagged frame may go where ``place(buffered, length)`` says,
        # ``(k, target)``: its first k bytes to a head of their own, the rest straight
        # into ``target`` (a receive's buffer: no copy after). ``placed`` is that target
        # after a poll() that returned such a head, else None.
        self.place: Callable[[memoryview, int], tuple[int, memoryview] | None] | None = None
        self.placed: memoryview | None = None
        self._head: bytes | None = None

    def _is_tagged(self, first: int) -> bool:
        return self.mac is not None and (self.tagged is None or self.tagged(first))

    def _checked(self, payload: memoryview) -> memoryview:
        """A whole frame's body: its tag checked and cut off if it carries one."""
        if self.mac is not None and self._is_tagged(payload[0]):
            return self.mac.check(payload)
        return payload

    def _settimeout(self, value: float | None) -> None:
        if value != self._timeout:  # each change is a syscall: only when it changes
            self.sock.settimeout(value)
            self._timeout = value

    def _recv(self, into: memoryview, deadline: float | None, what: str, have: int,
              want: int) -> int:
        while True:
            if deadline is None:
                self._settimeout(None)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FrameError("timeout", f"{what}: {have} of {want} bytes before "
                                     "the deadline")
                # The socket's timeout may stay while it is within what is left: a large
                # frame's many recv calls then change it a few times, not once each.
                cur = self._timeout
                if cur is None or cur < 0 or cur > left:
                    self._settimeout(left / 2)
            try:
                got = self.sock.recv_into(into)
                break
            except TimeoutError:
                if deadline is None or time.monotonic() >= deadline:
                    raise FrameError("timeout", f"{what}: {have} of {want} bytes before "
                                     "the deadline") from None
            except OSError as exc:
                raise FrameError("closed", f"{what}: {exc}") from None
        if not got:
            if have == 0 and what == "header":
                raise FrameError("closed", "connection closed by the peer")
            raise FrameError("truncated", f"{what}: connection closed after {have} of "
                             f"{want} bytes")
        return got

    def _fill(self, n: int, deadline: float | None, what: str) -> None:
        """At least ``n`` (<= the buffer) bytes buffered."""
        if self._end - self._start >= n:
            return
        self._room(n)
        while self._end - self._start < n:
            self._end += self._recv(self._view[self._end:], deadline, what,
                                    self._end - self._start, n)

    def _room(self, n: int) -> None:
        """Room in the buffer for ``n`` bytes from the first one not yet taken: what is
        left moves to the front if need be."""
        if self._start + n > len(self._view):
            left = self._end - self._start
            self._view[:left] = self._view[self._start:self._end]
            self._start, self._end = 0, left

    def nonblocking(self) -> None:
        """Read without waiting, for :meth:`poll`: each receive says so (``MSG_DONTWAIT``)
        and the socket stays blocking, so that a thread may send on it as well (one
        connection carries both directions between two ranks: runtime/transport.py)."""
        self._settimeout(None)
        self._flags = socket.MSG_DONTWAIT

    def pending(self) -> bool:
        """Bytes buffered that :meth:`poll` has not returned (the socket may not be
        readable while a whole frame waits here)."""
        return self._end > self._start and self._big is None

    def overdue(self, now: float) -> bool:
        """A frame begun and not whole by its deadline (:meth:`poll` raises for it)."""
        return self._due is not None and now > self._due

    def _take(self, into: memoryview) -> int:
        """Bytes read without waiting (0: none now); FrameError when the stream ended."""
        try:
            got = self.sock.recv_into(into, 0, self._flags)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise FrameError("closed", f"receive failed: {exc}") from None
        if not got:
            if self._big is None and self._end == self._start:
                raise FrameError("closed", "connection closed by the peer")
            have = self._got if self._big is not None else self._end - self._start
            raise FrameError("truncated", f"connection closed after {have} bytes of a frame")
        return got

    def _late(self) -> None:
        if self._due is not None and time.monotonic() > self._due:
            raise FrameError("timeout", "frame not whole before its deadline")

    def poll(self) -> memoryview | None:
        """The next frame's body (as :meth:`read`) if it is whole with what the socket
        holds now, else None: never waits. FrameError as :meth:`read`, ``timeout`` when a
        frame begun is not whole by its deadline."""
        self.placed = None
        if self._big is None:
            # a frame whole after at most one read (a short message's) skips the general way
            s, view = self._start, self._view
            if s == self._end:  # nothing buffered: read at the front
                self._start, s, self._end = 0, 0, self._take(view)
            if self._end - s > 4 and 0 < (n := HEADER.unpack_from(view, s)[0]) <= min(
                    self.max_size, self._end - s - 4):
                self._start = s + 4 + n
                self._due, self._sized, self.owned = None, False, False
                return self._checked(view[s + 4:s + 4 + n])
            n = self._poll_small()
            if n is None:
                return None
            if n + HEADER.size <= len(self._view):
                payload = self._view[self._start:self._start + n]
                self._start += n
                self._due, self._sized, self.owned = None, False, False
                return self._checked(payload)
            # larger than the buffer: where ``place`` says, else its own of the length
            # just checked
            self._hash, self._hashed, self._tagged = None, 0, None
            buffered = self._view[self._start:self._end]
            to = None
            if self.place is not None and len(buffered) and not self._is_tagged(buffered[0]):
                to = self.place(buffered, n)
            if to is not None and (to[0] > len(buffered) or to[0] + len(to[1]) != n):
                raise ValueError(f"place: {to[0]} + {len(to[1])} bytes for a frame of {n}, "
                                 f"{len(buffered)} buffered")
            if to is not None:
                k, big = to
                self._head, self._tagged = bytes(buffered[:k]), False
                buffered = buffered[k:]
            else:
                big = self.pool.get(n) if self.pool is not None else placed(unfilled(n + PAGE),
                                                                            n)
            self._got = len(buffered)
            big[:self._got] = buffered
            self._start = self._end = 0
            self._big = big
        big = self._big
        while self._got < len(big):
            k = self._take(big[self._got:])
            if not k:
                self._feed(big)
                self._late()
                return None
            self._got += k
        self._big, self._due, self._sized, self.owned = None, None, False, True
        if self._head is not None:
            head, self._head, self._tagged, self.placed = self._head, None, None, big
            return memoryview(head)
        self._feed(big)
        h, self._hash, self._tagged = self._hash, None, None
        if h is None:
            return big
        assert self.mac is not None
        self.mac.verify(h, big[-TAG_SIZE:])
        return big[:-TAG_SIZE]

    def _feed(self, big: memoryview) -> None:
        """The MAC of a large frame under way takes the body bytes come so far (it
        checks them while the rest arrives); its first byte says whether it has one."""
        if self._tagged is None and self._got:
            self._tagged = self._is_tagged(big[0])
            if self._tagged:
                assert self.mac is not None
                if len(big) < TAG_SIZE:
                    raise FrameError("mac", f"frame of {len(big)} bytes is shorter than "
                                     "its MAC")
                self._hash = self.mac.hasher()
        upto = min(self._got, len(big) - TAG_SIZE)
        if self._hash is not None and upto > self._hashed:
            self._hash.update(big[self._hashed:upto])
            self._hashed = upto

    def _poll_small(self) -> int | None:
        """The length of the next frame once its header (and, for a frame that fits the
        buffer, its body) is buffered, with the header consumed; None: not yet."""
        if not self._more(HEADER.size):
            return None
        n: int = HEADER.unpack_from(self._view, self._start)[0]
        if n == 0:
            raise FrameError("empty", "empty frame")
        if n > self.max_size:
            raise FrameError("oversized", f"frame length {n}: at most {self.max_size}")
        if not self._sized:
            self._sized = True
            if self._due is None:
                self._due = time.monotonic() + self.frame_timeout
            if self.min_rate > 0:
                self._due += n / self.min_rate
        if n + HEADER.size <= len(self._view) and not self._more(HEADER.size + n):
            return None
        self._start += HEADER.size
        return n

    def _more(self, want: int) -> bool:
        """At least ``want`` (<= the buffer) bytes buffered, reading what the socket
        holds; False if it holds too few now."""
        if self._end - self._start >= want:
            return True
        self._room(want)
        while self._end - self._start < want:
            k = self._take(self._view[self._end:])
            if not k:
                break
            self._end += k
        if self._due is None and self._end > self._start:  # a frame's first byte
            self._due = time.monotonic() + self.frame_timeout
        if self._end - self._start >= want:
            return True
        self._late()
        return False

    def read(self, idle_timeout: float | None = None) -> memoryview:
        """The next frame's body (MAC checked and cut off), valid until the next read.

        Waits up to ``idle_timeout`` for its first byte (None: for ever); a length above
        ``max_size`` is refused before anything past the header is read or allocated."""
        if self._end == self._start:
            self._fill(1, None if idle_timeout is None else time.monotonic() + idle_timeout,
                       "header")
        deadline = time.monotonic() + self.frame_timeout
        self._fill(HEADER.size, deadline, "header")
        (n,) = HEADER.unpack_from(self._view, self._start)
        if n == 0:
            raise FrameError("empty", "empty frame")
        if n > self.max_size:
            raise FrameError("oversized", f"frame length {n}: at most {self.max_size}")
        self._start += HEADER.size
        if self.min_rate > 0:
            deadline += n / self.min_rate
        self.owned = n > len(self._view)
        if not self.owned:
            self._fill(n, deadline, "body")
            payload = self._view[self._start:self._start + n]
            self._start += n
        else:  # larger than the buffer: its own, of the length just checked
            view = placed(bytearray(n + PAGE), n)
            got = self._end - self._start
            view[:got] = self._view[self._start:self._end]
            self._start = self._end = 0
            while got < n:
                got += self._recv(view[got:], deadline, "body", got, n)
            payload = view
        return self._checked(payload)
