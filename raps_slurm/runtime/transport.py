"""TCP between ranks: an authenticated handshake, MAC'd frames, handed to the pump.

Each rank listens on one TCP port and publishes ``host:port`` and its epoch (through its
agent, or a directory in local mode). Two ranks talk over one connection, both ways: the
pump reads a connection this rank opened as well as one it accepted, and the listening
rank may send over the latter (:meth:`Listener.reverse`; which one is used:
runtime/links.py). Each incoming connection does its handshake on a thread of its own, then joins
the rank's :class:`~raps_slurm.runtime.pump.Pump`, which reads every connection on the
application's thread while it waits for a message and on a background thread otherwise:
a rank's reading never waits long for its application, so two ranks that send to each
other as fast as they can never block each other in TCP.

**Authentication** (docs/messaging.md, Authentication). A connection from a rank on
node ``c`` to a rank on node ``s`` is keyed by a key of that pair of nodes and the run
(:class:`RankKeys`, handed by the agents of ``c`` and ``s`` only, to the job owner's
ranks only). It starts with a challenge-response in plain frames of
:mod:`raps_slurm.wire.framing` (at most :data:`HANDSHAKE_MAX` bytes, within
:data:`HANDSHAKE_TIMEOUT`):

1. the connecting rank sends ``"raps-rank/3" | Nc (16 random bytes) | src u32 | dst u32
   | src epoch u64 | dst epoch u64 | mode u8``;
2. the listening rank looks up where the rank map puts ``src`` and at which epoch: a
   hello whose ``src epoch`` is not that one is refused. It answers ``Ns (16 random
   bytes) | P("s")`` under each key it accepts from ``src``'s node (two during a key
   rollover);
3. the connecting rank checks that one of them is ``P("s")`` under its key and answers
   ``P("c")``,

where ``P(side) = blake3(key, "raps-rank/3" | side | Nc | Ns | src | dst | epochs |
mode)``. Both sides prove they hold the pair's key, and each proof covers the other
side's fresh nonce: a recorded handshake replayed on a new connection fails. The
listener refuses a hello for another rank, another incarnation of itself (``dst
epoch``) or another ``mode``; every frame on the connection must then carry the
handshake's source, destination and source epoch.

``mode`` is ``messagelog.frame_mac``. Under ``all`` every later frame is a framing frame
``u32 length | body | tag`` whose tag is keyed blake3 (session key ``P("k")``) over the
direction, the frame's number on this connection and the body: a frame forged,
replayed, reordered or moved to another connection is refused. Under ``control`` (the
default) only the control frames carry a tag, numbered among themselves: DATA frames
travel as Open MPI's and Slurm's do, authenticated by the connection they come on, so a
message costs no MAC pass at either end. What each mode defends against:
docs/architecture.md, Trust boundaries.

A frame whose length is above the job's bound is refused from its 4-byte header,
before anything is allocated. Each refusal closes the connection, is counted in
:attr:`Auth.refused` by kind and logged in one line (at most one per kind per 10 s,
:mod:`raps_slurm.logquota`).

Frame bodies, their types and their codec: :mod:`raps_slurm.runtime.frames`.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

from raps_slurm.runtime.frames import DATA, HEADER, Frame, FrameError, decode, encode
from raps_slurm.runtime.pump import Conn, Pump
from raps_slurm.runtime.rankauth import FRAME_MAC, KEY_BYTES, PROTOCOL, Auth
from raps_slurm.wire import datapath, framing
from raps_slurm.wire.gate import Gate

log = logging.getLogger("raps.runtime")

HANDSHAKE_MAX = 96  # bytes of a handshake frame: a 2 GiB header is refused from 4 bytes
HANDSHAKE_TIMEOUT = 10.0  # the whole handshake, so a slow or silent stranger goes
MAX_HANDSHAKES = 32  # connections in their handshake at once; more evict the oldest
HANDSHAKES_PER_SOURCE = 16  # of those, from one address: at most half the slots
HANDSHAKE_DEADLINE = 5.0  # seconds a connection may take to authenticate, whatever it sends
_GATE_REASONS = {"busy": f"{MAX_HANDSHAKES} connections in their handshake",
                 "evicted": "the oldest unauthenticated connection, for a newer one",
                 "source": f"its address has {HANDSHAKES_PER_SOURCE} connections in their "
                           "handshake",
                 "timeout": f"not authenticated within {HANDSHAKE_DEADLINE:g} s"}
FRAME_TIMEOUT = 30.0  # once a frame started: this, plus its length at MIN_RATE
MIN_RATE = 10e6  # bytes/s
# Send buffer of a Unix connection (the kernel's default, some 208 KiB, woke a 1 MiB
# sender five times; 1 MiB: +15-20 % at 1 MiB between two ranks of one host, docs/benchmarks.md;
# 4 MiB lost at 8 MiB). At most this much in flight per connection.
UNIX_SNDBUF = 1 << 20
READ_BUFFER = 64 << 10  # a connection's read buffer: a frame larger goes to its own
# a DATA frame's length prefix (framing.HEADER) and header (frames.HEADER) as one
_PREFIXED = struct.Struct(framing.HEADER.format + HEADER.format.lstrip(">"))
_HELLO = struct.Struct(f">{len(PROTOCOL)}s16sIIQQB")
_NONCE = 16


# (source, its epoch, connection, the frame's buffered bytes, its length) -> (k, target):
# where a large DATA frame's body goes after its first k bytes (FrameReader.place)
Place = Callable[[int, int, int, memoryview, int], "tuple[int, memoryview] | None"]


# (source, seq, its epoch, crc, payload, connection): a DATA frame's fields, the
# connection's bounds checked (Listener's ``on_data``)
OnData = Callable[[int, int, int, int, bytes | memoryview, int], None]


def unix_name(address: tuple[str, int]) -> str:
    """The abstract Unix socket of the listener at TCP ``address``: that listener holds the
    TCP port, so no other listener on the host has the name."""
    return f"\0raps-rank/{address[0]}:{address[1]}"


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)


def _unix(address: tuple[str, int], timeout: float) -> socket.socket | None:
    """A Unix connection to the listener at ``address`` if it is on this host and runs
    under this uid; None otherwise (then TCP)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(unix_name(address))
        if peer_uid(sock) == os.getuid():
            return sock
    except OSError:
        pass
    sock.close()
    return None


