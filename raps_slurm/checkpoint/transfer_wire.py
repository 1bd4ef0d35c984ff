"""The transfer protocol's wire (:mod:`raps_slurm.checkpoint.transfer`): the
authenticated channel and its frames, the handshake messages and proofs, and the chunk
records frame bodies carry."""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import socket
import struct
import time
from collections.abc import Iterable, Iterator
from typing import Any

import blake3

from raps_slurm.checkpoint.codec import RAW, ChunkError, Decoder, hasher
from raps_slurm.checkpoint.manifest import is_hex_digest
from raps_slurm.checkpoint.pack import HEADER, MAX_CHUNK, STORED_SLACK
from raps_slurm.errors import RapsError
from raps_slurm.wire import framing
from raps_slurm.wire.framing import FrameError

MAX_FRAME = 64 << 20
TIMEOUT = 30.0  # idle wait for a request (server) or a reply (client)
REQUEST_TIMEOUT = 10.0  # one whole frame, plus its length at MIN_RATE
MIN_RATE = 1 << 20  # bytes/s a peer must at least keep up within a frame
_LEN = struct.Struct(">I")
_MAC = 32
# A payload this large is received into a fresh anonymous map, not a bytearray: the
# bytearray is zero-filled while the GIL is held (16 MiB of new pages cost tens of ms on
# the test machine, and a restore receives a rank's whole state), the map's pages are
# touched by the kernel inside recv, with the GIL released.
MAPPED_PAYLOAD = 1 << 20
MAX_LOG_SEGMENTS_PER_PUT = 4096


class TransferError(RapsError):
    """A transfer failed: peer unreachable, refused, not authentic, or malformed."""


class Channel:
    """One authenticated connection (either side)."""

    def __init__(self, sock: socket.socket, session_key: bytes, client: bool, *,
                 idle_timeout: float = TIMEOUT, request_timeout: float = REQUEST_TIMEOUT,
                 min_rate: float = MIN_RATE) -> None:
        self.sock = sock
        self._key = session_key
        self._send_dir, self._recv_dir = (b"c", b"s") if client else (b"s", b"c")
        self._send_seq = self._recv_seq = 0
        self.idle_timeout, self.request_timeout = idle_timeout, request_timeout
        self.min_rate = min_rate

    def _allowance(self, n: int) -> float:
        """Seconds a frame of ``n`` bytes may take."""
        return self.request_timeout + n / self.min_rate

    def _mac(self, direction: bytes, seq: int) -> Any:
        """Keyed blake3 over direction, sequence number and frame: a MAC (the session key
        is 32 bytes) at several GB/s, where HMAC-SHA256 made every copied GiB cost a second."""
        return blake3.blake3(direction + seq.to_bytes(8, "big"), key=self._key)

    def send(self, header: dict[str, Any], body: bytes | memoryview = b"") -> None:
        """One frame: ``header`` as JSON, then ``body``, then the MAC."""
        head = json.dumps(header, separators=(",", ":")).encode()
        payload_len = _LEN.size + len(head) + len(body)
        if payload_len > MAX_FRAME:
            raise TransferError(f"frame of {payload_len} bytes exceeds {MAX_FRAME}")
        mac = self._mac(self._send_dir, self._send_seq)
        prefix = _LEN.pack(len(head)) + head
        mac.update(prefix)
        mac.update(body)
        self._send_seq += 1
        self.sock.settimeout(self._allowance(payload_len))
        self.sock.sendall(_LEN.pack(payload_len) + prefix)
        if body:
            self.sock.sendall(body)
        self.sock.sendall(mac.digest())

    def recv(self) -> tuple[dict[str, Any], memoryview]:
        """The next frame: its first byte within ``idle_timeout``, all of it within
        ``request_timeout`` plus its length at ``min_rate``; TransferError (its cause a
        FrameError when the stream failed, ``timeout`` for a deadline)."""
        head = memoryview(bytearray(_LEN.size))
        _recv(self.sock, head[:1], time.monotonic() + self.idle_timeout, "header")
        deadline = time.monotonic() + self.request_timeout
        _recv(self.sock, head[1:], deadline, "length")
        (n,) = _LEN.unpack(head)
        if not _LEN.size <= n <= MAX_FRAME:
            raise TransferError(f"frame length {n} outside {_LEN.size}..{MAX_FRAME}")
        deadline += n / self.min_rate
        payload: bytearray | mmap.mmap = mmap.mmap(-1, n) if n >= MAPPED_PAYLOAD \
            else bytearray(n)
        _recv(self.sock, memoryview(payload), deadline, "payload")
        mac = bytearray(_MAC)
        _recv(self.sock, memoryview(mac), deadline, "mac")
        check = self._mac(self._recv_dir, self._recv_seq)
        check.update(payload)
        if not hmac.compare_digest(bytes(mac), check.digest()):
            raise TransferError("frame authentication failed")
        self._recv_seq += 1
        return split_payload(payload)


