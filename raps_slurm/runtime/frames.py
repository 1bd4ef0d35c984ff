"""Rank-to-rank frames: the header, the types and their codec (the connections that carry
them: :mod:`raps_slurm.runtime.transport`).

A frame body is a 33-byte header ``type u8, src u32, dst u32, seq u64, epoch u64,
length u32, crc u32`` (big-endian) and, for ``DATA``, ``length`` payload bytes whose
CRC-32C is ``crc`` (the message's checksum, which receivers compare on duplicates), or
0: a large message's checksum is taken beside its send, not before it, and follows in a
``CHECKSUMS`` frame.
Between the two a DATA frame may carry fewer than :data:`ALIGN` zero bytes
(:func:`pad`): the frame's length tells how many.

Types: ``DATA`` (a message), ``HELLO`` (first frame on every connection: the sender's
epoch and, in ``seq``, what it delivered from the receiver so far; the receiver resends
what comes after), ``RESEND`` (``seq`` .. ``length`` field carries the last seq: ask
for a range), ``COVERED`` (``seq``: the floor below which the receiver's kept
checkpoints never ask again; the sender may collect), ``SENT_FLOOR`` (``seq``: the
sender's oldest kept checkpoint sent this much; the receiver may forget those
checksums), ``DELIVERED`` (``seq``: delivered so far; a finalizing sender waits for it),
``PROGRESS`` (``seq``: how many ms ago a peer the sender waits for last made progress: a
rank blocked on a rank that re-executes its lost work is not stalled either),
``CHECKSUMS`` (a payload of ``seq u64, crc u32`` pairs, :data:`SUM`: the checksums of
DATA frames sent with ``crc`` 0).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from raps_slurm.checkpoint.logstore import MAX_SEGMENT
from raps_slurm.runtime.msglog import RECORD, checksum

HEADER = struct.Struct(">BIIQQII")
DATA, HELLO, RESEND, COVERED, SENT_FLOOR, DELIVERED, PROGRESS = 1, 2, 3, 4, 5, 6, 7
CHECKSUMS = 8
NAMES = {DATA: "DATA", HELLO: "HELLO", RESEND: "RESEND", COVERED: "COVERED",
         SENT_FLOOR: "SENT_FLOOR", DELIVERED: "DELIVERED", PROGRESS: "PROGRESS",
         CHECKSUMS: "CHECKSUMS"}
SUM = struct.Struct(">QI")  # one pair of a CHECKSUMS frame: seq, crc
MAX_SUMS = 4096  # pairs in one CHECKSUMS frame (48 KiB: a frame the reader's buffer holds)
# The default bound on one message's payload (Settings.max_message): a logged message is
# one record of one log segment, or it could never be spilled to the log store.
MAX_MESSAGE = MAX_SEGMENT - RECORD.size
# A large DATA frame's payload is put at the same offset modulo ALIGN in the socket's
# buffer as in the sender's memory (:func:`pad`). The kernel copied a payload that landed
# a few bytes past its source's offset in a page at half its speed: 1.8-1.9 against
# 3.0-3.8 GB/s for 1 MiB round trips on the test machine (most likely the CPU taking
# stores 4 KiB apart from later loads as dependent).
ALIGN = 64
PAD_AT = 64 << 10  # payloads from this size on are padded
_ZEROS = bytes(ALIGN)


class Frame(NamedTuple):
    """One decoded frame (a named tuple: made once per frame received, at a third of a
    frozen dataclass's cost)."""

    kind: int
    src: int
    dst: int
    seq: int
    epoch: int
    length: int
    crc: int
    payload: bytes | memoryview = b""
    placed: memoryview | None = None  # a DATA frame's payload after ``payload``, read in place


def encode(kind: int, src: int, dst: int, seq: int, epoch: int, payload: bytes | memoryview = b"",
           *, length: int | None = None, crc: int | None = None) -> list[bytes | memoryview]:
    """The body parts of one frame, header then payload (``length`` overrides for control
    frames)."""
    n = len(payload) if length is None else length
    c = checksum(payload) if crc is None else crc
    head = HEADER.pack(kind, src, dst, seq, epoch, n, c)
    return [head, payload] if len(payload) else [head]


class FrameError(ConnectionError):
    """A frame or handshake that cannot be trusted: the connection is dropped. ``kind``
    is what :attr:`Auth.refused` counts it as."""

    def __init__(self, message: str, kind: str = "frame") -> None:
        super().__init__(message)
        self.kind = kind


def pad(lead: int, address: int) -> bytes:
    """The zero bytes between a DATA frame's header and its payload when ``lead`` bytes
    of the stream come before the payload's first byte (the frame's length prefix, the
    header, any part before it) and that byte is at ``address`` in the sender's memory:
    its offset in the socket's buffer (a frame sent alone starts a page there) then
    matches the source's modulo :data:`ALIGN`."""
    return _ZEROS[:(address - lead) % ALIGN]


def decode(body: bytes | bytearray | memoryview, *, owned: bool = False,
           placed: memoryview | None = None) -> Frame:
    """One frame from its (authenticated) body; FrameError if it is malformed. The payload
    is a copy unless ``owned`` says the body's buffer is the caller's to keep (a large
    frame read into its own buffer): then it is a view, and 8 MiB skip a copy. ``placed``:
    the rest of a DATA frame's body, read elsewhere (inbox.Placed)."""
    if len(body) < HEADER.size:
        raise FrameError(f"frame of {len(body)} bytes is shorter than its header")
    kind, src, dst, seq, epoch, length, crc = HEADER.unpack_from(body)
    if kind not in NAMES:
        raise FrameError(f"unknown frame type {kind}")
    extra = len(body) - HEADER.size
    if placed is not None:
        if kind != DATA:
            raise FrameError(f"{NAMES[kind]} frame read in place")
        extra += placed.nbytes
    if kind == DATA:
        gap = extra - length
        if not 0 <= gap < ALIGN or (gap and body[HEADER.size:HEADER.size + gap] != _ZEROS[:gap]):
            raise FrameError(f"DATA frame announces {length} bytes and carries {extra} "
                             f"(at most {ALIGN - 1} zero bytes of padding before them)")
        payload = memoryview(body)[HEADER.size + gap:]
        return Frame(kind, src, dst, seq, epoch, length, crc,
                     payload if owned else bytes(payload), placed)
    if kind == CHECKSUMS:
        if not (extra == length and 0 < extra <= MAX_SUMS * SUM.size
                and extra % SUM.size == 0):
            raise FrameError(f"CHECKSUMS frame of {extra} payload bytes announcing {length}: "
                             f"expected 1-{MAX_SUMS} pairs of {SUM.size} bytes")
        return Frame(kind, src, dst, seq, epoch, length, crc, bytes(body[HEADER.size:]))
    if extra:
        raise FrameError(f"{NAMES[kind]} frame with {extra} payload bytes")
    return Frame(kind, src, dst, seq, epoch, length, crc)


def sums(payload: bytes | memoryview) -> list[tuple[int, int]]:
    """The ``(seq, crc)`` pairs of a decoded CHECKSUMS frame's payload."""
    return [SUM.unpack_from(payload, i) for i in range(0, len(payload), SUM.size)]
