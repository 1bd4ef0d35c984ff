"""Rank-to-rank frames: a DATA frame's padding, put so that the kernel copies its
payload at full speed, and what the receiver refuses of it."""

from __future__ import annotations

import numpy as np
import pytest

from raps_slurm.runtime.frames import (
    ALIGN,
    DATA,
    HEADER,
    PAD_AT,
    FrameError,
    decode,
    encode,
    pad,
)
from raps_slurm.runtime.links import _padding
from raps_slurm.wire import datapath, framing


def test_a_pad_puts_the_payload_at_its_sources_offset() -> None:
    for lead in (0, 37, 50, 63, 64, 1000):
        for address in (16, 48, 4095, 1 << 40):
            got = pad(lead, address)
            assert got == bytes(len(got)) and len(got) < ALIGN
            assert (lead + len(got)) % ALIGN == address % ALIGN


def test_a_large_message_is_padded_for_its_buffer_and_a_small_one_not() -> None:
    env = b"e" * 13
    data = np.zeros(PAD_AT // 8 + 16)
    for skip in range(8):  # buffers at 8 different offsets
        part = memoryview(data[skip:skip + PAD_AT // 8]).cast("B")
        got = _padding([env, part])
        lead = framing.HEADER.size + HEADER.size  # the frame's length, its header
        assert (lead + len(env) + len(got)) % ALIGN == datapath.address(part) % ALIGN
    assert _padding([env, b"small"]) == b""


def test_the_receiver_takes_a_padded_payload_and_refuses_a_bad_pad() -> None:
    payload = b"p" * 100
    head, body = encode(DATA, 1, 2, 3, 4, payload)
    for gap in (0, 1, ALIGN - 1):
        frame = decode(bytes(head) + bytes(gap) + bytes(body))
        assert frame.payload == payload and frame.length == len(payload)
    with pytest.raises(FrameError, match=f"at most {ALIGN - 1} zero bytes of padding"):
        decode(bytes(head) + bytes(ALIGN) + bytes(body))  # too much
    with pytest.raises(FrameError, match="zero bytes of padding"):
        decode(bytes(head) + b"\0\1\0" + bytes(body))  # padding that is not zero
    with pytest.raises(FrameError, match="announces 100 bytes and carries 99"):
        decode(bytes(head) + bytes(body)[:99])  # short


def test_a_checksums_frame_carries_pairs_and_nothing_else() -> None:
    from raps_slurm.runtime.frames import CHECKSUMS, MAX_SUMS, SUM, decode, encode, sums

    pairs = [(7, 0xDEADBEEF), (8, 1)]
    body = b"".join(bytes(p) for p in encode(CHECKSUMS, 0, 1, 7, 2,
                                              b"".join(SUM.pack(*q) for q in pairs), crc=0))
    f = decode(body)
    assert (f.kind, f.seq, f.epoch) == (CHECKSUMS, 7, 2) and sums(f.payload) == pairs
    for bad in (body[:-1],  # half a pair
                body[:HEADER.size]):  # none
        with pytest.raises(FrameError, match="CHECKSUMS frame of"):
            decode(bad)
    many = SUM.pack(1, 1) * (MAX_SUMS + 1)
    with pytest.raises(FrameError, match=f"expected 1-{MAX_SUMS} pairs"):
        decode(b"".join(bytes(p) for p in encode(CHECKSUMS, 0, 1, 1, 1, many, crc=0)))