def split_payload(payload: bytes | bytearray | mmap.mmap) -> tuple[dict[str, Any], memoryview]:
    """(JSON header, body) of an authenticated frame's payload; TransferError if malformed."""
    if len(payload) < _LEN.size:
        raise TransferError(f"frame of {len(payload)} bytes has no header length")
    (hlen,) = _LEN.unpack_from(payload)
    if hlen > len(payload) - _LEN.size:
        raise TransferError("frame header longer than the frame")
    try:
        header = json.loads(payload[_LEN.size:_LEN.size + hlen])
    except (ValueError, UnicodeDecodeError) as exc:
        raise TransferError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise TransferError("frame header is not a JSON object")
    return header, memoryview(payload)[_LEN.size + hlen:]


def _recv(sock: socket.socket, view: memoryview, deadline: float, what: str) -> None:
    try:
        framing.recv_into(sock, view, deadline, what)
    except FrameError as exc:
        raise TransferError(str(exc)) from exc


def send_handshake(sock: socket.socket, obj: dict[str, Any], deadline: float) -> None:
    """One handshake message (length-prefixed JSON, before any key is agreed)."""
    data = json.dumps(obj).encode()
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_handshake(sock: socket.socket, deadline: float) -> dict[str, Any]:
    """One handshake message, all of it by ``deadline``; TransferError if malformed."""
    head = memoryview(bytearray(_LEN.size))
    _recv(sock, head, deadline, "header")
    (n,) = _LEN.unpack(head)
    if not 1 <= n <= 4096:
        raise TransferError(f"handshake message of {n} bytes")
    body = bytearray(n)
    _recv(sock, memoryview(body), deadline, "handshake")
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise TransferError("handshake message is not JSON") from None
    if not isinstance(obj, dict):
        raise TransferError("handshake message is not an object")
    return obj


def handshake_proof(key: bytes, side: bytes, nc: bytes, ns: bytes, client: str,
                    server: str) -> str:
    """``HMAC(key, side | nc | ns | client | server)``: ``side`` b"s" proves the server,
    b"c" the client."""
    msg = side + nc + ns + client.encode() + b"\0" + server.encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def hello_nonce(obj: dict[str, Any]) -> bytes:
    """The 16-byte nonce of a handshake hello; TransferError if it has none."""
    text = obj.get("nonce")
    if not isinstance(text, str) or len(text) != 32:
        raise TransferError("handshake without a valid nonce")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise TransferError("handshake without a valid nonce") from None


def hello_node(obj: dict[str, Any]) -> str:
    """The node name of a handshake hello; TransferError if it has none."""
    name = obj.get("node")
    if not isinstance(name, str) or not 0 < len(name) <= 255:
        raise TransferError("handshake without a valid node name")
    return name


def encode_records(chunks: Iterable[tuple[str, int, bytes | memoryview]]) -> bytes:
    """Chunk records for a frame body."""
    parts: list[bytes | memoryview] = []
    for d, raw, s in chunks:
        parts.append(HEADER.pack(bytes.fromhex(d), raw, len(s)))
        parts.append(s)
    return b"".join(parts)


