"""Cold copies: every ``checkpoint.cold_every``-th generation of a rank on shared storage.

A cold copy is ``<cold_dir>/job-<id>/rank-<r>/<gen>.pack`` (the generation's distinct
chunks in the pack format) and ``<gen>.json`` (its manifest). Shared storage is outside
the agent's own disk: anyone who can write there (root on another node, a misconfigured
export) could plant or change files. So a cold copy is trusted only against the
generation's record in etcd: no record, no restore; the manifest must hash to the
record's ``manifest_digest`` and agree with its whole digest, chunk count and size; and
every chunk must decode to the raw size the manifest gives it and hash to its name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from raps_slurm.checkpoint.chunkstore import ChunkStore, write_atomic
from raps_slurm.checkpoint.codec import Decoder
from raps_slurm.checkpoint.manifest import MAX_MANIFEST, Manifest, check_total, manifest_digest
from raps_slurm.checkpoint.pack import HEADER, MAGIC, STORED_SLACK, PackError, iter_records
from raps_slurm.checkpoint.transfer import encode_records, verify_chunk
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.errors import RapsError, RecordError

BATCH_BYTES = 64 << 20  # verified chunk bytes handed to the store at once


class ColdCopyError(RapsError):
    """A cold copy is refused: no record in etcd, or it does not match the record."""


def cold_path(cold_dir: str, job: str, rank: int) -> Path:
    """The directory of a rank's cold copies."""
    return Path(cold_dir) / f"job-{job}" / f"rank-{rank}"


def write_copy(chunks: ChunkStore, m: Manifest, directory: Path) -> bool:
    """Write generation ``m`` (its chunks read from ``chunks``) into ``directory``; False
    if it is already there. The manifest goes last: a copy without one is not a copy."""
    if (directory / f"{m.generation}.json").exists():
        return False
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    records = [(d, chunks.raw_size(m.job, d) or 0, chunks.read(m.job, d))
               for d in sorted(m.digests())]
    write_atomic(directory, directory, f"{m.generation}.pack", [MAGIC, encode_records(records)])
    write_atomic(directory, directory, f"{m.generation}.json", [m.to_json()])
    return True


def generations(directory: Path) -> list[int]:
    """The generations with a cold manifest in ``directory``, newest first."""
    if not directory.is_dir():
        return []
    return sorted((int(p.stem) for p in directory.glob("*.json") if p.stem.isdigit()),
                  reverse=True)


def _read_small(path: Path, limit: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ColdCopyError(f"{path}: {size} bytes, a manifest is at most {limit}")
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def load_manifest(directory: Path, job: str, rank: int, gen: int, rec: CkptRecord | None,
                  quota: int = 0) -> Manifest:
    """The cold manifest of generation ``gen`` once it matches ``rec`` (the record in
    etcd); ColdCopyError saying what is missing or does not match."""
    where = str(directory / f"{gen}.json")
    if rec is None:
        raise ColdCopyError(f"{where}: generation {gen} has no record in etcd; a cold copy "
                            "is restored only against its record")
    try:
        raw = _read_small(directory / f"{gen}.json", MAX_MANIFEST)
    except OSError as exc:
        raise ColdCopyError(f"{where}: {exc}") from None
    if manifest_digest(raw) != rec.manifest_digest:
        raise ColdCopyError(f"{where}: manifest does not match the digest recorded in etcd")
    try:
        m = Manifest.from_json(where, raw)
        check_total(where, m.total_size, len(m.chunks), quota)
    except RecordError as exc:
        raise ColdCopyError(str(exc)) from None
    if (m.job, m.rank, m.generation) != (job, rank, gen) or \
            (m.whole_digest, len(m.chunks), m.total_size) != \
            (rec.whole_digest, rec.chunks, rec.total_size):
        raise ColdCopyError(f"{where}: manifest disagrees with the record of job {job} rank "
                            f"{rank} generation {gen}")
    return m


def verified_chunks(directory: Path, m: Manifest, need: set[str], bad: list[str]
                    ) -> Iterator[list[tuple[str, int, bytes]]]:
    """Batches of the cold pack's chunks in ``need``, each checked against its name and
    the raw size ``m`` gives it; the names of bad ones are appended to ``bad``.
    ColdCopyError if the pack cannot be read."""
    sizes = dict(m.chunks)
    limit = len(MAGIC) + m.total_size + len(sizes) * (HEADER.size + STORED_SLACK)
    path = directory / f"{m.generation}.pack"
    dec = Decoder()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise ColdCopyError(f"{path}: {exc}") from None
    try:
        batch: list[tuple[str, int, bytes]] = []
        size = 0
        for e in iter_records(fd, limit=limit):
            if e.digest not in need:
                continue
            if e.raw_size != sizes.get(e.digest) or verify_chunk(
                    m.digest_algo, e.digest, e.raw_size, e.payload, dec) is not None:
                bad.append(e.digest)
                continue
            batch.append((e.digest, e.raw_size, e.payload))
            size += len(e.payload)
            if size >= BATCH_BYTES:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch
    except PackError as exc:
        raise ColdCopyError(f"{path}: {exc}") from None
    finally:
        os.close(fd)
