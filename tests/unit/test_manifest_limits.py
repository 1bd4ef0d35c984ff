"""A manifest cannot claim more bytes than its chunks can hold (issue 21, item 5)."""

from __future__ import annotations

import json

import pytest

from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.checkpoint.manifest import Item, Manifest, check_total, whole_digest
from raps_slurm.checkpoint.pack import MAX_CHUNK
from raps_slurm.checkpoint.writer import encode_state
from raps_slurm.errors import RecordError

DIGEST = "ab" * 32


def _manifest(chunks: list[tuple[str, int]], total: int) -> bytes:
    items = (Item("x", "bytes", total, len(chunks)),)
    m = {"version": 1, "job": "7", "rank": 0, "generation": 1, "epoch": 1,
         "digest_algo": "blake3", "items": [i.to_dict() for i in items],
         "chunks": [[d, n] for d, n in chunks], "total_size": total,
         "whole_digest": whole_digest("blake3", items, chunks), "created": 0.0, "extra": {}}
    return json.dumps(m).encode()


def test_one_chunk_listed_many_times_cannot_claim_more_than_it_holds() -> None:
    chunks = [(DIGEST, MAX_CHUNK)] * 1000
    assert Manifest.from_json("m", _manifest(chunks, 1000 * MAX_CHUNK)).total_size \
        == 1000 * MAX_CHUNK  # exactly full chunks: allowed
    raw = json.loads(_manifest(chunks, 1000 * MAX_CHUNK))
    raw["total_size"] = 1001 * MAX_CHUNK
    raw["items"][0]["nbytes"] = 1001 * MAX_CHUNK
    with pytest.raises(RecordError, match=r"total_size \d+ is more than 1000 chunk\(s\) of "
                                          r"at most 16777216 bytes"):
        Manifest.from_json("m", json.dumps(raw).encode())


def test_a_chunk_larger_than_the_codec_allows_is_refused() -> None:
    with pytest.raises(RecordError, match=r"chunks\[0\]: expected .*size 1..16777216"):
        Manifest.from_json("m", _manifest([(DIGEST, MAX_CHUNK + 1)], MAX_CHUNK + 1))


def test_check_total_with_a_quota() -> None:
    check_total("m", 10 * MAX_CHUNK, 10, quota=10 * MAX_CHUNK)
    check_total("m", 10 * MAX_CHUNK, 10)  # no quota: only the chunk bound
    with pytest.raises(RecordError, match="above the job's quota of 1000 bytes"):
        check_total("m", 1001, 1, quota=1000)
    with pytest.raises(RecordError, match="total_size 1 is more than 0 chunk"):
        check_total("m", 1, 0)


def test_a_real_manifest_passes() -> None:
    m, _ = encode_state(b"x" * 100_000, job="7", rank=0, epoch=1,
                        params=CodecParams(avg_chunk_kb=16), previous=None, sink=lambda p: None)
    assert Manifest.from_json("m", m.to_json()) == m
