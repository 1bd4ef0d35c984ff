"""Every parser of untrusted bytes, fed random and mutated input: it returns a value or
raises its own documented error, never anything else (no IndexError, no struct.error, no
UnicodeDecodeError, no hang). Heartbeat datagrams and agent requests have their own
property tests (test_heartbeat.py, test_local_api.py).

Bounded for CI; ``RAPS_FUZZ_EXAMPLES=100000 pytest tests/unit/test_fuzz_parsers.py``
runs longer on demand.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raps_slurm.checkpoint.manifest import Manifest
from raps_slurm.checkpoint.pack import MAGIC, PackError, iter_records, sealed_bytes
from raps_slurm.checkpoint.transfer import (
    TransferError,
    _Channel,
    _split,
    decode_records,
    encode_records,
)
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry, RankMap
from raps_slurm.core.planner import Plan, PlanEvent
from raps_slurm.errors import RecordError
from raps_slurm.runtime.msglog import Entry, MessagingError, parse_records
from raps_slurm.runtime.transport import DATA, FrameError, encode, read_frame

EXAMPLES = int(os.environ.get("RAPS_FUZZ_EXAMPLES", "300"))
fuzz = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` cut, extended, or with bytes overwritten: the inputs that get furthest."""
    cut = st.integers(0, len(valid)).map(lambda n: valid[:n])
    extended = st.binary(min_size=1, max_size=64).map(lambda b: valid + b)

    def flip(args: tuple[int, int]) -> bytes:
        where, value = args
        if not valid:
            return valid
        b = bytearray(valid)
        b[where % len(b)] = value
        return bytes(b)

    flipped = st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)).map(flip)
    return st.one_of(cut, extended, flipped, st.binary(max_size=256))


def survives(fn: Callable[[], Any], *errors: type[BaseException]) -> None:
    with contextlib.suppress(*errors):
        fn()


@contextlib.contextmanager
def fed(raw: bytes) -> Iterator[socket.socket]:
    """A connected socket that reads ``raw`` and then the end of the stream."""
    a, b = socket.socketpair()
    try:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(5)
        yield b
    finally:
        a.close()
        b.close()


# -- agent-to-agent transfer frames ----------------------------------------------------

RECORDS = encode_records([("ab" * 32, 5, b"\x00hello"), ("cd" * 32, 3, b"\x00abc")])


@fuzz
@given(body=mutations(RECORDS))
def test_chunk_records(body: bytes) -> None:
    survives(lambda: list(decode_records(memoryview(body))), TransferError)


@fuzz
@given(payload=mutations(struct.pack(">I", 11) + b'{"op":"get"}' + b"body"))
def test_frame_split(payload: bytes) -> None:
    survives(lambda: _split(payload), TransferError)


@fuzz
@given(raw=st.binary(max_size=512))
def test_authenticated_channel_refuses_unsigned_bytes(raw: bytes) -> None:
    with fed(raw) as sock:
        chan = _Channel(sock, secrets.token_bytes(32), client=True)
        try:
            chan.recv()
            raise AssertionError("random bytes passed frame authentication")
        except TransferError:
            pass


# -- rank-to-rank message frames --------------------------------------------------------

FRAME = b"".join(bytes(p) for p in encode(DATA, 1, 2, 3, 1, b"payload"))


@fuzz
@given(raw=mutations(FRAME))
def test_rank_frames(raw: bytes) -> None:
    with fed(raw) as sock:
        def read_all() -> None:
            while read_frame(sock) is not None:
                pass
        survives(read_all, FrameError)


# -- message-log records, packs, manifests ----------------------------------------------

LOG = b"".join(bytes(p) for p in Entry(2, 1, 1, 5, 0x12345678, False, b"hello")
               .record(with_body=True))


@fuzz
@given(data=mutations(LOG))
def test_log_records(data: bytes) -> None:
    survives(lambda: list(parse_records(data)), MessagingError)


PACK = MAGIC + RECORDS


@fuzz
@given(data=mutations(PACK))
def test_pack_files(data: bytes) -> None:
    fd = sealed_bytes(data, "fuzz-pack")
    try:
        survives(lambda: list(iter_records(fd)), PackError)
    finally:
        os.close(fd)


MANIFEST = json.dumps({"format": 1, "job": "5", "rank": 0, "generation": 1, "epoch": 1,
                       "digest_algo": "blake3", "total_size": 5,
                       "items": [{"name": "", "kind": "bytes", "nbytes": 5}],
                       "chunks": [["ab" * 32, 5]]}).encode()


@fuzz
@given(raw=mutations(MANIFEST))
def test_manifests(raw: bytes) -> None:
    survives(lambda: Manifest.from_json("fuzz", raw), RecordError)


# -- etcd values ------------------------------------------------------------------------

VALUES: list[tuple[Callable[[str, bytes], object], bytes]] = [
    (JobRecord.from_json, JobRecord("5", 0, 1000, ("n1",), JobSpec()).to_json()),
    (RankMap.from_json, RankMap("5", 0, ("n1",), ("n2",), 1).to_json()),
    (RankEntry.from_json, RankEntry(0, "n1", 1, "running", ("n2",)).to_json()),
    (Plan.from_json, Plan("5-0-2", "5", 0, "n1", "n2", 2, "dead", 10).to_json()),
    (PlanEvent.from_json, PlanEvent("5-0-2", "running", 1.0, "n2", {"x": 1}).to_json()),
    (CkptRecord.from_json, CkptRecord(0, 1, 1, "ab" * 32, 5, 5, 1, "cd" * 32, "n1", ("n1",),
                                      1, "committed", 1.0).to_json()),
]


@fuzz
@given(which=st.integers(0, len(VALUES) - 1), data=st.data())
def test_etcd_records(which: int, data: st.DataObject) -> None:
    decode, valid = VALUES[which]
    raw = data.draw(mutations(valid))
    survives(lambda: decode("/raps/v1/fuzz", raw), RecordError)