def _peer(conn: socket.socket) -> str:
    try:
        name = conn.getpeername()
    except OSError:
        return "a closed connection"
    if not isinstance(name, tuple):
        return "a process on this host"  # a Unix socket: its uid was checked at accept
    return f"{name[0]}:{name[1]}"


def _kind(exc: framing.FrameError, authenticated: bool) -> str:
    if not authenticated:
        return "handshake"
    return exc.kind if exc.kind in ("mac", "oversized") else "frame"


class Listener:
    """Accepts peers' connections; every authenticated frame goes to
    ``on_frame(frame, conn_id)``, a DATA frame as plain as most are to ``on_data`` when
    given (:data:`OnData`). With ``unix`` it also listens on :func:`unix_name`
    of its TCP address, for peers on the same host (the caller's uid must be this
    rank's: another user's process is refused before its handshake)."""

    def __init__(self, host: str, on_frame: Callable[[Frame, int], None],
                 on_close: Callable[[int], None], auth: Auth, spin: float = 0.0, *,
                 unix: bool = False, place: Place | None = None,
                 on_data: OnData | None = None) -> None:
        self.auth = auth
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(128)
        self.address = self.sock.getsockname()[:2]
        self.usock = self._unix_listener() if unix else None
        self.unix = unix
        self._on_frame, self._on_close, self._place = on_frame, on_close, place
        self._on_data = on_data
        self._conns: dict[int, socket.socket] = {}
        self._reverse: dict[int, Outgoing] = {}  # src -> its connection's sending side
        self._lock = threading.Lock()
        self._next = 0
        self._gate = Gate(MAX_HANDSHAKES, self._count, per_source=HANDSHAKES_PER_SOURCE,
                          deadline=HANDSHAKE_DEADLINE)
        self._closed = False
        self.pump = Pump(self._body, self._end, spin)
        for sock in (self.sock, self.usock):
            if sock is not None:
                threading.Thread(target=self._accept, args=(sock,), name="raps-accept",
                                 daemon=True).start()

    def _unix_listener(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(unix_name(self.address))
            sock.listen(128)
            return sock
        except OSError as exc:  # taken by someone who guessed the port: TCP only
            log.warning("rank %d: no Unix socket for peers on this host (%s): TCP only",
                        self.auth.rank, exc)
            sock.close()
            return None

    def connect(self, address: tuple[str, int], epoch: int, dst: int,
                timeout: float = 5.0) -> Outgoing:
        """An authenticated connection to rank ``dst`` at ``address`` (OSError if not):
        over a Unix socket when the peer is on this host and this listener uses them.
        The pump reads it too: ``dst`` may answer over it (:meth:`reverse`)."""
        o = Outgoing(address, epoch, self.auth, dst, timeout, unix=self.unix,
                     on_full=self.pump.stalled)
        reader = framing.FrameReader(o.sock, max_size=self.auth.max_frame,
                                     buffer_size=READ_BUFFER)
        self._session(reader, o.session, b"s")
        with self._lock:
            if self._closed:
                o.close()
                raise OSError("listener closed")
            self._next += 1
            o.cid = self._next
            self._conns[o.cid] = o.sock
        o.shared = True  # the pump closes it
        self._join(Conn(o.cid, o.sock, reader, dst, epoch))
        return o

    def _accept(self, sock: socket.socket) -> None:
        local = sock.family == socket.AF_UNIX
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
            if local and (uid := peer_uid(conn)) != os.getuid():
                self.auth.refuse("uid", f"uid {uid}", "a Unix connection from another uid")
                conn.close()
                continue
            # A slot per handshake, bounded per source: a stranger's connections are
            # evicted before a peer's, and none outlives HANDSHAKE_DEADLINE (gate.py).
            if not self._gate.admit(conn):
                conn.close()
                continue
            with self._lock:
                self._next += 1
                cid = self._next
                self._conns[cid] = conn
            if not local:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                threading.Thread(target=self._read, args=(conn, cid),
                                 name=f"raps-read-{cid}", daemon=True).start()
            except RuntimeError:  # no thread could be started: the slot goes back
                self._gate.leave(conn)
                self._ended(cid, conn, None, authenticated=False)

    def _count(self, kind: str) -> None:
        """One connection the gate refused or ended (``busy`` is ``connections``)."""
        self.auth.refuse("connections" if kind == "busy" else kind, "a peer",
                         _GATE_REASONS.get(kind, kind))

    def _handshake(self, conn: socket.socket
                   ) -> tuple[framing.FrameReader, int, int, bytes]:
        """The server side of the handshake: the reader for the session, the peer, its
        epoch and the session key."""
        reader = framing.FrameReader(conn, max_size=HANDSHAKE_MAX,
                                     frame_timeout=HANDSHAKE_TIMEOUT, buffer_size=READ_BUFFER)
        hello = reader.read(idle_timeout=HANDSHAKE_TIMEOUT)
        if len(hello) != _HELLO.size:
            raise FrameError(f"first frame of {len(hello)} bytes is not a rank hello",
                             "handshake")
        proto, nc, src, dst, src_epoch, dst_epoch, mode = _HELLO.unpack(hello)
        if proto != PROTOCOL:
            raise FrameError("first frame is not a rank hello", "handshake")
        if dst != self.auth.rank or dst_epoch != self.auth.epoch:
            raise FrameError(f"hello for rank {dst} epoch {dst_epoch}, this is rank "
                             f"{self.auth.rank} epoch {self.auth.epoch}", "handshake")
        if mode != self.auth.mode:
            theirs = FRAME_MAC[mode] if mode < len(FRAME_MAC) else f"mode {mode}"
            raise FrameError(f"rank {src} uses frame_mac {theirs}, this rank "
                             f"{self.auth.frame_mac}: a job's nodes must share "
                             "messagelog.frame_mac", "handshake")
        keys = self.auth.keys_for(src)
        if keys.epoch is not None and keys.epoch != src_epoch:
            keys = self.auth.keys_for(src, fresh=True)  # it may have moved since
            if keys.epoch != src_epoch:
                raise FrameError(f"hello from rank {src} epoch {src_epoch}; the rank map "
                                 f"has it at epoch {keys.epoch}", "epoch")
        bound = (src, dst, src_epoch, dst_epoch)
        ns = os.urandom(_NONCE)
        proofs = [self.auth.proof(k, b"s", nc, ns, *bound) for k in keys.accept[:2]]
        framing.send_parts(conn, [ns, *proofs], max_size=HANDSHAKE_MAX)
        answer = reader.read(idle_timeout=HANDSHAKE_TIMEOUT)
        key = next((k for k in keys.accept[:2] if hmac.compare_digest(
            answer, self.auth.proof(k, b"c", nc, ns, *bound))), None)
        if key is None:
            self.auth.forget(src)
            raise FrameError(f"rank {src}'s proof does not match the key of its node",
                             "authentication")
        session = self.auth.proof(key, b"k", nc, ns, *bound)
        self._session(reader, session, b"c")
        return reader, src, src_epoch, session

    def _session(self, reader: framing.FrameReader, session: bytes, side: bytes) -> None:
        """``reader`` set for a session's frames from ``side`` (``c``: the connecting
        rank's, ``s``: the listening rank's on the same connection)."""
        reader.mac = framing.FrameMac(session, "blake3", side)
        reader.tagged = self.auth.tagged
        reader.max_size = self.auth.max_frame
        reader.frame_timeout, reader.min_rate = FRAME_TIMEOUT, MIN_RATE
        reader.nonblocking()
        reader.pool = self.pump.buffers

    def _read(self, conn: socket.socket, cid: int) -> None:
        """The handshake, on a thread of its own (a stranger's slowness costs no one
        else); then the connection joins the :class:`Pump`."""
        evicted = False
        try:
            try:
                reader, src, epoch, session = self._handshake(conn)
            finally:
                evicted = self._gate.evicted(conn)  # then counted by the gate already
                self._gate.leave(conn)
        except Exception as exc:  # refused or logged, then closed
            self._ended(cid, conn, None if evicted else exc, authenticated=False)
            return
        with self._lock:
            old = self._reverse.get(src)
            if old is None or old.peer_epoch <= epoch:
                # this rank may answer over it (reverse): one connection for both ways
                self._reverse[src] = Outgoing.over(conn, session, epoch, self.auth, cid,
                                                   on_full=self.pump.stalled)
        self._join(Conn(cid, conn, reader, src, epoch))

    def _join(self, c: Conn) -> None:
        if self._place is not None:
            where, src, epoch, cid = self._place, c.src, c.epoch, c.cid
            c.reader.place = lambda buffered, n: where(src, epoch, cid, buffered, n)
        self.pump.add(c)

    def reverse(self, src: int, epoch: int) -> Outgoing | None:
        """The sending side of ``src``'s own connection to this rank, if one at ``epoch``
        or later is open and not yet taken: handed out once (the caller sends on it from
        then on, and frames go in order on one connection only)."""
        with self._lock:
            o = self._reverse.get(src)
            if o is None or o.peer_epoch < epoch:
                return None
            del self._reverse[src]
            return o

    def _body(self, c: Conn, body: memoryview, owned: bool) -> None:
        if len(body) > self.auth.max_frame - framing.TAG_SIZE:  # an untagged frame's bound
            raise FrameError(f"frame of {len(body)} bytes: at most "
                             f"{self.auth.max_frame - framing.TAG_SIZE}", "oversized")
        if body[0] == DATA and self._on_data is not None and c.reader.placed is None:
            # A message with no padding, as this connection's handshake bound it: straight
            # to the rank (a frame's own way cost a short message's receive 2-3 us);
            # anything else is decode()'s to check.
            _, src, dst, seq, epoch, length, crc = HEADER.unpack_from(body)
            n = len(body) - HEADER.size
            if n == length <= self.auth.max_message and src == c.src \
                    and dst == self.auth.rank and epoch == c.epoch:
                self._on_data(src, seq, epoch, crc, body[HEADER.size:] if owned
                              else bytes(body[HEADER.size:]), c.cid)
                return
        frame = decode(body, owned=owned, placed=c.reader.placed)
        if frame.length > self.auth.max_message and frame.kind == DATA:
            raise FrameError(f"message of {frame.length} bytes: at most "
                             f"{self.auth.max_message}", "oversized")
        if frame.src != c.src or frame.dst != self.auth.rank or frame.epoch != c.epoch:
            raise FrameError(f"frame {frame.src}->{frame.dst} epoch {frame.epoch} on rank "
                             f"{c.src}'s connection of epoch {c.epoch}")
        self._on_frame(frame, c.cid)

    def _end(self, c: Conn, exc: BaseException) -> None:
        self._ended(c.cid, c.sock, exc, authenticated=True)

    def _ended(self, cid: int, conn: socket.socket, exc: BaseException | None, *,
               authenticated: bool) -> None:
        """A connection is over: say why (a refusal is counted), forget it."""
        if isinstance(exc, framing.FrameError):
            if self._closed or exc.kind == "closed" or (
                    authenticated and exc.kind == "truncated"):
                log.debug("incoming connection %d ended: %s", cid, exc)  # a peer went away
            else:
                self.auth.refuse(_kind(exc, authenticated), _peer(conn), exc)
        elif isinstance(exc, FrameError):
            if not self._closed:
                self.auth.refuse(exc.kind, _peer(conn), exc)
        elif isinstance(exc, OSError):
            if not self._closed:
                log.debug("incoming connection %d dropped: %s", cid, exc)
        elif exc is not None and not self._closed:
            log.error("rank %d: incoming connection %d: %r", self.auth.rank, cid, exc)
        with self._lock:
            self._conns.pop(cid, None)
            for src, o in list(self._reverse.items()):
                if o.cid == cid:
                    del self._reverse[src]
        with contextlib.suppress(OSError):
            conn.close()
        if authenticated:
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
        for sock in (self.sock, self.usock):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes its accept
                with contextlib.suppress(OSError):
                    sock.close()
        self.pump.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


class Outgoing:
    """The sending side of an authenticated connection to one peer: one this rank opened
    (the pump reads the peer's answers on it), or the peer's (:meth:`over`)."""

    cid: int | None = None  # the connection's, once the pump reads it
    shared = False  # the pump reads it too, and closes it
    theirs = False  # the peer opened it (:meth:`over`)

    def __init__(self, address: tuple[str, int], epoch: int, auth: Auth, dst: int,
                 timeout: float = 5.0, *, unix: bool = False,
                 on_full: Callable[[socket.socket], None] | None = None) -> None:
        self._setup(epoch, auth, on_full)
        peer = f"{address[0]}:{address[1]}"
        sock = _unix(address, timeout) if unix else None
        self.local = sock is not None  # over a Unix socket: the peer is on this host
        if sock is not None:
            self.sock = sock
            try:
                self.session = self._handshake(auth, dst, peer, timeout)
            except (OSError, FrameError) as exc:
                log.debug("rank %d: Unix connection to rank %d failed (%s): TCP", auth.rank,
                          dst, exc)
                self.close()
                self.local = False
        if not self.local:
            self.sock = socket.create_connection(address, timeout=timeout)
            try:
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.session = self._handshake(auth, dst, peer, timeout)
            except BaseException:
                self.close()
                raise
        self.mac = framing.FrameMac(self.session, "blake3", b"c")
        self._ready()

    def _setup(self, epoch: int, auth: Auth,
               on_full: Callable[[socket.socket], None] | None) -> None:
        self.peer_epoch = epoch
        self._on_full = on_full  # while the socket is full (Pump.stalled)
        self._max, self._max_message = auth.max_frame, auth.max_message
        self._tagged = auth.tagged
        # send_data's own way: frames written here, DATA ones untagged (fixed per rank)
        self._plain = on_full is not None and not auth.tagged(DATA)
        self.lock = threading.Lock()

    def _ready(self) -> None:
        self.sock.settimeout(None)
        if self.local:  # a 1 MiB message goes in one write, not five wake-ups of the sender
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)

    @classmethod
    def over(cls, sock: socket.socket, session: bytes, epoch: int, auth: Auth, cid: int, *,
             on_full: Callable[[socket.socket], None] | None = None) -> Outgoing:
        """The sending side of the peer's connection ``cid`` to this rank, after its
        handshake (session key ``session``, the peer at ``epoch``): this rank's frames
        carry the other direction's label (``s``), so none can be sent back as the
        peer's."""
        o = cls.__new__(cls)
        o._setup(epoch, auth, on_full)
        o.sock, o.session, o.cid, o.shared, o.theirs = sock, session, cid, True, True
        o.local = sock.family == socket.AF_UNIX
        o.mac = framing.FrameMac(session, "blake3", b"s")
        o._ready()
        return o

    def _handshake(self, auth: Auth, dst: int, peer: str, timeout: float) -> bytes:
        key = auth.keys_for(dst).connect
        if not key:
            raise FrameError(f"no key to reach rank {dst} at {peer}: this node holds no "
                             "ticket for its node", "authentication")
        nc = os.urandom(_NONCE)
        bound = (auth.rank, dst, auth.epoch, self.peer_epoch)
        try:
            framing.send_parts(self.sock, [_HELLO.pack(PROTOCOL, nc, *bound, auth.mode)],
                               max_size=HANDSHAKE_MAX)
            reader = framing.FrameReader(self.sock, max_size=HANDSHAKE_MAX,
                                         frame_timeout=timeout, buffer_size=256)
            answer = bytes(reader.read(idle_timeout=timeout))
        except framing.FrameError as exc:
            raise FrameError(f"handshake with rank {dst} at {peer}: {exc}",
                             "handshake") from None
        ns, proofs = answer[:_NONCE], answer[_NONCE:]
        expected = auth.proof(key, b"s", nc, ns, *bound)
        if len(ns) != _NONCE or len(proofs) not in (KEY_BYTES, 2 * KEY_BYTES) or not any(
                hmac.compare_digest(proofs[i:i + KEY_BYTES], expected)
                for i in range(0, len(proofs), KEY_BYTES)):
            # someone else listens there (a stale address, or a stranger): not our peer
            auth.forget(dst)
            auth.refuse("authentication", peer, f"it did not prove it holds the key of "
                        f"rank {dst}'s node")
            raise FrameError(f"rank {dst} at {peer} failed authentication", "authentication")
        try:
            framing.send_parts(self.sock, [auth.proof(key, b"c", nc, ns, *bound)],
                               max_size=HANDSHAKE_MAX)
        except framing.FrameError as exc:
            raise FrameError(f"handshake with rank {dst} at {peer}: {exc}",
                             "handshake") from None
        return auth.proof(key, b"k", nc, ns, *bound)

    def send(self, parts: list[bytes | memoryview]) -> None:
        """Write one frame whole, its header first (OSError if the peer is gone or the
        frame is larger than the job's bound); MAC'd as ``frame_mac`` says. While the
        socket is full, ``on_full`` runs (the sending thread reads its own incoming
        connections: the peer may be sending to us just as well)."""
        mac = self.mac if self._tagged(parts[0][0]) else None
        bound = self._max if mac is not None else self._max - framing.TAG_SIZE
        if parts[0][0] == DATA and len(parts) > 1:
            # the frame's bound leaves room for padding: the payload's own is tighter
            bound = min(bound, len(parts[0]) + self._max_message + (
                framing.TAG_SIZE if mac is not None else 0))
        with self.lock:
            try:
                framing.send_parts(self.sock, parts, mac=mac, max_size=bound,
                                   on_full=self._on_full)
            except framing.FrameError as exc:
                raise FrameError(str(exc), exc.kind) from None

    def send_data(self, src: int, dst: int, seq: int, epoch: int, crc: int, body: bytes
                  ) -> None:
        """:meth:`send` of a DATA frame whose payload is ``body`` (below
        :data:`~raps_slurm.runtime.frames.PAD_AT`: no padding; within the job's bound),
        its length prefix and header packed at once and both written by one ``sendmsg``
        where the socket takes them."""
        if not self._plain or self.sock.gettimeout() is not None:
            self.send(encode(DATA, src, dst, seq, epoch, body, crc=crc))
            return
        n = len(body)
        head = _PREFIXED.pack(HEADER.size + n, DATA, src, dst, seq, epoch, n, crc)
        with self.lock:
            try:
                sent = self.sock.sendmsg([head, body], (), socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise FrameError(f"send failed: {exc}", "closed") from None
            if sent < len(head) + n:
                try:
                    framing.send_views(self.sock, [memoryview(head + body)[sent:]],
                                       self._on_full)
                except OSError as exc:
                    raise FrameError(f"send failed: {exc}", "closed") from None

    def send_logged(self, head: bytes, parts: list[bytes | bytearray | memoryview],
                    log: memoryview) -> int:
        """Write one untagged DATA frame (``head`` then ``parts``) and copy ``parts`` into
        ``log`` as it goes (wire/datapath.py); ``log`` is whole once this returns or
        raises (OSError, as :meth:`send`). Returns the CRC-32C of ``parts``."""
        with self.lock:
            try:
                return datapath.send_frame(self.sock, head, parts, log,
                                           max_size=self._max - framing.TAG_SIZE,
                                           on_full=self._on_full)
            except framing.FrameError as exc:
                raise FrameError(str(exc), exc.kind) from None

    def close(self) -> None:
        """Close (a connection the pump reads: shut down, and the pump closes it once it
        has seen the end)."""
        with contextlib.suppress(OSError):
            if self.shared:
                self.sock.shutdown(socket.SHUT_RDWR)
            else:
                self.sock.close()
