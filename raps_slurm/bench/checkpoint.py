"""``rapsctl bench checkpoint``: save, incremental save and restore of a simulation-like state.

Runs on this machine alone: the state is a seeded float64 field (a smooth function plus
small noise, like a simulation variable), saved through the same code a rank and its
agent run (rank-side cut/name/compress into packs, agent-side durable chunk writes with
fsync), then changed in ``--change`` of its bytes as contiguous 1 MiB runs at random
offsets and saved again, then restored from the local chunks (page cache dropped for
the chunk files first, so the disk is read) and checked bit for bit.

The limits come from a fixed reference pipeline over the same data, each stage alone on
one core: FastCDC (64 KiB average), blake3, zstd level 1 (and for restores blake3 and
zstd decompression); CPU stages share the cores, so ``limit = cores / sum(seconds per
byte)``, capped by a sequential write+fsync (read, for restores) of the same size in the
same directory. The reference never changes with the implementation's settings; only
ratios within one run mean anything on a shared machine.

Two more figures explain restore times: ``restore_warm_gbps`` runs the same verified
decode again into the now-touched buffer, and ``fresh_memory_gbps`` is how fast this
machine hands out fresh memory (a VM whose host backs guest pages lazily makes every
first touch slow; a restore writes its whole output into fresh memory).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pyfastcdc
import zstandard

from raps_slurm.checkpoint.chunkstore import ChunkStore, drop_cached
from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.checkpoint.local import LocalCheckpoints
from raps_slurm.checkpoint.reader import materialize, memory_file, read_into
from raps_slurm.checkpoint.writer import encode_state
from raps_slurm.errors import BenchError

MIB = 1 << 20
RUN = MIB  # changed runs are contiguous 1 MiB


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '64M', '1000000' -> bytes; ValueError naming what is allowed."""
    units = {"": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": MIB, "MB": 10**6,
             "MIB": MIB, "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"{text!r}: expected a size like 1GiB, 512MiB or 4096") from None
    if unit not in units or value <= 0:
        raise ValueError(f"{text!r}: expected a size like 1GiB, 512MiB or 4096")
    return int(value * units[unit])


def make_field(size: int, seed: int) -> np.ndarray:
    """A smooth float64 field plus small noise, ``size`` bytes (rounded down to 8)."""
    n = max(1, size // 8)
    rng = np.random.default_rng(seed)
    x = np.linspace(0.0, 64.0 * np.pi, n)
    field = np.sin(x) * 300.0 + 290.0
    field += rng.standard_normal(n) * 1e-3
    return field


def change_runs(field: np.ndarray, share: float, seed: int) -> int:
    """Change ``share`` of the bytes as 1 MiB runs at random offsets; bytes changed (union)."""
    raw = field.view(np.uint8)
    total = raw.size
    if share <= 0 or total < RUN:
        return 0
    rng = np.random.default_rng(seed + 1)
    changed = np.zeros(total, dtype=bool)
    target = int(total * share)
    done = 0
    while done < target:
        start = int(rng.integers(0, total - RUN)) // 8 * 8
        seg = field[start // 8:(start + RUN) // 8]
        seg *= 1.0 + 1e-2 * rng.standard_normal(seg.size)
        before = int(changed[start:start + RUN].sum())
        changed[start:start + RUN] = True
        done += RUN - before
    return int(changed.sum())


def _per_byte(fn: Callable[[], object], nbytes: int) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) / nbytes


def _evict(paths: list[Path]) -> None:
    for p in paths:
        drop_cached(p)


def reference(data: memoryview, directory: Path) -> dict[str, float]:
    """The fixed reference pipeline: seconds per byte of each stage and the disk rates."""
    n = len(data)
    cdc = pyfastcdc.FastCDC(64 * 1024)
    cuts: list[tuple[int, int]] = []
    t_cdc = _per_byte(lambda: cuts.extend((c.offset, c.length) for c in cdc.cut_buf(data)), n)
    t_b3 = _per_byte(lambda: [blake3.blake3(data[o:o + ln]).digest() for o, ln in cuts], n)
    z = zstandard.ZstdCompressor(level=1)
    packed: list[bytes] = []
    t_z = _per_byte(lambda: packed.extend(z.compress(data[o:o + ln]) for o, ln in cuts), n)
    dz = zstandard.ZstdDecompressor()
    t_dz = _per_byte(lambda: [dz.decompress(p) for p in packed], n)
    path = directory / "reference.bin"
    step = 8 * MIB

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for off in range(0, n, step):
            os.write(fd, data[off:off + step])
        os.fsync(fd)
        os.close(fd)

    t_write = _per_byte(write, n)
    _evict([path])

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            while f.read(step):
                pass

    t_read = _per_byte(read, n)
    path.unlink()
    return {"cdc": t_cdc, "blake3": t_b3, "zstd1": t_z, "unzstd1": t_dz,
            "write_fsync": t_write, "read": t_read}


def fresh_memory_seconds(size: int) -> float:
    """Seconds to write ``size`` bytes into a new memory file's pages (first touch)."""
    fd, buf = memory_file(size, "raps-bench-fresh")
    try:
        t = time.perf_counter()
        view = memoryview(buf) if buf is not None else memoryview(bytearray())
        zero = bytes(MIB)
        for off in range(0, size, MIB):
            view[off:off + MIB] = zero[:min(MIB, size - off)]
        view.release()
        return time.perf_counter() - t
    finally:
        if buf is not None:
            buf.close()
        os.close(fd)


def _ingest(local: LocalCheckpoints, session: Any, pack: Any) -> None:
    local.ingest(session, pack.fd)


def run_bench(size: int, change: float, seed: int, params: CodecParams,
              directory: str | None) -> dict[str, Any]:
    """The whole measurement; returns the JSON object."""
    cores = len(os.sched_getaffinity(0))
    base = Path(tempfile.mkdtemp(prefix="raps-bench-ckpt-", dir=directory))
    try:
        field = make_field(size, seed)
        view = memoryview(field.data).cast("B")
        nbytes = len(view)
        ref = reference(view, base)
        cpu_limit = cores / (ref["cdc"] + ref["blake3"] + ref["zstd1"])
        limit = min(cpu_limit, 1 / ref["write_fsync"])
        restore_cpu = cores / (ref["blake3"] + ref["unzstd1"])
        restore_limit = min(restore_cpu, 1 / ref["read"])

        store = ChunkStore(base / "store")
        local = LocalCheckpoints(store)

        def save(state: np.ndarray, gen: int, previous: Any) -> tuple[Any, float, int]:
            t = time.perf_counter()
            session, _ = local.begin("1", 0, 1, gen - 1 if gen > 1 else None)
            manifest, _stats = encode_state(state, job="1", rank=0, epoch=1, params=params,
                                            previous=previous,
                                            sink=lambda pack: _ingest(local, session, pack))
            raw = local.finish(session, manifest, gen)
            local.end(session)
            return manifest, time.perf_counter() - t, session.bytes_written + len(raw)

        full, t_full, full_written = save(field, 1, None)
        changed = change_runs(field, change, seed)
        _, t_incr, incr_written = save(field, 2, full)
        # A restoring rank starts without its state: free it (keep only its digest) so the
        # restore does not run beside a second copy of the whole state.
        expect = blake3.blake3(view, max_threads=blake3.blake3.AUTO).digest()
        view.release()
        del field, view
        _evict([p for p in (store.job_dir("1") / "packs").rglob("*") if p.is_file()])
        t = time.perf_counter()
        restored, bad = local.restore("1", 0, 2)
        t_restore = time.perf_counter() - t
        if restored is None:
            raise BenchError(f"restore failed: {bad[:3]}")
        back = materialize(restored.manifest, restored.buffer)
        same = isinstance(back, np.ndarray) and back.nbytes == nbytes and \
            restored.buffer is not None and \
            blake3.blake3(restored.buffer, max_threads=blake3.blake3.AUTO).digest() == expect
        if not same:
            raise BenchError("restored state differs from the saved one")
        # The same restore into memory that was touched before: on a VM whose host backs
        # guest memory lazily, first-touch of fresh pages can cost more than the restore.
        del back
        _evict([p for p in (store.job_dir("1") / "packs").rglob("*") if p.is_file()])
        assert restored.buffer is not None
        t = time.perf_counter()
        warm_bad = read_into(restored.manifest, lambda d: store.read("1", d),
                             memoryview(restored.buffer))
        t_warm = time.perf_counter() - t
        if warm_bad:
            raise BenchError(f"second restore failed: {warm_bad[:3]}")
        fresh = fresh_memory_seconds(min(nbytes, 256 << 20))
        gb = 1e9
        full_gbps, limit_gbps = nbytes / t_full / gb, limit / gb
        restore_gbps, restore_limit_gbps = nbytes / t_restore / gb, restore_limit / gb
        result: dict[str, Any] = {
            "benchmark": "checkpoint", "size_bytes": nbytes, "change": change, "seed": seed,
            "cores": cores, "avg_chunk_kb": params.avg_chunk_kb, "digest": params.digest,
            "zstd_level": params.zstd_level, "shuffle": params.shuffle,
            "chunks": len(full.chunks),
            "full_gbps": round(nbytes / t_full / gb, 4),
            "incr_gbps": round(nbytes / t_incr / gb, 4),
            "restore_gbps": round(nbytes / t_restore / gb, 4),
            "full_seconds": round(t_full, 3), "incr_seconds": round(t_incr, 3),
            "restore_seconds": round(t_restore, 3),
            "restore_alloc_seconds": round(restored.alloc_seconds, 3),
            "restore_warm_gbps": round(nbytes / t_warm / gb, 4),
            "fresh_memory_gbps": round(min(nbytes, 256 << 20) / fresh / gb, 4),
            "restore_gbps_after_alloc": round(nbytes / (t_restore - restored.alloc_seconds)
                                              / gb, 4),
            "full_bytes_written": full_written, "incr_bytes_written": incr_written,
            "changed_bytes": changed,
            "limit_gbps": round(limit / gb, 4), "cpu_limit_gbps": round(cpu_limit / gb, 4),
            "disk_write_gbps": round(1 / ref["write_fsync"] / gb, 4),
            "restore_limit_gbps": round(restore_limit / gb, 4),
            "restore_cpu_limit_gbps": round(restore_cpu / gb, 4),
            "disk_read_gbps": round(1 / ref["read"] / gb, 4),
            "reference_stage_gbps": {k: round(1 / v / gb, 3) for k, v in ref.items()},
            "restored_identical": same,
        }
        restored.close()
        result["full_vs_limit"] = round(full_gbps / limit_gbps, 3)
        result["incr_time_vs_full"] = round(t_incr / t_full, 3)
        result["incr_written_vs_changed"] = round(incr_written / changed, 3) if changed else None
        result["restore_vs_limit"] = round(restore_gbps / restore_limit_gbps, 3)
        result["restore_warm_vs_limit"] = round(nbytes / t_warm / gb / restore_limit_gbps, 3)
        return result
    finally:
        shutil.rmtree(base, ignore_errors=True)
