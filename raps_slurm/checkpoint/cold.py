"""Cold copies: every ``checkpoint.cold_every``-th generation of a rank on shared storage.

A cold copy is ``<cold_dir>/job-<id>/rank-<r>/<gen>.pack`` (the generation's distinct
chunks in the pack format) and ``<gen>.json`` (its manifest). Shared storage is outside
the agent's own disk: anyone who can write there (root on another node, a misconfigured
export) could plant or change files. So a cold copy is trusted only against the
generation's record in etcd: no record, no restore; the manifest must hash to the
record's ``manifest_digest`` and agree with its whole digest, chunk count and size; and
every chunk must decode to the raw size the manifest gives it and hash to its name.

For the same reason no path under ``cold_dir`` is followed blindly: ``cold_dir`` (made,
mode 0700, when missing; its parent must exist; not itself a link) must be a directory
of the agent's user (root) that no one else may write (or sticky); each
directory below it is made and opened relative to its parent (``mkdirat``, ``openat``
with ``O_NOFOLLOW``) and must be the agent's and writable by it alone; files are created
there with ``O_EXCL``/``O_NOFOLLOW`` and renamed within it. A symlink or someone else's
directory in the path is refused (:class:`ColdCopyError`), never followed.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.codec import Decoder
from raps_slurm.checkpoint.manifest import MAX_MANIFEST, Manifest, check_total, manifest_digest
from raps_slurm.checkpoint.pack import (
    HEADER,
    MAGIC,
    STORED_SLACK,
    PackError,
    iter_records,
    write_all,
)
from raps_slurm.checkpoint.transfer import encode_records, verify_chunk
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.errors import RapsError, RecordError

BATCH_BYTES = 64 << 20  # verified chunk bytes handed to the store at once
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_counter = itertools.count()


class ColdCopyError(RapsError):
    """A cold copy is refused: no record in etcd, or it does not match the record."""


def cold_path(cold_dir: str, job: str, rank: int) -> Path:
    """The directory of a rank's cold copies."""
    return Path(cold_dir) / f"job-{job}" / f"rank-{rank}"


def _check_dir(fd: int, where: Path, *, top: bool = False) -> None:
    """ColdCopyError unless ``fd`` is a directory of this process's user that no one else
    may write (``top``: the cold dir itself, root's or ours, may be sticky instead)."""
    st = os.fstat(fd)
    owners = (os.geteuid(), 0) if top else (os.geteuid(),)
    shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in owners or \
            (shared and not (top and st.st_mode & stat.S_ISVTX)):
        raise ColdCopyError(f"{where}: must be a directory of uid {os.geteuid()} that no "
                            f"one else may write (it is uid {st.st_uid}, mode "
                            f"{stat.S_IMODE(st.st_mode):o})")


def _open_dir(directory: Path, create: bool) -> int | None:
    """A descriptor of a rank's cold directory (``<cold_dir>/job-<id>/rank-<r>``), each
    level below ``cold_dir`` made (``create``) and opened without following a link; None
    when it does not exist and ``create`` is off. ColdCopyError for a level that is a
    link or not the agent's alone."""
    top = directory.parent.parent
    try:
        if create:  # the cold dir itself, not its parents (the admin's): a link is no dir
            with contextlib.suppress(FileExistsError):
                os.mkdir(top, 0o700)
        fd = os.open(top, _DIR_FLAGS | os.O_NOFOLLOW)
    except OSError as exc:
        if not create and exc.errno == errno.ENOENT:
            return None
        raise ColdCopyError(f"{top}: {exc} (a link is not followed)") from None
    try:
        _check_dir(fd, top, top=True)
        where = top
        for name in (directory.parent.name, directory.name):
            where = where / name
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
            try:
                sub = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if not create and exc.errno == errno.ENOENT:
                    os.close(fd)
                    return None
                raise ColdCopyError(f"{where}: {exc} (a link is not followed)") from None
            os.close(fd)
            fd = sub
            _check_dir(fd, where)
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def _rank_dir(directory: Path, create: bool = False) -> Iterator[int | None]:
    fd = _open_dir(directory, create)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _write_at(dfd: int, name: str, data: Iterable[bytes | memoryview]) -> None:
    """``name`` in the directory ``dfd``, through a new fsync'ed file and a rename there."""
    tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.{next(_counter)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dfd)
    try:
        write_all(fd, data)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # seldom read back
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    os.close(fd)
    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    os.fsync(dfd)


def _exists_at(dfd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def write_copy(chunks: ChunkStore, m: Manifest, directory: Path) -> bool:
    """Write generation ``m`` (its chunks read from ``chunks``) into ``directory``; False
    if it is already there. The manifest goes last: a copy without one is not a copy.
    ColdCopyError if a directory on the way is a link or not the agent's alone."""
    with _rank_dir(directory, create=True) as dfd:
        assert dfd is not None
        if _exists_at(dfd, f"{m.generation}.json"):
            return False
        records = [(d, chunks.raw_size(m.job, d) or 0, chunks.read(m.job, d))
                   for d in sorted(m.digests())]
        _write_at(dfd, f"{m.generation}.pack", [MAGIC, encode_records(records)])
        _write_at(dfd, f"{m.generation}.json", [m.to_json()])
    return True


def generations(directory: Path) -> list[int]:
    """The generations with a cold manifest in ``directory``, newest first (none when a
    directory on the way is a link or not the agent's alone: ColdCopyError)."""
    with _rank_dir(directory) as dfd:
        if dfd is None:
            return []
        names = os.listdir(dfd)
    return sorted((int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()),
                  reverse=True)


def _open_in(directory: Path, name: str) -> int:
    """``directory/name`` opened for reading, no link followed on the way."""
    with _rank_dir(directory) as dfd:
        if dfd is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory", str(directory))
        return os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dfd)


def _read_small(path: Path, limit: int) -> bytes:
    fd = _open_in(path.parent, path.name)
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
        fd = _open_in(directory, path.name)
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
