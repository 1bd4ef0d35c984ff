"""Cold copies are restored only against their record in etcd (issue 21, item 6).

Two checkpoint services on the in-memory store: n1 saves (every generation gets a cold
copy), n4 restores with no live holder, so the cold copy is all it has.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from raps_slurm.checkpoint import cold
from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.pack import HEADER, MAGIC
from raps_slurm.checkpoint.reader import materialize
from raps_slurm.checkpoint.restore_parts import RestoreError
from raps_slurm.checkpoint.service import CheckpointService
from raps_slurm.checkpoint.writer import encode_state
from raps_slurm.config import Config
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry, RankMap, group_to_json
from raps_slurm.errors import RecordError
from raps_slurm.model import BackupGroup
from raps_slurm.store import Keys, MemoryStore

JOB = "4242"


class Pair:
    def __init__(self, root: Path, cold_every: int = 1, keep: int = 3) -> None:
        cfg = Config()
        self.cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
            cfg.checkpoint, avg_chunk_kb=16, max_generations=keep,
            cold_dir=str(root / "cold"), cold_every=cold_every))
        self.store, self.keys = MemoryStore(), Keys()
        key = secrets.token_bytes(32)
        self.saver = CheckpointService(self.cfg, self.store, self.keys, "n1", key,
                                       ChunkStore(root / "n1"), peers=dict)
        self.spare = CheckpointService(self.cfg, self.store, self.keys, "n4", key,
                                       ChunkStore(root / "n4"), peers=dict)
        s, k = self.store, self.keys
        s.put(k.job(JOB), JobRecord(JOB, 0, 1000, ("n1", "n2", "n4"), JobSpec(spares=1))
              .to_json())
        s.put(k.job_map(JOB), RankMap(JOB, 0, ("n1",), ("n4",), 0, 0.0).to_json())
        s.put(k.job_rank(JOB, 0), RankEntry(0, "n1", 1, "running", ("n4",)).to_json())
        s.put(k.job_group(JOB, 0), group_to_json(BackupGroup(0, "n1", "n2", ())))
        self.dir = cold.cold_path(self.cfg.checkpoint.cold_dir, JOB, 0)

    def save(self, state: np.ndarray) -> int:
        svc = self.saver
        sid, _ = svc.begin(JOB, 0, 1, None)
        m, _ = encode_state(state, job=JOB, rank=0, epoch=1, params=svc.params, previous=None,
                            sink=lambda p: svc.put(sid, p.fd), pack_bytes=256 << 10)
        gen = svc.commit(sid, m.to_json()).generation
        svc.replicate(JOB, 0, gen)  # the background lane's work, done here
        return gen

    def restore(self) -> object:
        return self.spare.restore(JOB, 0)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    yield p
    p.store.close()


def field(n: int = 60_000, seed: int = 1) -> np.ndarray:
    return np.sin(np.linspace(0, 30, n)) + np.random.default_rng(seed).standard_normal(n) * 1e-3


def test_a_good_cold_copy_restores(pair: Pair) -> None:
    a = field()
    assert pair.save(a) == 1
    result = pair.restore()
    assert result is not None and result.generation == "cold 1"
    assert [f.generation for f in result.fallbacks] == [1]  # no live holder first
    assert np.array_equal(materialize(result.restored.manifest, result.restored.buffer), a)
    result.restored.close()


def test_a_record_no_commit_backs_is_not_restored_from(
        pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    """Every agent may write any job's shared records: root on n9 (not of the job) writes
    a newer generation whose primary and holder are n9, and a copy of n1's record naming
    n9 as a holder. Neither has a commit under its primary's own keys, so the spare
    restores neither: the genuine cold copy of generation 1 is restored."""
    a = field()
    assert pair.save(a) == 1
    kv = pair.store.get(pair.keys.ckpt(JOB, 0, 1))
    assert kv is not None
    genuine = CkptRecord.from_json(kv.key, kv.value)
    forged = dataclasses.replace(genuine, generation=5, primary="n9", holders=("n9",))
    added = dataclasses.replace(genuine, generation=4, holders=("n1", "n9"))
    for rec in (forged, added):
        pair.store.put(pair.keys.ckpt(JOB, 0, rec.generation), rec.to_json())
    with caplog.at_level("WARNING"):
        trusted = pair.spare.trusted_records(JOB, 0)
    assert sorted((r.generation, r.holders) for r in trusted) == [(1, ("n1",))]
    assert "generation 5: no commit of its primary n9 matches the record" in caplog.text
    result = pair.restore()
    assert result is not None and result.generation == "cold 1"
    assert [f.generation for f in result.fallbacks] == [1]
    assert np.array_equal(materialize(result.restored.manifest, result.restored.buffer), a)
    result.restored.close()
    pair.store.delete(pair.keys.job(JOB))  # unregistered: nothing to check them against
    with pytest.raises(RestoreError, match=f"job {JOB} has no registration in etcd"):
        pair.restore()


def test_a_tampered_cold_pack_is_refused(pair: Pair) -> None:
    pair.save(field())
    pack = pair.dir / "1.pack"
    data = bytearray(pack.read_bytes())
    victim = data[len(MAGIC):len(MAGIC) + 32].hex()
    data[len(MAGIC) + HEADER.size + 10] ^= 0xFF  # inside the first chunk's stored bytes
    pack.write_bytes(bytes(data))
    with pytest.raises(RestoreError, match="cold 1: cold copy is damaged"):
        pair.restore()
    assert not pair.spare.chunks.manifest_bytes(JOB, 0, 1)
    assert pair.spare.chunks.missing(JOB, [victim]) == [victim]


def test_a_cold_manifest_that_does_not_match_the_record_is_refused(pair: Pair,
                                                                   tmp_path: Path) -> None:
    pair.save(field())
    # A whole, self-consistent cold copy of other data, planted under the same name.
    other = Pair(tmp_path / "forger")
    other.save(field(seed=7))
    for name in ("1.json", "1.pack"):
        (pair.dir / name).write_bytes((other.dir / name).read_bytes())
    with pytest.raises(RestoreError, match=r"cold 1: .*1\.json: manifest does not match the "
                                           "digest recorded in etcd"):
        pair.restore()
    assert not pair.spare.chunks.manifest_bytes(JOB, 0, 1)


def test_a_cold_manifest_changed_in_place_is_refused(pair: Pair) -> None:
    pair.save(field())
    path = pair.dir / "1.json"
    m = json.loads(path.read_bytes())
    m["extra"] = {"steered": True}
    path.write_text(json.dumps(m, sort_keys=True, separators=(",", ":")))
    with pytest.raises(RestoreError, match="does not match the digest recorded in etcd"):
        pair.restore()


def test_a_cold_copy_without_a_record_is_refused(pair: Pair) -> None:
    a = field()
    pair.save(a)
    # Another agent deletes the shared record: the primary's commit still vouches for it.
    pair.store.delete(pair.keys.ckpt(JOB, 0, 1))
    result = pair.restore()
    assert result is not None and result.generation == "cold 1"
    assert np.array_equal(materialize(result.restored.manifest, result.restored.buffer), a)
    result.restored.close()
    pair.spare.chunks.delete_manifest(JOB, 0, 1)
    # The primary's commit gone too (only its own agent can delete it): no record at all.
    pair.store.delete(pair.keys.ckpt_commit("n1", JOB, 0, 1))
    with pytest.raises(RestoreError, match="generation 1 has no record in etcd"):
        pair.restore()
    assert not pair.spare.chunks.manifest_bytes(JOB, 0, 1)


def test_collection_keeps_the_record_of_the_newest_cold_generation(tmp_path: Path) -> None:
    p = Pair(tmp_path, cold_every=2, keep=1)
    a = field()
    for i in range(3):
        p.save(a + i)
    gens = sorted(int(kv.key.rsplit("/", 1)[1])
                  for kv in p.store.get_prefix(p.keys.ckpt_prefix(JOB, 0)))
    assert gens == [2, 3]  # 3 is kept, 2 is the newest cold one, 1 is gone
    result = p.restore()
    assert result is not None and result.generation == "cold 2"
    assert np.array_equal(materialize(result.restored.manifest, result.restored.buffer), a + 1)
    result.restored.close()


def test_a_generation_above_the_job_quota_is_neither_committed_nor_restored(
        pair: Pair) -> None:
    a = field()
    pair.saver.quota = a.nbytes - 1
    with pytest.raises(RecordError, match=f"above the job's quota of {a.nbytes - 1} bytes"):
        pair.save(a)
    pair.saver.quota = a.nbytes
    pair.save(a)
    pair.spare.quota = a.nbytes - 1  # a restore checks it again, hot and cold
    with pytest.raises(RestoreError, match=r"1: record of generation 1: total_size \d+ is "
                                           r"above the job's quota.*cold 1: .*above the job's"):
        pair.restore()
    assert not pair.spare.chunks.manifest_bytes(JOB, 0, 1)
