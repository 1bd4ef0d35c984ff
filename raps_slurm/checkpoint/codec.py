"""Chunk codec: content-defined cut points, digests, compression. Pure computation, no I/O.

A checkpoint's data is a sequence of *items* (a bytes-like object, or a numpy array
taken through the buffer protocol without a copy). Each item is cut by FastCDC
(``pyfastcdc``) into chunks of about ``avg_chunk_kb``; a chunk is named by the digest
of its raw bytes (``blake3`` or ``sha256``), so an unchanged region of the state gives
the same chunk names as last time and is not written again.

A stored chunk is one codec byte followed by the payload:

  0 RAW      the raw bytes (incompressible data: zstd would only cost time)
  1 ZSTD     zstd frame of the raw bytes
  2 SHUF     zstd frame of the bytes regrouped by byte position within each element
             (the HDF5/Blosc shuffle filter): the sign/exponent bytes of a smooth float
             field form long near-constant runs; a tail shorter than one element is kept
             as is. The element size is in the next byte.

Decoding checks what it can without the digest (codec known, sizes agree); the digest
check belongs to the caller, which knows the expected name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import blake3
import numpy as np
import pyfastcdc
import zstandard

from raps_slurm.errors import RapsError

RAW, ZSTD, SHUF = 0, 1, 2
CODECS = {RAW: "raw", ZSTD: "zstd", SHUF: "shuffle+zstd"}
DIGESTS = ("blake3", "sha256")
DIGEST_SIZE = 32  # both algorithms give 32 bytes
# Stored raw when zstd saves less than this share: decompressing costs more than it saves.
MIN_SAVING = 0.03


class ChunkError(RapsError):
    """A stored chunk cannot be decoded or does not match its name."""


@dataclass(frozen=True)
class CodecParams:
    """How chunks are cut, named and compressed (from ``checkpoint.*``)."""

    avg_chunk_kb: int = 256
    digest: str = "blake3"
    zstd_level: int = 1
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.digest not in DIGESTS:
            raise ValueError(f"digest {self.digest!r}: allowed {', '.join(DIGESTS)}")
        if not 1 <= self.avg_chunk_kb <= 4096:
            raise ValueError(f"avg_chunk_kb {self.avg_chunk_kb}: allowed 1..4096")


def hasher(name: str) -> Callable[[object], bytes]:
    """The digest function ``name`` (bytes-like -> 32 bytes); releases the GIL on big inputs."""
    if name == "blake3":
        return lambda data: blake3.blake3(data).digest()  # type: ignore[arg-type]
    if name == "sha256":
        return lambda data: hashlib.sha256(data).digest()  # type: ignore[arg-type]
    raise ValueError(f"digest {name!r}: allowed {', '.join(DIGESTS)}")


def as_bytes(item: object) -> tuple[memoryview, int]:
    """A flat byte view of ``item`` without copying, and its element size (1 for bytes).

    Accepts anything with the buffer protocol: bytes, bytearray, memoryview, numpy
    arrays (C-contiguous; others are refused rather than copied silently).
    """
    try:
        view = memoryview(item)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"checkpoint data must support the buffer protocol "
                        f"(bytes, bytearray, memoryview, numpy array), "
                        f"got {type(item).__name__}") from None
    if not view.c_contiguous:
        raise TypeError("checkpoint data must be C-contiguous (use numpy.ascontiguousarray)")
    return view.cast("B"), max(1, view.itemsize)


class Chunker:
    """Content-defined cut points of one buffer (FastCDC; not thread-safe, one per thread)."""

    def __init__(self, avg_chunk_kb: int) -> None:
        avg = max(256, avg_chunk_kb * 1024)
        # min avg/4 and max avg*4 are FastCDC's defaults; spelled out because the cut
        # points are part of the on-disk format (changing them rewrites every chunk once).
        self._cdc = pyfastcdc.FastCDC(avg, min_size=max(64, avg // 4),
                                      max_size=max(1024, avg * 4))

    def cuts(self, data: memoryview) -> Iterator[tuple[int, int]]:
        """(offset, length) of each chunk of ``data``, in order, covering all of it."""
        if len(data) == 0:
            return
        for c in self._cdc.cut_buf(data):
            yield c.offset, c.length


def shuffle(data: memoryview, elem: int) -> np.ndarray:
    """Group byte k of every element together (k = 0..elem-1); the tail stays as is."""
    n = len(data) // elem * elem
    src = np.frombuffer(data, dtype=np.uint8)
    out = np.empty(len(data), dtype=np.uint8)
    # numpy copies without the GIL; bytes concatenation would hold it for the whole chunk
    out[:n].reshape(elem, -1)[:] = src[:n].reshape(-1, elem).T
    out[n:] = src[n:]
    return out


def unshuffle(data: bytes | memoryview, elem: int, out: memoryview) -> None:
    """Inverse of :func:`shuffle`, written into ``out`` (of the raw length)."""
    n = len(out) // elem * elem
    src = np.frombuffer(data, dtype=np.uint8)
    dst = np.frombuffer(out, dtype=np.uint8)
    dst[:n].reshape(-1, elem)[:] = src[:n].reshape(elem, -1).T
    dst[n:] = src[n:]


class Encoder:
    """Compresses chunks; one instance per thread (zstd contexts are not thread-safe)."""

    def __init__(self, params: CodecParams) -> None:
        self.params = params
        self._z = zstandard.ZstdCompressor(level=params.zstd_level)

    def encode(self, raw: memoryview, elem: int) -> tuple[bytes, bytes | memoryview]:
        """(codec header, payload) for ``raw``; raw storage when compression does not pay.

        Two parts so that nobody copies the payload just to prepend one or two bytes.
        """
        if self.params.shuffle and 1 < elem <= 255 and len(raw) >= 2 * elem:
            packed = self._z.compress(shuffle(raw, elem).data)
            head = bytes((SHUF, elem))
        else:
            packed = self._z.compress(raw)
            head = bytes((ZSTD,))
        if len(packed) + len(head) > len(raw) * (1 - MIN_SAVING):
            return bytes((RAW,)), raw
        return head, packed


# numpy copies without the GIL from about this size; a memoryview copy holds it.
_GIL_FREE_COPY = 64 << 10


def copy_into(out: memoryview, data: memoryview) -> None:
    """``out[:] = data`` (same length); a large copy lets the process's other threads run
    (a restore copies a rank's whole state while its agent serves the node's ranks)."""
    if len(data) >= _GIL_FREE_COPY:
        np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(data, np.uint8))
    else:
        out[:] = data


class Decoder:
    """Decompresses stored chunks; one instance per thread."""

    def __init__(self) -> None:
        self._z = zstandard.ZstdDecompressor()
        self._scratch = bytearray()

    def decode_scratch(self, stored: bytes | memoryview, size: int) -> memoryview:
        """Decode into this decoder's reusable buffer (valid until its next call): for
        checking a chunk without allocating its size each time."""
        if len(self._scratch) < size:
            self._scratch = bytearray(size)
        out = memoryview(self._scratch)[:size]
        self.decode_into(stored, out)
        return out

    def decode_into(self, stored: bytes | memoryview, out: memoryview) -> None:
        """Decode ``stored`` into ``out`` (exactly the raw size); ChunkError if it does not fit."""
        if len(stored) < 1:
            raise ChunkError("empty chunk")
        codec = stored[0]
        if codec == RAW:
            if len(stored) - 1 != len(out):
                raise ChunkError(f"raw chunk of {len(stored) - 1} bytes, expected {len(out)}")
            copy_into(out, memoryview(stored)[1:])
            return
        if codec == ZSTD:
            self._inflate_into(memoryview(stored)[1:], out)
            return
        if codec == SHUF:
            if len(stored) < 2 or not 2 <= stored[1] <= 255:
                raise ChunkError("shuffled chunk without a valid element size")
            unshuffle(self._inflate(memoryview(stored)[2:], len(out)), stored[1], out)
            return
        raise ChunkError(f"unknown codec {codec} (allowed: {sorted(CODECS)})")

    def _inflate(self, payload: memoryview, size: int) -> bytes:
        try:
            data = self._z.decompress(payload, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise ChunkError(f"zstd: {exc}") from None
        if len(data) != size:
            raise ChunkError(f"decompressed to {len(data)} bytes, expected {size}")
        return data

    def _inflate_into(self, payload: memoryview, out: memoryview) -> None:
        # Straight into the caller's buffer: a restore writes each chunk once.
        try:
            with self._z.stream_reader(payload, read_across_frames=False) as r:
                n = r.readinto(out)
                extra = r.read(1)
        except zstandard.ZstdError as exc:
            raise ChunkError(f"zstd: {exc}") from None
        if n != len(out) or extra:
            raise ChunkError(f"decompressed size differs from the expected {len(out)}")

    def decode(self, stored: bytes | memoryview, size: int) -> bytes:
        """Decode to a new bytes object of ``size``."""
        out = bytearray(size)
        self.decode_into(stored, memoryview(out))
        return bytes(out)
