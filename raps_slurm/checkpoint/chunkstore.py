"""The node-local, content-addressed chunk store the agent owns (root, mode 0700).

Layout under the node's checkpoint dir (``checkpoint.local_dir`` with ``%n``)::

    job-<id>/packs/<name>.pack             stored chunks, many per file
    job-<id>/manifests/<rank>/<gen>.json   manifest of one generation
    job-<id>/tmp/                          files being written

Chunks are content-addressed (found by digest through an index) but stored in *pack
files*, as restic and borg do: one fsync per pack instead of one per chunk, which on a
journaling file system is the difference between a few hundred and a few thousand MB/s.
A pack has the layout of :mod:`raps_slurm.checkpoint.pack` (magic, then per chunk a
header with digest and sizes, then the stored bytes), so the index is rebuilt by
reading the headers when the agent starts.

Every file is written to ``tmp/`` under a unique name, fsync'ed, then renamed into
place, and the directory is fsync'ed before the write counts as done: a crash leaves
either the old state or the new, never a torn pack under a real name. A chunk already
indexed is not written again.

Pins keep chunks and generations from collection while a save, a restore or a
transfer uses them; :meth:`ChunkStore.collect` asks :mod:`raps_slurm.core.checkpoints`
what may go, deletes packs that hold nothing needed and rewrites packs that are mostly
garbage (and any pack holding a chunk dropped as corrupt).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from raps_slurm.checkpoint.manifest import Manifest, is_hex_digest
from raps_slurm.checkpoint.pack import (
    HEADER,
    MAGIC,
    PackEntry,
    PackError,
    iter_records,
    write_all,
)
from raps_slurm.core import checkpoints as decide
from raps_slurm.errors import RapsError

_counter = itertools.count()
log = logging.getLogger("raps.checkpoint")


class StoreIOError(RapsError):
    """The local chunk store cannot read or write (disk full, permissions, ...)."""


def _job_dir_name(job: str) -> str:
    if not (job.isascii() and job.isdigit() and 0 < len(job) <= 20):
        raise ValueError(f"job id {job!r}: expected 1..20 decimal digits")
    return f"job-{job}"


def write_atomic(directory: Path, tmp_dir: Path, name: str, data: Iterable[bytes | memoryview],
                 *, sync_dir: bool = True, durable: bool = True, cold: bool = False) -> None:
    """Write ``data`` to ``directory/name`` through a fsync'ed temp file and a rename
    (``durable=False``: no fsync at all; the caller syncs later, see ``sync_pending``).

    ``cold`` (with ``durable``): the file is seldom read back, so its pages leave the page
    cache once on disk. The node's cache stays the application's, and the next write
    reuses those pages instead of taking new ones: a new 8 MiB file cost 16 ms of CPU
    on the project's test machine, 1.8 ms this way."""
    tmp = tmp_dir / f".{name}.{os.getpid()}.{threading.get_ident()}.{next(_counter)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, data)
        if durable:
            os.fsync(fd)
            if cold:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, directory / name)
    if sync_dir and durable:
        fsync_dir(directory)


