"""The manifest of one checkpoint generation: what to read, in which order, and how to check it.

A manifest lists the checkpoint's *items* (one for a single buffer or array, one per
key for a dict), each with its kind (``bytes`` or ``ndarray`` with dtype and shape) and
the number of chunks it spans; the ordered ``chunks`` (hex digest, raw size) of all
items in turn; the total size; the digest of the whole (every item's raw bytes in
order); and an opaque ``extra`` object (the message layer's sequence vectors and
spilled message bodies). It is stored as canonical JSON next to the chunks on every
holder, and the digest of that JSON is what etcd records, so a holder's copy is
checked before it is trusted.

Decoding is strict: a manifest from disk, a peer or a rank is input like any other.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from raps_slurm.checkpoint.codec import DIGEST_SIZE, DIGESTS, hasher
from raps_slurm.checkpoint.pack import MAX_CHUNK
from raps_slurm.core.records import Reader, dump
from raps_slurm.errors import RecordError

VERSION = 1
KINDS = ("bytes", "ndarray")
MAX_ITEMS = 4096
MAX_NAME = 255
MAX_EXTRA = 16 << 20  # bytes of JSON: spilled message bodies live in chunks, not here
MAX_MANIFEST = 256 << 20  # bytes of one manifest between rank, agent and peers


@dataclass(frozen=True)
class Item:
    """One named piece of the state: its kind, numpy dtype/shape, size and chunk count."""

    name: str
    kind: str
    nbytes: int
    chunks: int
    dtype: str = ""
    shape: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON shape."""
        return {"name": self.name, "kind": self.kind, "nbytes": self.nbytes,
                "chunks": self.chunks, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Manifest:
    """One generation of one rank's checkpoint."""

    job: str
    rank: int
    generation: int
    epoch: int
    digest_algo: str
    items: tuple[Item, ...]
    chunks: tuple[tuple[str, int], ...]  # (hex digest, raw size), in order
    total_size: int
    whole_digest: str
    created: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """Canonical JSON: the same manifest always gives the same bytes (and digest)."""
        return dump({"version": VERSION, "job": self.job, "rank": self.rank,
                     "generation": self.generation, "epoch": self.epoch,
                     "digest_algo": self.digest_algo,
                     "items": [i.to_dict() for i in self.items],
                     "chunks": [[d, n] for d, n in self.chunks],
                     "total_size": self.total_size, "whole_digest": self.whole_digest,
                     "created": self.created, "extra": self.extra})

    def digests(self) -> frozenset[str]:
        """The distinct chunk names this generation needs."""
        return frozenset(d for d, _ in self.chunks)

    def with_generation(self, generation: int) -> Manifest:
        """A copy numbered ``generation`` (the agent numbers generations, not the rank)."""
        return Manifest(self.job, self.rank, generation, self.epoch, self.digest_algo,
                        self.items, self.chunks, self.total_size, self.whole_digest,
                        self.created, self.extra)

    @classmethod
    def from_json(cls, where: str, raw: bytes) -> Manifest:
        """Decode and check consistency; RecordError naming ``where`` and the field."""
        r = Reader(where, raw)
        if r.integer("version", 1, 1 << 16) != VERSION:
            raise RecordError(f"{where}: manifest version {r.data['version']}, "
                              f"this raps-slurm reads {VERSION}")
        algo = r.choice("digest_algo", DIGESTS)
        items = tuple(_item(where, i, x) for i, x in enumerate(_list(r, "items", MAX_ITEMS)))
        chunks = tuple(_chunk(where, i, x) for i, x in enumerate(_list(r, "chunks", 1 << 26)))
        total = r.integer("total_size")
        extra = r.obj("extra")
        if len(json.dumps(extra)) > MAX_EXTRA:
            raise RecordError(f"{where}: field 'extra' is larger than {MAX_EXTRA} bytes")
        m = cls(r.text("job"), r.integer("rank", 0, 2**31 - 1),
                r.integer("generation"), r.integer("epoch", 1), algo, items, chunks,
                total, r.text("whole_digest"), r.num("created"), extra)
        m.check(where)
        return m

    def check(self, where: str) -> None:
        """Items, chunk counts and sizes agree with each other and ``total_size`` is at
        most the chunk count times :data:`MAX_CHUNK`; RecordError otherwise."""
        check_total(where, self.total_size, len(self.chunks))
        if len(self.whole_digest) != 2 * DIGEST_SIZE:
            raise RecordError(f"{where}: whole_digest must be {2 * DIGEST_SIZE} hex digits")
        if sum(i.nbytes for i in self.items) != self.total_size:
            raise RecordError(f"{where}: items add up to {sum(i.nbytes for i in self.items)} "
                              f"bytes, total_size says {self.total_size}")
        if sum(i.chunks for i in self.items) != len(self.chunks):
            raise RecordError(f"{where}: items span {sum(i.chunks for i in self.items)} "
                              f"chunks, the list has {len(self.chunks)}")
        start = 0
        for item in self.items:
            size = sum(n for _, n in self.chunks[start:start + item.chunks])
            if size != item.nbytes:
                raise RecordError(f"{where}: item {item.name!r} is {item.nbytes} bytes, "
                                  f"its chunks hold {size}")
            start += item.chunks
        if len({i.name for i in self.items}) != len(self.items):
            raise RecordError(f"{where}: two items have the same name")
        if whole_digest(self.digest_algo, self.items, self.chunks) != self.whole_digest:
            raise RecordError(f"{where}: whole_digest does not match the chunk list")


def check_total(where: str, total_size: int, chunks: int, quota: int = 0) -> None:
    """RecordError unless ``total_size`` fits in ``chunks`` chunks of at most
    :data:`MAX_CHUNK` bytes and, with ``quota`` > 0, in ``quota`` bytes: a restore reserves
    ``total_size`` bytes of memory before it reads a chunk, so the claim is bounded first."""
    if total_size > chunks * MAX_CHUNK:
        raise RecordError(f"{where}: total_size {total_size} is more than {chunks} chunk(s) "
                          f"of at most {MAX_CHUNK} bytes can hold")
    if quota > 0 and total_size > quota:
        raise RecordError(f"{where}: total_size {total_size} is above the job's quota of "
                          f"{quota} bytes")


def whole_digest(algo: str, items: Sequence[Item], chunks: Sequence[tuple[str, int]]) -> str:
    """The digest of the whole checkpoint: a root over the items and the ordered chunk names
    and sizes (a hash list, as content-addressed stores name a tree). Once every chunk
    matches its name, equal roots mean equal data, so a restore checks the whole without
    a second pass over it."""
    h = hasher(algo)
    head = json.dumps([i.to_dict() for i in items], sort_keys=True).encode()
    body = b"".join(bytes.fromhex(d) + size.to_bytes(8, "big") for d, size in chunks)
    return h(b"raps-whole-v1\0" + len(head).to_bytes(8, "big") + head + body).hex()


def manifest_digest(raw: bytes) -> str:
    """What etcd records of a manifest: sha256 of its canonical JSON, hex."""
    return hashlib.sha256(raw).hexdigest()


def _list(r: Reader, name: str, limit: int) -> list[Any]:
    v = r.data.get(name)
    if not isinstance(v, list) or len(v) > limit:
        raise RecordError(f"{r.key}: field {name!r}: expected a list of at most {limit}")
    return v


def _item(where: str, i: int, raw: Any) -> Item:
    r = Reader(f"{where} items[{i}]", raw)
    name = r.text("name", empty=True)
    if len(name) > MAX_NAME:
        raise RecordError(f"{where} items[{i}]: name longer than {MAX_NAME}")
    kind = r.choice("kind", KINDS)
    shape = r.data.get("shape")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape) \
            or len(shape) > 32:
        raise RecordError(f"{where} items[{i}]: field 'shape': expected a list of integers >= 0")
    return Item(name, kind, r.integer("nbytes"), r.integer("chunks"),
                r.text("dtype", empty=True), tuple(shape))


def _chunk(where: str, i: int, raw: Any) -> tuple[str, int]:
    if (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str)
            and is_hex_digest(raw[0]) and type(raw[1]) is int and 0 < raw[1] <= MAX_CHUNK):
        return raw[0], raw[1]
    raise RecordError(f"{where}: chunks[{i}]: expected [64 hex digits, size 1..{MAX_CHUNK}], "
                      f"got {raw!r:.80}")


def is_hex_digest(text: str) -> bool:
    """64 lowercase hex digits (a chunk name)."""
    return len(text) == 2 * DIGEST_SIZE and all(c in "0123456789abcdef" for c in text)
