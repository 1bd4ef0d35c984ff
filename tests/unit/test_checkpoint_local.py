"""Chunk codec, manifests, the pack-based chunk store, local saves and verified restores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.codec import (
    RAW,
    SHUF,
    ZSTD,
    ChunkError,
    CodecParams,
    Decoder,
    Encoder,
    copy_into,
)
from raps_slurm.checkpoint.local import LocalCheckpoints, SaveError
from raps_slurm.checkpoint.manifest import Manifest
from raps_slurm.checkpoint.pack import PackError, PackWriter, iter_records
from raps_slurm.checkpoint.reader import materialize
from raps_slurm.checkpoint.writer import encode_state
from raps_slurm.errors import RecordError

PARAMS = CodecParams(avg_chunk_kb=16)


def field(n: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.sin(np.linspace(0, 20, n)) * 100 + rng.standard_normal(n) * 1e-3


def save(local: LocalCheckpoints, state: object, gen: int, previous: Manifest | None = None,
         *, job: str = "5", rank: int = 0, epoch: int = 1, params: CodecParams = PARAMS):
    session, base_ok = local.begin(job, rank, epoch, previous.generation if previous else None)
    prev = previous if base_ok else None
    m, stats = encode_state(state, job=job, rank=rank, epoch=epoch, params=params,
                            previous=prev, sink=lambda p: local.ingest(session, p.fd),
                            pack_bytes=64 << 10)
    local.finish(session, m, gen)
    local.end(session)
    return m.with_generation(gen), stats, session


@pytest.fixture
def local(tmp_path: Path) -> LocalCheckpoints:
    return LocalCheckpoints(ChunkStore(tmp_path / "store"))


# --- codec ----------------------------------------------------------------------------


def test_codec_picks_shuffle_for_arrays_zstd_for_text_raw_for_noise() -> None:
    enc, dec = Encoder(CodecParams()), Decoder()
    arr = memoryview(field(4096)).cast("B")
    text = memoryview(b"checkpoint " * 1000)
    noise = memoryview(os.urandom(8192))
    for data, elem, codec in ((arr, 8, SHUF), (text, 1, ZSTD), (noise, 1, RAW)):
        head, payload = enc.encode(data, elem)
        assert head[0] == codec
        assert dec.decode(head + bytes(payload), len(data)) == bytes(data)


def test_shuffle_off_uses_plain_zstd() -> None:
    head, _ = Encoder(CodecParams(shuffle=False)).encode(memoryview(field(4096)).cast("B"), 8)
    assert head[0] == ZSTD


@given(st.binary(min_size=1, max_size=3000), st.integers(2, 16))
@settings(max_examples=60, deadline=None)
def test_shuffle_round_trips_any_length(data: bytes, elem: int) -> None:
    enc = Encoder(CodecParams(zstd_level=1))
    head, payload = enc.encode(memoryview(data), elem)
    assert Decoder().decode(head + bytes(payload), len(data)) == data


@pytest.mark.parametrize("stored,size,msg", [
    (b"", 4, "empty chunk"),
    (bytes((9,)) + b"abcd", 4, "unknown codec 9"),
    (bytes((RAW,)) + b"abc", 4, "raw chunk of 3 bytes, expected 4"),
    (bytes((ZSTD,)) + b"not zstd", 4, "zstd"),
    (bytes((SHUF, 1)) + b"x", 4, "element size"),
])
def test_decoder_rejects_damaged_chunks(stored: bytes, size: int, msg: str) -> None:
    with pytest.raises(ChunkError, match=msg):
        Decoder().decode(stored, size)


def test_codec_params_refuse_unknown_digest() -> None:
    with pytest.raises(ValueError, match="allowed blake3, sha256"):
        CodecParams(digest="md5")


# --- packs ----------------------------------------------------------------------------


def test_pack_reader_refuses_bad_magic_and_lying_sizes(tmp_path: Path) -> None:
    w = PackWriter()
    w.add(b"\x01" * 32, 10, b"\x00", b"0123456789")
    assert [e.digest for e in iter_records(w.fd)] == ["01" * 32]
    os.pwrite(w.fd, b"\xff\xff\xff\xff", 8 + 32)  # raw size 4 GiB
    with pytest.raises(PackError, match=r"raw size"):
        list(iter_records(w.fd))
    os.pwrite(w.fd, b"XXXX", 0)
    with pytest.raises(PackError, match="bad magic"):
        list(iter_records(w.fd))
    w.close()


# --- manifests ------------------------------------------------------------------------


def test_manifest_round_trip_and_strict_decoding(local: LocalCheckpoints) -> None:
    m, _, _ = save(local, {"a": field(5000), "b": b"xyz" * 100}, 1)
    raw = m.to_json()
    assert Manifest.from_json("m", raw) == m
    data = json.loads(raw)
    data["chunks"][0][1] += 1
    with pytest.raises(RecordError, match=r"items add up|its chunks hold"):
        Manifest.from_json("m", json.dumps(data).encode())
    data = json.loads(raw)
    data["chunks"][0], data["chunks"][1] = data["chunks"][1], data["chunks"][0]
    with pytest.raises(RecordError, match="whole_digest does not match"):
        Manifest.from_json("m", json.dumps(data).encode())
    data = json.loads(raw)
    data["chunks"][0][0] = "../../etc/passwd"
    with pytest.raises(RecordError, match="64 hex digits"):
        Manifest.from_json("m", json.dumps(data).encode())
    with pytest.raises(RecordError, match="not JSON"):
        Manifest.from_json("m", b"{")


# --- saves and restores ---------------------------------------------------------------


def test_dict_state_round_trips_with_dtype_and_shape(local: LocalCheckpoints) -> None:
    state = {"u": field(3000).reshape(30, 100), "n": np.arange(7, dtype=np.int32),
             "meta": b"step=42", "empty": b""}
    save(local, state, 1)
    restored, bad = local.restore("5", 0, 1)
    assert bad == [] and restored is not None
    out = materialize(restored.manifest, restored.buffer)
    assert isinstance(out, dict)
    assert out["u"].shape == (30, 100) and np.array_equal(out["u"], state["u"])
    assert out["n"].dtype == np.int32 and list(out["n"]) == list(range(7))
    assert out["meta"] == b"step=42" and out["empty"] == b""
    restored.close()


def test_incremental_save_sends_only_changed_regions(local: LocalCheckpoints) -> None:
    a = field(400_000)  # 3.2 MB
    m1, s1, _ = save(local, a, 1)
    a[100_000:102_000] += 1.0  # 16 KB changed
    _, s2, sess = save(local, a, 2, m1)
    assert s1.new_chunks == len(m1.chunks)
    assert 1 <= s2.new_chunks <= 4
    assert s2.new_raw_bytes < 4 * 16_000 * 1.5
    assert sess.bytes_written < 100_000
    restored, bad = local.restore("5", 0, 2)
    assert bad == [] and restored is not None
    assert np.array_equal(materialize(restored.manifest, restored.buffer), a)


def test_base_not_held_means_everything_is_sent(local: LocalCheckpoints) -> None:
    a = field(100_000)
    m1, _, _ = save(local, a, 1)
    local.store.delete_manifest("5", 0, 1)
    _, s2, _ = save(local, a, 2, m1)
    assert s2.new_chunks == len(m1.digests())


def test_finish_refuses_a_manifest_naming_chunks_not_sent(local: LocalCheckpoints) -> None:
    m1, _, _ = save(local, field(50_000), 1)
    session, _ = local.begin("5", 0, 1, None)
    unsent, _ = encode_state(field(50_000, seed=2), job="5", rank=0, epoch=1, params=PARAMS,
                             previous=None, sink=lambda p: None)
    with pytest.raises(SaveError, match="not stored"):
        local.finish(session, unsent, 2)
    wrong_epoch = Manifest(m1.job, m1.rank, 0, 7, m1.digest_algo, m1.items, m1.chunks,
                           m1.total_size, m1.whole_digest, 0.0)
    with pytest.raises(SaveError, match="epoch 7"):
        local.finish(session, wrong_epoch, 2)
    local.end(session)
    assert local.store.generations("5", 0) == [1]


def test_flipped_byte_is_found_and_named(local: LocalCheckpoints) -> None:
    a = field(200_000)
    m, _, _ = save(local, a, 1)
    digest = m.chunks[3][0]
    loc = local.store.location("5", digest)
    assert loc is not None
    path = local.store.pack_path("5", loc)
    with open(path, "r+b") as f:
        f.seek(loc.offset + loc.stored_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    restored, bad = local.restore("5", 0, 1)
    assert restored is None
    assert [b.digest for b in bad] == [digest]


def test_only_chunks_not_checked_before_are_hashed_again(local: LocalCheckpoints) -> None:
    """A restore's pulled chunks were verified on arrival and are only decoded; every
    other chunk is checked as it is written into the memory file."""
    a = field(200_000)
    m, _, _ = save(local, a, 1)
    digest = m.chunks[3][0]
    loc = local.store.location("5", digest)
    assert loc is not None
    with open(local.store.pack_path("5", loc), "r+b") as f:
        f.seek(loc.offset + loc.stored_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    others = {d for d, _ in m.chunks} - {digest}
    restored, bad = local.restore_manifest(m, checked=others)
    assert restored is None and [b.digest for b in bad] == [digest]
    restored, bad = local.restore_manifest(m, checked={digest})  # taken as checked
    assert restored is not None and bad == []
    restored.close()


def test_index_is_rebuilt_from_pack_headers(tmp_path: Path) -> None:
    local = LocalCheckpoints(ChunkStore(tmp_path))
    a = field(100_000)
    m, _, _ = save(local, a, 1)
    again = LocalCheckpoints(ChunkStore(tmp_path))
    assert again.store.chunks("5") == set(m.digests())
    restored, bad = again.restore("5", 0, 1)
    assert bad == [] and restored is not None
    assert np.array_equal(materialize(restored.manifest, restored.buffer), a)


def test_drop_rewrites_the_pack_without_the_chunk(local: LocalCheckpoints) -> None:
    m, _, _ = save(local, field(100_000), 1)
    victim = m.chunks[0][0]
    assert local.store.drop("5", [victim]) == 1
    assert not local.store.has("5", victim)
    assert ChunkStore(local.store.root).missing("5", m.digests()) == [victim]


def test_collection_keeps_exactly_max_generations_and_every_needed_chunk(
        local: LocalCheckpoints) -> None:
    a = field(100_000)
    prev = None
    for gen in range(1, 7):
        a[gen * 1000:gen * 1000 + 500] += gen
        prev, _, _ = save(local, a, gen, prev)
        local.store.collect("5", 3)
    assert local.store.generations("5", 0) == [4, 5, 6]
    kept = set()
    for gen in (4, 5, 6):
        m = local.store.manifest("5", 0, gen)
        assert m is not None
        kept |= m.digests()
    assert local.store.missing("5", kept) == []
    assert local.store.chunks("5") == kept
    for gen in (4, 5, 6):
        restored, bad = local.restore("5", 0, gen)
        assert bad == [] and restored is not None
        restored.close()
    # after a restart the packs hold only what is needed (rewritten when mostly garbage)
    assert ChunkStore(local.store.root).stored_bytes("5", kept) > 0


def test_collection_reads_a_manifest_again_only_when_its_file_changed(
        local: LocalCheckpoints) -> None:
    """Collection runs at every commit: a kept manifest is parsed once, and again only
    when its file changed (a damaged one is still found, its chunks kept)."""
    a = field(100_000)
    m1, _, _ = save(local, a, 1)
    a[:1000] += 1
    save(local, a, 2, m1)
    store = local.store
    store.collect("5", 5)
    parsed: list[int] = []
    real = store.manifest

    def counting(job: str, rank: int, gen: int) -> Manifest | None:
        parsed.append(gen)
        return real(job, rank, gen)
    store.manifest = counting  # type: ignore[method-assign]
    assert store.collect("5", 5).unreadable == ()
    assert parsed == []  # both cached
    path = next(store.root.rglob("manifests/0/1.json"))
    path.write_bytes(path.read_bytes()[:-5])
    result = store.collect("5", 5)
    assert result.unreadable == ((0, 1),) and parsed == [1]
    assert store.missing("5", m1.digests()) == []  # kept: it may be repaired
    store.delete_manifest("5", 0, 1)
    store.collect("5", 5)
    assert not any(p.name == "1.json" for p in store._needs)


def test_pinned_generation_survives_collection(local: LocalCheckpoints) -> None:
    a = field(50_000)
    m1, _, _ = save(local, a, 1)
    with local.store.pinned("5", gens=[(0, 1)]):
        a += 1
        save(local, a, 2)
        local.store.collect("5", 1)
        assert local.store.generations("5", 0) == [1, 2]
        assert local.store.missing("5", m1.digests()) == []
    local.store.collect("5", 1)
    assert local.store.generations("5", 0) == [2]


def test_save_killed_midway_leaves_the_previous_generation_whole(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    local = LocalCheckpoints(ChunkStore(store_dir))
    a = field(300_000)
    save(local, a, 1)
    script = textwrap.dedent(f"""
        import os, signal, numpy as np
        from raps_slurm.checkpoint.chunkstore import ChunkStore
        from raps_slurm.checkpoint.codec import CodecParams
        from raps_slurm.checkpoint.local import LocalCheckpoints
        from raps_slurm.checkpoint.writer import encode_state
        local = LocalCheckpoints(ChunkStore({str(store_dir)!r}))
        s, _ = local.begin("5", 0, 1, None)
        n = [0]
        def sink(p):
            local.ingest(s, p.fd)
            n[0] += 1
            if n[0] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        encode_state(np.random.default_rng(9).standard_normal(300_000), job="5", rank=0,
                     epoch=1, params=CodecParams(avg_chunk_kb=16), previous=None, sink=sink,
                     pack_bytes=64 << 10)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    fresh = LocalCheckpoints(ChunkStore(store_dir))
    assert fresh.store.generations("5", 0) == [1]
    assert len(list((store_dir / "job-5" / "packs").iterdir())) > 1  # the dead save wrote
    restored, bad = fresh.restore("5", 0, 1)
    assert bad == [] and restored is not None
    assert materialize(restored.manifest, restored.buffer).tobytes() == a.tobytes()
    fresh.store.collect("5", 1)
    m = fresh.store.manifest("5", 0, 1)
    assert m is not None and fresh.store.chunks("5") == set(m.digests())


@pytest.mark.parametrize("size", [0, 1000, 64 << 10, (1 << 20) + 3])
def test_copy_into_copies_small_and_large_buffers(size: int) -> None:
    data = np.random.default_rng(size).bytes(size)
    out = bytearray(size + 8)
    copy_into(memoryview(out)[4:4 + size], memoryview(data))
    assert bytes(out[4:4 + size]) == data and out[:4] == out[-4:] == bytes(4)