def drop_cached(path: Path) -> None:
    """Let ``path``'s pages leave the page cache (written back ones only; a file that is
    gone: nothing to do)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make renames in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Location:
    """Where a chunk is: pack file name, offset of its stored bytes, sizes."""

    pack: str
    offset: int
    stored_size: int
    raw_size: int


class ChunkStore:
    """Chunks and manifests of every job on this node; thread-safe."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._lock = threading.RLock()
        self._index: dict[str, dict[str, Location]] = {}  # job -> digest -> location
        self._pinned_chunks: Counter[tuple[str, str]] = Counter()   # (job, digest)
        self._pinned_gens: Counter[tuple[str, int, int]] = Counter()  # (job, rank, gen)
        self._unsynced: set[Path] = set()  # packs written without fsync (sync_pending)
        # manifest file -> (its stat, the chunk names it needs): collection runs at every
        # commit and would otherwise parse every kept manifest of the job each time
        self._needs: dict[Path, tuple[tuple[int, int, int], frozenset[str]]] = {}

    # --- paths -------------------------------------------------------------------------

    def job_dir(self, job: str) -> Path:
        """``<root>/job-<id>``."""
        return self.root / _job_dir_name(job)

    def _manifest_dir(self, job: str, rank: int) -> Path:
        return self.job_dir(job) / "manifests" / str(int(rank))

    def _packs(self, job: str) -> Path:
        return self.job_dir(job) / "packs"

    @staticmethod
    def _ensure(path: Path) -> Path:
        # Root-owned 0700 all the way down: the Prolog made job-<id> that way, and a
        # store created outside a job (tests, the benchmark) gets the same.
        if not path.is_dir():
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    # --- index -------------------------------------------------------------------------

    def _idx(self, job: str) -> dict[str, Location]:
        """The job's index, built from the pack headers on first use (caller holds the lock)."""
        idx = self._index.get(job)
        if idx is None:
            idx = {}
            packs = self._packs(job)
            if packs.is_dir():
                for path in sorted(packs.glob("*.pack")):
                    for digest, loc in self._scan(path):
                        idx.setdefault(digest, loc)
            self._index[job] = idx
        return idx

    @staticmethod
    def _scan(path: Path) -> list[tuple[str, Location]]:
        """Index entries of one pack; a damaged pack yields the records before the damage."""
        out: list[tuple[str, Location]] = []
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            log.warning("cannot read pack %s: %s", path, exc)
            return out
        try:
            for entry in iter_records(fd, with_payload=False):
                out.append((entry.digest, Location(path.name, entry.offset, entry.stored_size,
                                                   entry.raw_size)))
        except PackError as exc:
            log.warning("pack %s is damaged after %d chunks: %s", path, len(out), exc)
        finally:
            os.close(fd)
        return out

    # --- chunks ------------------------------------------------------------------------

    def has(self, job: str, digest: str) -> bool:
        """Is the chunk stored here?"""
        with self._lock:
            return digest in self._idx(job)

    def missing(self, job: str, digests: Iterable[str]) -> list[str]:
        """The names among ``digests`` not stored here, in the given order, once each."""
        with self._lock:
            idx = self._idx(job)
            seen: set[str] = set()
            out = []
            for d in digests:
                if d not in seen:
                    seen.add(d)
                    if d not in idx:
                        out.append(d)
            return out

    def put_many(self, job: str, chunks: Iterable[tuple[str, int, bytes | memoryview]],
                 *, durable: bool = True) -> tuple[int, int]:
        """Store chunks (digest, raw size, stored bytes) not yet here in one new durable
        pack; (chunks written, bytes written). Callers pin the digests first.

        ``durable=False`` (a restore, where the rank waits): written without fsync and
        listed for :meth:`sync_pending`; a pack lost to a crash before that is only a
        copy gone (every chunk is verified when read, and other holders have it)."""
        with self._lock:
            idx = self._idx(job)
            todo: dict[str, tuple[int, bytes | memoryview]] = {}
            for digest, raw_size, stored in chunks:
                if not is_hex_digest(digest):
                    raise ValueError(f"chunk name {digest!r:.80}: expected 64 hex digits")
                if digest not in idx and digest not in todo:
                    todo[digest] = (raw_size, stored)
        if not todo:
            return 0, 0
        name = f"{os.urandom(8).hex()}.pack"
        parts: list[bytes | memoryview] = [MAGIC]
        locs: dict[str, Location] = {}
        offset = len(MAGIC)
        for digest, (raw_size, stored) in todo.items():
            parts.append(HEADER.pack(bytes.fromhex(digest), raw_size, len(stored)))
            parts.append(stored)
            offset += HEADER.size
            locs[digest] = Location(name, offset, len(stored), raw_size)
            offset += len(stored)
        packs = self._ensure(self._packs(job))
        try:
            write_atomic(packs, self._ensure(self.job_dir(job) / "tmp"), name, parts,
                         durable=durable)
        except OSError as exc:
            raise StoreIOError(f"cannot write {len(todo)} chunk(s) of job {job}: {exc}") from exc
        with self._lock:
            idx = self._idx(job)
            for digest, loc in locs.items():
                idx.setdefault(digest, loc)
            if not durable:
                self._unsynced.add(packs / name)
        return len(locs), offset

    def sync_pending(self) -> int:
        """fsync the packs written with ``durable=False`` and their directories; how many."""
        with self._lock:
            todo, self._unsynced = self._unsynced, set()
        for path in sorted(todo):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # collected meanwhile
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for directory in sorted({p.parent for p in todo}):
            with contextlib.suppress(FileNotFoundError):
                fsync_dir(directory)
        return len(todo)

    def adopt(self, job: str, fd: int, entries: list[PackEntry]) -> tuple[int, int] | None:
        """Store the pack in ``fd`` as it is (``sendfile``: a kernel copy, no pass through
        Python) when none of its chunks is here yet; None otherwise (the caller filters).

        ``entries`` are the pack's records as :func:`iter_records` checked them.
        """
        with self._lock:
            idx = self._idx(job)
            digests = [e.digest for e in entries]
            if len(set(digests)) != len(digests) or any(d in idx for d in digests):
                return None
        size = os.fstat(fd).st_size
        name = f"{os.urandom(8).hex()}.pack"
        directory = self._ensure(self._packs(job))
        tmp_dir = self._ensure(self.job_dir(job) / "tmp")
        tmp = tmp_dir / f".{name}.{next(_counter)}"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600)
        try:
            done = 0
            while done < size:
                n = os.sendfile(out, fd, done, size - done)
                if n == 0:
                    raise OSError(f"pack shrank while being copied ({done} of {size} bytes)")
                done += n
            os.fsync(out)
        except OSError as exc:
            os.close(out)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise StoreIOError(f"cannot write {len(entries)} chunk(s) of job {job}: "
                               f"{exc}") from exc
        os.close(out)
        os.rename(tmp, directory / name)
        fsync_dir(directory)
        with self._lock:
            idx = self._idx(job)
            for e in entries:
                idx.setdefault(e.digest, Location(name, e.offset, e.stored_size, e.raw_size))
        return len(entries), size

    def put(self, job: str, digest: str, raw_size: int, stored: bytes | memoryview) -> bool:
        """Store one chunk; False if it was already there."""
        return self.put_many(job, [(digest, raw_size, stored)])[0] == 1

    def read(self, job: str, digest: str) -> bytes:
        """A stored chunk's bytes; FileNotFoundError if absent."""
        with self._lock:
            loc = self._idx(job).get(digest)
        if loc is None:
            raise FileNotFoundError(f"chunk {digest[:16]} of job {job} is not stored here")
        fd = os.open(self._packs(job) / loc.pack, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            data = os.pread(fd, loc.stored_size, loc.offset)
        finally:
            os.close(fd)
        if len(data) != loc.stored_size:
            raise FileNotFoundError(f"chunk {digest[:16]} of job {job}: pack {loc.pack} "
                                    f"is truncated")
        return data

    def raw_size(self, job: str, digest: str) -> int | None:
        """A stored chunk's raw size, None if absent."""
        with self._lock:
            loc = self._idx(job).get(digest)
        return None if loc is None else loc.raw_size

    def location(self, job: str, digest: str) -> Location | None:
        """Where a chunk is stored (tests and ``rapsctl verify`` name the pack)."""
        with self._lock:
            return self._idx(job).get(digest)

    def pack_path(self, job: str, loc: Location) -> Path:
        """The file of a location."""
        return self._packs(job) / loc.pack

    def drop(self, job: str, digests: Iterable[str]) -> int:
        """Remove chunks now (a corrupt copy before a good one is fetched): their packs are
        rewritten without them. Returns how many were here."""
        gone = set(digests)
        with self._lock:
            idx = self._idx(job)
            hit = {d for d in gone if d in idx}
            packs = {idx[d].pack for d in hit}
            for pack in packs:
                self._rewrite(job, pack, lambda d: d not in gone)
            for d in hit:
                idx.pop(d, None)
        return len(hit)

    def _rewrite(self, job: str, pack: str, keep: Callable[[str], bool]) -> None:
        """Replace ``pack`` by a pack of the chunks ``keep`` accepts (caller holds the lock)."""
        idx = self._idx(job)
        entries = self._scan(self._packs(job) / pack)
        kept = [(d, loc) for d, loc in entries if keep(d) and idx.get(d) == loc]
        if kept:
            chunks = []
            for d, loc in kept:
                try:
                    chunks.append((d, loc.raw_size, self.read(job, d)))
                except FileNotFoundError:
                    continue
            for d, _ in kept:
                idx.pop(d, None)  # put_many writes them again under the new pack
            self.put_many(job, chunks)
        for d, loc in entries:
            if idx.get(d) == loc:
                idx.pop(d)
        with contextlib.suppress(FileNotFoundError):
            (self._packs(job) / pack).unlink()
        fsync_dir(self._packs(job))

    def chunks(self, job: str) -> set[str]:
        """Every chunk name stored for ``job``."""
        with self._lock:
            return set(self._idx(job))

    def stored_bytes(self, job: str, digests: Iterable[str]) -> int:
        """Bytes on disk of the given chunks (those present)."""
        with self._lock:
            idx = self._idx(job)
            return sum(idx[d].stored_size for d in set(digests) if d in idx)

    def forget(self, job: str) -> None:
        """Drop the in-memory index of a job whose directory was removed."""
        with self._lock:
            self._index.pop(job, None)

    # --- manifests ---------------------------------------------------------------------

    def put_manifest(self, manifest: Manifest) -> bytes:
        """Store a manifest durably; returns its canonical JSON."""
        raw = manifest.to_json()
        directory = self._ensure(self._manifest_dir(manifest.job, manifest.rank))
        try:
            write_atomic(directory, self._ensure(self.job_dir(manifest.job) / "tmp"),
                         f"{manifest.generation}.json", [raw])
        except OSError as exc:
            raise StoreIOError(f"cannot write the manifest of rank {manifest.rank} "
                               f"generation {manifest.generation}: {exc}") from exc
        return raw

    def manifest_bytes(self, job: str, rank: int, gen: int) -> bytes | None:
        """A stored manifest's JSON, None if this node has none."""
        try:
            return (self._manifest_dir(job, rank) / f"{int(gen)}.json").read_bytes()
        except FileNotFoundError:
            return None

    def manifest(self, job: str, rank: int, gen: int) -> Manifest | None:
        """A stored manifest, decoded strictly (RecordError if damaged); None if absent."""
        raw = self.manifest_bytes(job, rank, gen)
        if raw is None:
            return None
        return Manifest.from_json(f"{self._manifest_dir(job, rank)}/{gen}.json", raw)

    def generations(self, job: str, rank: int) -> list[int]:
        """Generation numbers with a manifest here, ascending."""
        d = self._manifest_dir(job, rank)
        if not d.is_dir():
            return []
        return sorted(int(p.stem) for p in d.iterdir()
                      if p.suffix == ".json" and p.stem.isdigit())

    def ranks(self, job: str) -> list[int]:
        """Ranks with at least one manifest directory here."""
        d = self.job_dir(job) / "manifests"
        if not d.is_dir():
            return []
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())

    def delete_manifest(self, job: str, rank: int, gen: int) -> None:
        """Remove one generation's manifest (its chunks go at the next collection)."""
        with contextlib.suppress(FileNotFoundError):
            (self._manifest_dir(job, rank) / f"{int(gen)}.json").unlink()

    # --- pins and collection -----------------------------------------------------------

    @contextlib.contextmanager
    def pinned(self, job: str, digests: Iterable[str] = (),
               gens: Iterable[tuple[int, int]] = ()) -> Iterator[set[str]]:
        """Keep these chunks and (rank, gen) generations while the block runs; the yielded
        set may grow (chunks of a save in progress are added as they arrive)."""
        chunk_set = set(digests)
        gen_list = list(gens)
        with self._lock:
            for g in gen_list:
                self._pinned_gens[(job, *g)] += 1
        try:
            yield chunk_set
        finally:
            with self._lock:
                for g in gen_list:
                    self._dec(self._pinned_gens, (job, *g))
                for d in chunk_set:
                    self._dec(self._pinned_chunks, (job, d))

    def pin_chunk(self, job: str, pins: set[str], digest: str) -> None:
        """Add one chunk to a pin set from :meth:`pinned` (before it is written)."""
        with self._lock:
            if digest not in pins:
                pins.add(digest)
                self._pinned_chunks[(job, digest)] += 1

    @staticmethod
    def _dec(counter: Counter, key: object) -> None:  # type: ignore[type-arg]
        counter[key] -= 1
        if counter[key] <= 0:
            del counter[key]

    def _needed_by(self, job: str, rank: int, gen: int, seen: set[Path]) -> frozenset[str]:
        """The chunk names a stored manifest needs (none if it is gone), parsed once per
        version of its file; RapsError if it is damaged."""
        path = self._manifest_dir(job, rank) / f"{int(gen)}.json"
        try:
            st = path.stat()
        except FileNotFoundError:
            return frozenset()
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        seen.add(path)
        cached = self._needs.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        m = self.manifest(job, rank, gen)
        needs = frozenset(m.digests()) if m is not None else frozenset()
        self._needs[path] = (key, needs)
        return needs

    def collect(self, job: str, max_generations: int) -> decide.Collection:
        """Delete generations beyond the newest ``max_generations`` per rank and every chunk
        no kept manifest needs, sparing pins; returns what went.

        A pack holding nothing needed is deleted; one whose needed bytes are under half
        is rewritten with only those; others keep their garbage until they qualify.
        """
        with self._lock:
            pinned_gens = {(r, g) for (j, r, g) in self._pinned_gens if j == job}
            pinned_chunks = {d for (j, d) in self._pinned_chunks if j == job}
            gens = {r: self.generations(job, r) for r in self.ranks(job)}
            drop = decide.generations_to_drop(gens, max_generations, pinned_gens)
            for rank, gen in drop:
                self.delete_manifest(job, rank, gen)
            needed: set[str] = set(pinned_chunks)
            unreadable = []
            seen: set[Path] = set()
            for rank, kept in gens.items():
                for gen in kept:
                    if (rank, gen) in drop:
                        continue
                    try:
                        needs = self._needed_by(job, rank, gen, seen)
                    except RapsError:
                        unreadable.append((rank, gen))  # keep its chunks: may be repaired
                        continue
                    needed |= needs
            job_dir = self.job_dir(job)
            for path in [q for q in self._needs if q not in seen and job_dir in q.parents]:
                del self._needs[path]
            if unreadable:
                return decide.Collection(tuple(sorted(drop)), 0, tuple(unreadable))
            idx = self._idx(job)
            garbage = idx.keys() - needed
            # Only packs holding garbage can qualify: every commit, and every copy a peer
            # sends, collects, and most find no garbage in most packs (a pass no longer
            # sums every pack of the job's index).
            dirty = {idx[d].pack for d in garbage}
            by_pack: dict[str, list[tuple[str, Location]]] = {p: [] for p in dirty}
            if dirty:
                for d, loc in idx.items():
                    entries = by_pack.get(loc.pack)
                    if entries is not None:
                        entries.append((d, loc))
            for pack, entries in by_pack.items():
                live = sum(loc.stored_size for d, loc in entries if d in needed)
                total = sum(loc.stored_size for _, loc in entries)
                if live * 2 < total:
                    self._rewrite(job, pack, lambda d: d in needed)
            for d in garbage:
                idx.pop(d, None)
        return decide.Collection(tuple(sorted(drop)), len(garbage), ())
