"""TCP between ranks: frames, connections, the reader threads.

Each rank listens on one TCP port and publishes ``host:port`` and its epoch (through its
agent, or a directory in local mode). A rank sends over one outgoing connection per
peer and reads every incoming connection on its own thread, which only decodes frames
and hands them on: a rank's reading never waits for its application, so two ranks that
send to each other as fast as they can never block each other in TCP.

A frame is a 34-byte header ``type u8, src u32, dst u32, seq u64, epoch u64, length
u32, crc32 u32`` (big-endian) and ``length`` payload bytes whose CRC-32 is ``crc``
(checked on arrival: a damaged frame closes the connection, and the gap it leaves is
repaired by a resend).

Types: ``DATA`` (a message), ``HELLO`` (first frame on every connection: the sender's
epoch and, in ``seq``, what it delivered from the receiver so far; the receiver resends
what comes after), ``RESEND`` (``seq`` .. ``length`` field carries the last seq: ask
for a range), ``COVERED`` (``seq``: the floor below which the receiver's kept
checkpoints never ask again; the sender may collect), ``SENT_FLOOR`` (``seq``: the
sender's oldest kept checkpoint sent this much; the receiver may forget those
checksums), ``DELIVERED`` (``seq``: delivered so far; a finalizing sender waits for it).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("raps.runtime")

HEADER = struct.Struct(">BIIQQII")
DATA, HELLO, RESEND, COVERED, SENT_FLOOR, DELIVERED = 1, 2, 3, 4, 5, 6
NAMES = {DATA: "DATA", HELLO: "HELLO", RESEND: "RESEND", COVERED: "COVERED",
         SENT_FLOOR: "SENT_FLOOR", DELIVERED: "DELIVERED"}
MAX_PAYLOAD = 1 << 31


@dataclass(frozen=True)
class Frame:
    """One decoded frame."""

    kind: int
    src: int
    dst: int
    seq: int
    epoch: int
    length: int
    crc: int
    payload: bytes = b""


def encode(kind: int, src: int, dst: int, seq: int, epoch: int, payload: bytes | memoryview = b"",
           *, length: int | None = None, crc: int | None = None) -> list[bytes | memoryview]:
    """Header and payload parts of one frame (``length`` overrides for control frames)."""
    n = len(payload) if length is None else length
    c = (zlib.crc32(payload) & 0xFFFFFFFF) if crc is None else crc
    head = HEADER.pack(kind, src, dst, seq, epoch, n, c)
    return [head, payload] if payload else [head]


class FrameError(ConnectionError):
    """A frame that cannot be trusted: the connection is dropped."""


def read_frame(sock: socket.socket) -> Frame | None:
    """The next frame, None at a clean end of stream; FrameError if damaged."""
    head = _exact(sock, HEADER.size, eof_ok=True)
    if head is None:
        return None
    kind, src, dst, seq, epoch, length, crc = HEADER.unpack(head)
    if kind not in NAMES:
        raise FrameError(f"unknown frame type {kind}")
    payload = b""
    if kind == DATA:
        if length > MAX_PAYLOAD:
            raise FrameError(f"frame of {length} bytes")
        payload = _exact(sock, length) or b""
        if zlib.crc32(payload) & 0xFFFFFFFF != crc:
            raise FrameError(f"frame {src}->{dst} seq {seq}: checksum mismatch")
    return Frame(kind, src, dst, seq, epoch, length, crc, payload)


def _exact(sock: socket.socket, n: int, eof_ok: bool = False) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0 and eof_ok:
                return None
            raise FrameError("connection closed in the middle of a frame")
        got += k
    return bytes(buf)


class Listener:
    """Accepts peers' connections; every frame goes to ``on_frame(frame, conn_id)``."""

    def __init__(self, host: str, on_frame: Callable[[Frame, int], None],
                 on_close: Callable[[int], None]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(128)
        self.address = self.sock.getsockname()[:2]
        self._on_frame, self._on_close = on_frame, on_close
        self._conns: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._closed = False
        threading.Thread(target=self._accept, name="raps-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._next += 1
                cid = self._next
                self._conns[cid] = conn
            threading.Thread(target=self._read, args=(conn, cid), name=f"raps-read-{cid}",
                             daemon=True).start()

    def _read(self, conn: socket.socket, cid: int) -> None:
        try:
            while True:
                frame = read_frame(conn)
                if frame is None:
                    break
                self._on_frame(frame, cid)
        except (OSError, FrameError) as exc:
            if not self._closed:
                log.debug("incoming connection %d dropped: %s", cid, exc)
        finally:
            with self._lock:
                self._conns.pop(cid, None)
            with contextlib.suppress(OSError):
                conn.close()
            self._on_close(cid)

    def drop(self, cid: int) -> None:
        """Close one incoming connection (a refused peer)."""
        with self._lock:
            conn = self._conns.get(cid)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop accepting and close every incoming connection."""
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
        with contextlib.suppress(OSError):
            self.sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


class Outgoing:
    """The connection to one peer (sends only; its answers come on the peer's own
    connection to us)."""

    def __init__(self, address: tuple[str, int], epoch: int, timeout: float = 5.0) -> None:
        self.peer_epoch = epoch
        self.sock = socket.create_connection(address, timeout=timeout)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lock = threading.Lock()

    def send(self, parts: list[bytes | memoryview]) -> None:
        """Write one frame whole (OSError if the peer is gone)."""
        views = [memoryview(p) for p in parts if len(p)]
        with self.lock:
            while views:
                n = self.sock.sendmsg(views)
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]

    def close(self) -> None:
        """Close."""
        with contextlib.suppress(OSError):
            self.sock.close()