def decode_records(body: memoryview) -> Iterator[tuple[str, int, memoryview]]:
    """(digest, raw size, stored bytes) of each record; TransferError if malformed."""
    pos = 0
    while pos < len(body):
        if len(body) - pos < HEADER.size:
            raise TransferError("truncated chunk record")
        digest, raw, stored = HEADER.unpack_from(body, pos)
        if not (0 < raw <= MAX_CHUNK and 1 <= stored <= raw + STORED_SLACK):
            raise TransferError(f"chunk record with sizes {raw}/{stored}")
        start = pos + HEADER.size
        if start + stored > len(body):
            raise TransferError("truncated chunk record")
        yield digest.hex(), raw, body[start:start + stored]
        pos = start + stored


def verify_chunk(algo: str, digest: str, raw: int, stored: bytes | memoryview,
                 decoder: Decoder) -> str | None:
    """None if ``stored`` decodes to ``raw`` bytes named ``digest``; else the reason."""
    data: memoryview
    if len(stored) == raw + 1 and stored[0] == RAW:
        data = memoryview(stored)[1:]  # a raw chunk is its own decoding: no copy
    else:
        try:
            data = decoder.decode_scratch(stored, raw)
        except ChunkError as exc:
            return str(exc)
    if hasher(algo)(data).hex() != digest:
        return "content does not match its digest"
    return None


# --- request fields: each checked, a malformed one refused with what is allowed ---


def job_field(header: dict[str, Any]) -> str:
    job = header.get("job")
    if not (isinstance(job, str) and job.isascii() and job.isdigit() and 0 < len(job) <= 20):
        raise TransferError(f"bad job id {job!r:.40}")
    return job


def int_field(header: dict[str, Any], name: str, lo: int = 0) -> int:
    v = header.get(name)
    if type(v) is not int or v < lo or v >= 2**63:
        raise TransferError(f"field {name!r}: expected an integer >= {lo}")
    return v


def segs_field(header: dict[str, Any], body_len: int) -> list[tuple[int, int]]:
    """``segs`` of a ``log_put``: [number, size] pairs, numbers ascending, the sizes
    adding up to the body's length."""
    v = header.get("segs")
    if not isinstance(v, list) or not 1 <= len(v) <= MAX_LOG_SEGMENTS_PER_PUT:
        raise TransferError(f"field 'segs': expected 1..{MAX_LOG_SEGMENTS_PER_PUT} "
                            "[number, size] pairs")
    out: list[tuple[int, int]] = []
    for item in v:
        if not (isinstance(item, list) and len(item) == 2
                and all(type(x) is int and 0 <= x < 2**63 for x in item) and item[0] >= 1):
            raise TransferError("field 'segs': expected [number >= 1, size >= 0] pairs")
        if out and item[0] <= out[-1][0]:
            raise TransferError("field 'segs': segment numbers must ascend")
        out.append((item[0], item[1]))
    if sum(size for _, size in out) != body_len:
        raise TransferError(f"field 'segs': sizes add up to {sum(sz for _, sz in out)}, "
                            f"the body has {body_len} bytes")
    return out


def part_field(header: dict[str, Any]) -> tuple[int, int, int]:
    """``part`` of a ``log_put``: [number, offset, segment size] of one piece."""
    v = header.get("part")
    if not (isinstance(v, list) and len(v) == 3
            and all(type(x) is int and 0 <= x < 2**63 for x in v) and v[0] >= 1):
        raise TransferError("field 'part': expected [number >= 1, offset, size]")
    return v[0], v[1], v[2]


def cursor_field(header: dict[str, Any]) -> tuple[int, int]:
    """``from`` of a ``log_get``: [segment number, offset], default [0, 0]."""
    v = header.get("from", [0, 0])
    if not (isinstance(v, list) and len(v) == 2
            and all(type(x) is int and 0 <= x < 2**63 for x in v)):
        raise TransferError("field 'from': expected [segment number, offset]")
    return v[0], v[1]


def digests_field(header: dict[str, Any]) -> list[str]:
    v = header.get("digests")
    if not isinstance(v, list) or len(v) > 1 << 22 or \
            not all(isinstance(d, str) and is_hex_digest(d) for d in v):
        raise TransferError("field 'digests': expected a list of 64-hex-digit names")
    return v
