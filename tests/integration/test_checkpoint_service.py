"""Checkpoint commit, replication, repair and restore between agents' services.

Four checkpoint services (one per fake node) with their own chunk stores and transfer
servers on 127.0.0.1, against the cluster's real etcd. Which nodes are alive is what the
``peers`` map says (a node missing from it is down, as an agent whose registration
lapsed).
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.logstore import LogStoreError
from raps_slurm.checkpoint.manifest import manifest_digest
from raps_slurm.checkpoint.reader import materialize
from raps_slurm.checkpoint.restore_parts import RestoreError
from raps_slurm.checkpoint.service import CheckpointService, Fenced, LogUnbacked
from raps_slurm.checkpoint.transfer import TransferServer
from raps_slurm.checkpoint.writer import encode_state
from raps_slurm.config import Config
from raps_slurm.core.checkpoints import CkptRecord, restore_order
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry, RankMap, group_to_json
from raps_slurm.model import BackupGroup
from raps_slurm.runtime.msglog import Entry, checksum
from raps_slurm.store import Keys, StateStore

NODES = ("n1", "n2", "n3", "n4")
_jobs = itertools.count(int(secrets.token_hex(3), 16) % 100_000 + 800_000)


class Nodes:
    """Services and transfer servers of the four nodes, and who is up."""

    def __init__(self, store: StateStore, keys: Keys, root: Path, cfg: Config) -> None:
        self.store, self.keys = store, keys
        self.key = secrets.token_bytes(32)
        self.up: set[str] = set(NODES)
        self.servers: dict[str, TransferServer] = {}
        self.services: dict[str, CheckpointService] = {}
        for n in NODES:
            chunks = ChunkStore(root / n)
            server = TransferServer(chunks, self.key, n, ("127.0.0.1", 0),
                                    max_generations=cfg.checkpoint.max_generations)
            server.start()
            self.servers[n] = server
            svc = CheckpointService(cfg, store, keys, n, self.key, chunks, peers=self.peers)
            svc.start()
            self.services[n] = svc

    def peers(self) -> dict[str, tuple[str, int]]:
        return {n: s.address for n, s in self.servers.items() if n in self.up}

    def close(self) -> None:
        for svc in self.services.values():
            svc.stop()
        for server in self.servers.values():
            server.stop()


@pytest.fixture
def nodes(store: tuple[StateStore, Keys], tmp_path: Path) -> Iterator[Nodes]:
    cfg = Config()
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
        cfg.checkpoint, avg_chunk_kb=16, max_generations=3, cold_dir=str(tmp_path / "cold"),
        cold_every=2))
    n = Nodes(*store, tmp_path, cfg)
    yield n
    n.close()


def new_job(nodes: Nodes, *, epoch: int = 1, replicas: int = 2) -> str:
    job = str(next(_jobs))
    s, k = nodes.store, nodes.keys
    s.delete_prefix(k.job_prefix(job))
    s.put(k.job(job), JobRecord(job, 0, 1000, NODES, JobSpec(spares=1)).to_json())
    s.put(k.job_map(job), RankMap(job, 0, ("n1",), ("n4",), replicas, 0.0).to_json())
    s.put(k.job_rank(job, 0), RankEntry(0, "n1", epoch, "running", ("n4",)).to_json())
    s.put(k.job_group(job, 0),
          group_to_json(BackupGroup(0, "n1", "n2", ("n3",) if replicas > 1 else ())))
    return job


def field(n: int = 200_000, seed: int = 1) -> np.ndarray:
    return np.sin(np.linspace(0, 30, n)) * 50 + np.random.default_rng(seed).standard_normal(n) * 1e-3


def save(svc: CheckpointService, job: str, state: object, previous=None, epoch: int = 1):
    sid, ok = svc.begin(job, 0, epoch, previous.generation if previous else None)
    m, _ = encode_state(state, job=job, rank=0, epoch=epoch, params=svc.params,
                        previous=previous if ok else None, sink=lambda p: svc.put(sid, p.fd),
                        pack_bytes=256 << 10)
    record = svc.commit(sid, m.to_json())
    return record, m.with_generation(record.generation)


def record(nodes: Nodes, job: str, gen: int) -> CkptRecord:
    kv = nodes.store.get(nodes.keys.ckpt(job, 0, gen))
    assert kv is not None
    return CkptRecord.from_json(kv.key, kv.value)


def test_commit_replicates_to_the_group_with_delta_transfer(nodes: Nodes) -> None:
    job = new_job(nodes)
    n1 = nodes.services["n1"]
    a = field()
    rec, m1 = save(n1, job, a)
    assert rec.generation == 1 and rec.state == "under_replicated" and rec.holders == ("n1",)
    n1.wait_idle()
    rec = record(nodes, job, 1)
    assert rec.state == "committed" and rec.holders == ("n1", "n2", "n3")
    full = n1.pushed_bytes
    assert full > 0.5 * a.nbytes * 2 * 0.5
    a[50_000:51_000] += 1  # 8 KB of 1.6 MB
    _, m2 = save(n1, job, a, m1)
    n1.wait_idle()
    delta = n1.pushed_bytes - full
    assert record(nodes, job, 2).state == "committed"
    assert delta < full / 10, (delta, full)
    for n in ("n2", "n3"):
        held = nodes.services[n].chunks
        assert held.missing(job, m2.digests()) == []


def test_without_delta_transfer_every_chunk_travels(nodes: Nodes) -> None:
    n1 = nodes.services["n1"]
    n1.cfg = dataclasses.replace(n1.cfg, checkpoint=dataclasses.replace(
        n1.cfg.checkpoint, use_delta_transfer=False))
    job = new_job(nodes)
    a = field()
    _, m1 = save(n1, job, a)
    n1.wait_idle()
    full = n1.pushed_bytes
    a[50_000:51_000] += 1
    save(n1, job, a, m1)
    n1.wait_idle()
    again = n1.pushed_bytes - full
    assert again > 0.9 * full, (again, full)


def test_partner_down_gives_under_replicated_then_repair(nodes: Nodes) -> None:
    job = new_job(nodes)
    n1 = nodes.services["n1"]
    nodes.up.discard("n3")
    save(n1, job, field())
    n1.wait_idle()
    rec = record(nodes, job, 1)
    assert rec.state == "under_replicated" and rec.holders == ("n1", "n2")
    nodes.up.add("n3")
    assert n1.repair() >= 1
    n1.wait_idle()
    rec = record(nodes, job, 1)
    assert rec.state == "committed" and rec.holders == ("n1", "n2", "n3")


class _CountingReads:
    """The real store, with the prefixes read through it counted."""

    def __init__(self, store: StateStore) -> None:
        self._store, self.prefixes = store, []  # type: list[str]

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def get_prefix(self, prefix: str):
        self.prefixes.append(prefix)
        return self._store.get_prefix(prefix)


def test_repair_reads_only_the_records_of_ranks_primary_here(nodes: Nodes) -> None:
    job = new_job(nodes)
    n1, n2 = nodes.services["n1"], nodes.services["n2"]
    save(n1, job, field())
    n1.wait_idle()
    ckpts = nodes.keys.ckpt_prefix(job, 0)
    spy = n2.store = _CountingReads(nodes.store)  # type: ignore[assignment]
    n2.repair()  # the first pass reads every rank held here: n2 holds a copy of rank 0
    assert spy.prefixes.count(ckpts) == 1
    n2.repair()  # n2 is not its primary: not read again
    assert spy.prefixes.count(ckpts) == 1
    n2.store = nodes.store
    # a primary's ranks: found by its first pass, or by their commits after it
    n1.repair()
    later = new_job(nodes)
    nodes.up.discard("n3")
    save(n1, later, field(seed=2))
    n1.wait_idle()
    assert record(nodes, later, 1).state == "under_replicated"
    nodes.up.add("n3")
    assert n1.repair() >= 1
    n1.wait_idle()
    assert record(nodes, later, 1).state == "committed"


def test_restore_on_a_node_holding_nothing_pulls_and_verifies(nodes: Nodes) -> None:
    job = new_job(nodes)
    a = field()
    save(nodes.services["n1"], job, a)
    nodes.services["n1"].wait_idle()
    nodes.up.discard("n1")  # the primary's node died
    n4 = nodes.services["n4"]
    assert n4.chunks.chunks(job) == set()
    result = n4.restore(job, 0)
    assert result is not None and result.generation == 1 and result.fallbacks == []
    assert materialize(result.restored.manifest, result.restored.buffer).tobytes() == a.tobytes()
    result.restored.close()
    # decoded from the pulled chunks in memory; stored, and n4 a holder, once the
    # replication lane has kept them
    n4.wait_idle()
    assert result.pulled_chunks == len(n4.chunks.chunks(job)) > 0
    assert "n4" in record(nodes, job, 1).holders
    assert n4.chunks.manifest(job, 0, 1) is not None
    again = n4.restore(job, 0)  # from its own store now: nothing pulled
    assert again is not None and again.pulled_chunks == 0 and again.sources == ()
    assert materialize(again.restored.manifest, again.restored.buffer).tobytes() == a.tobytes()
    again.restored.close()


def test_flipped_byte_on_every_holder_falls_back_and_names_chunk_and_holders(
        nodes: Nodes) -> None:
    job = new_job(nodes)
    n1 = nodes.services["n1"]
    a = field()
    _, m1 = save(n1, job, a)
    b = a.copy()
    b[100_000:100_500] += 3
    _, m2 = save(n1, job, b, m1)
    n1.wait_idle()
    victim = sorted(m2.digests() - m1.digests())[0]
    for n in ("n1", "n2", "n3"):
        chunks = nodes.services[n].chunks
        loc = chunks.location(job, victim)
        assert loc is not None
        with open(chunks.pack_path(job, loc), "r+b") as f:
            f.seek(loc.offset + loc.stored_size - 1)
            last = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([last[0] ^ 1]))
    result = nodes.services["n4"].restore(job, 0)
    assert result is not None and result.generation == 1
    assert np.array_equal(materialize(result.restored.manifest, result.restored.buffer), a)
    result.restored.close()
    [fb] = result.fallbacks
    assert fb.generation == 2
    assert {b["digest"] for b in fb.bad} == {victim}
    assert {b["holder"] for b in fb.bad} <= {"n1", "n2", "n3"} and fb.bad
    assert set(record(nodes, job, 2).bad) == {b["holder"] for b in fb.bad}


def test_cold_copy_is_the_last_fallback(nodes: Nodes) -> None:
    job = new_job(nodes)
    n1 = nodes.services["n1"]
    a = field(50_000)
    _, m1 = save(n1, job, a)
    save(n1, job, a * 2, m1)  # generation 2: cold_every=2 copies it
    n1.wait_idle()
    assert record(nodes, job, 2).cold
    nodes.up.clear()
    nodes.up.add("n4")  # every holder is gone
    result = nodes.services["n4"].restore(job, 0)
    assert result is not None and result.generation == "cold 2"
    assert [f.generation for f in result.fallbacks] == [2, 1]
    assert np.array_equal(materialize(result.restored.manifest, result.restored.buffer), a * 2)
    result.restored.close()


def test_restore_with_nothing_anywhere(nodes: Nodes) -> None:
    job = new_job(nodes)
    assert nodes.services["n4"].restore(job, 0) is None
    save(nodes.services["n1"], job, field(20_000))
    nodes.services["n1"].wait_idle()
    nodes.up.clear()
    nodes.up.add("n4")
    with pytest.raises(RestoreError, match="no generation of rank 0"):
        nodes.services["n4"].restore(job, 0)


def test_a_fenced_copy_cannot_commit(nodes: Nodes) -> None:
    job = new_job(nodes, epoch=2)
    n1 = nodes.services["n1"]
    with pytest.raises(Fenced, match="epoch 2; this copy is epoch 1"):
        save(n1, job, field(20_000), epoch=1)
    assert nodes.store.get_prefix(nodes.keys.ckpt_prefix(job, 0)) == []
    assert n1.chunks.generations(job, 0) == []
    rec, _ = save(n1, job, field(20_000), epoch=2)
    assert rec.generation == 1 and rec.epoch == 2


def test_generations_beyond_the_limit_are_collected_everywhere(nodes: Nodes) -> None:
    job = new_job(nodes)
    n1 = nodes.services["n1"]
    a = field(50_000)
    prev = None
    for i in range(5):
        a[i * 1000:(i + 1) * 1000] += 1
        _, prev = save(n1, job, a, prev)
        n1.wait_idle()
    gens = sorted(int(kv.key.rsplit("/", 1)[1])
                  for kv in nodes.store.get_prefix(nodes.keys.ckpt_prefix(job, 0)))
    assert gens == [3, 4, 5]
    for n in ("n1", "n2", "n3"):
        assert nodes.services[n].chunks.generations(job, 0) == [3, 4, 5]


def log_segment(dst: int, first: int, count: int, epoch: int = 1) -> bytes:
    """A log segment of ``count`` messages to ``dst`` from seq ``first``, bodies included."""
    out = []
    for seq in range(first, first + count):
        body = f"message {seq} to {dst}".encode()
        e = Entry(dst, seq, epoch, len(body), checksum(body), False, body)
        out.extend(bytes(p) for p in e.record(with_body=True))
    return b"".join(out)


def quick_lease(nodes: Nodes, seconds: float) -> None:
    for svc in nodes.services.values():
        svc.cfg = dataclasses.replace(svc.cfg, detection=dataclasses.replace(
            svc.cfg.detection, lease_duration_sec=seconds))


def test_a_generation_commits_only_once_its_log_is_on_the_log_backup(nodes: Nodes) -> None:
    job = new_job(nodes)
    n1, n2 = nodes.services["n1"], nodes.services["n2"]
    quick_lease(nodes, 1.0)
    first = n1.append_log(job, 0, log_segment(1, 1, 5))
    assert n1.logcopy.wait_backed(job, 0, first, 30)  # (the machine may be loaded)
    nodes.up.discard("n2")  # the log backup goes down with segment 2 only on n1
    n1.logcopy._peers = (-1e18, {})  # the lane reads the peers afresh (it caches them 1 s)
    second = n1.append_log(job, 0, log_segment(1, 6, 5))
    assert n1.logcopy.stats.lagging >= 1  # the flush waited its bound, then went on
    with pytest.raises(LogUnbacked, match="log backup holds segments up to"):
        save(n1, job, field(20_000))
    assert nodes.store.get_prefix(nodes.keys.ckpt_prefix(job, 0)) == []
    nodes.up.add("n2")
    n1.logcopy._peers = (-1e18, {})
    rec, _ = save(n1, job, field(20_000))  # the commit waits for the copy, then commits
    assert rec.generation == 1
    assert second in n2.logs.segments(job, 0)
    assert n2.logs.read(job, 0) == n1.logs.read(job, 0)


def test_a_new_log_backup_receives_the_whole_log_not_only_new_segments(nodes: Nodes) -> None:
    job = new_job(nodes)
    n1 = nodes.services["n1"]
    for i in range(3):
        last = n1.append_log(job, 0, log_segment(1, 1 + 10 * i, 10))
    assert n1.logcopy.wait_backed(job, 0, last, 30)  # (the machine may be loaded)
    assert nodes.services["n2"].logs.read(job, 0) == n1.logs.read(job, 0)
    # n2 died; the coordinator made n4 the rank's log backup
    nodes.up.discard("n2")
    nodes.store.put(nodes.keys.job_group(job, 0),
                    group_to_json(BackupGroup(0, "n1", "n4", ("n3",))))
    n1.logcopy._groups.clear()
    n1.logcopy._peers = (-1e18, {})
    last = n1.append_log(job, 0, log_segment(1, 31, 10))
    assert n1.logcopy.wait_backed(job, 0, last, 30)
    n4 = nodes.services["n4"]
    assert n4.logs.segments(job, 0) == n1.logs.segments(job, 0)
    assert n4.logs.read(job, 0) == n1.logs.read(job, 0)


def test_segment_numbers_never_collide_across_incarnations(nodes: Nodes) -> None:
    job = new_job(nodes)
    n1, n3 = nodes.services["n1"], nodes.services["n3"]
    old = [n1.append_log(job, 0, log_segment(1, 1 + i, 1), epoch=1) for i in range(3)]
    assert n1.logcopy.wait_backed(job, 0, old[-1], 30)
    # epoch 2 runs on n3 and reloads the log from the backup; the fenced epoch 1 on n1
    # goes on flushing: neither may write a number the other wrote
    assert n3.read_log(job, 0) == n1.logs.read(job, 0)
    new = n3.append_log(job, 0, log_segment(1, 4, 1, epoch=2), epoch=2)
    late = n1.append_log(job, 0, log_segment(1, 4, 1, epoch=1), epoch=1)
    assert old == [(1 << 32) + 1, (1 << 32) + 2, (1 << 32) + 3]
    assert new == (2 << 32) + 1 and late == (1 << 32) + 4
    # a copy of an existing number with other bytes is refused, not silently dropped
    with pytest.raises(LogStoreError, match="already stored with other bytes"):
        n3.logs.append(job, 0, log_segment(1, 9, 1), number=old[0])
    assert n3.logs.append(job, 0, n1.logs.segment(job, 0, old[0]), number=old[0]) == old[0]


def forge(nodes: Nodes, job: str, node: str, state: object, gen: int, epoch: int = 1
          ) -> CkptRecord:
    """Root on ``node`` (a node of the job) stores a state of its own as a generation of
    rank 0 and writes its record: the shared one any agent may write, and a commit under
    its own node's keys. The agent's checks are skipped, as root would."""
    svc = nodes.services[node]
    sid, _ = svc.begin(job, 0, epoch, None)
    m, _ = encode_state(state, job=job, rank=0, epoch=epoch, params=svc.params, previous=None,
                        sink=lambda p: svc.put(sid, p.fd), pack_bytes=256 << 10)
    raw = svc.local.finish(svc.session(sid), m, gen)
    svc.abort(sid)
    rec = CkptRecord(0, gen, epoch, manifest_digest(raw), m.total_size, m.total_size,
                     len(m.chunks), m.whole_digest, node, (node,), 0, "committed", time.time())
    nodes.store.put(nodes.keys.ckpt(job, 0, gen), rec.to_json())
    nodes.store.put(nodes.keys.ckpt_commit(node, job, 0, gen), rec.to_json())
    return rec


def move(nodes: Nodes, job: str, node: str) -> None:
    """The leader moves rank 0 to ``node`` at the next epoch."""
    kv = nodes.store.get(nodes.keys.job_rank(job, 0))
    assert kv is not None
    entry = RankEntry.from_json(kv.key, kv.value)
    nodes.store.put(kv.key, entry.moved(node, entry.epoch + 1, "relaunched", ()).to_json())


def test_root_on_a_backup_holder_cannot_have_the_rank_restore_its_state(
        nodes: Nodes) -> None:
    """n2 holds rank 0's log backup: root there commits a newer generation of its own
    (as n2) and deletes the genuine record. When n1 dies, the spare restores n1's last
    generation, from the copies of n3 (and n2), never n2's forgery."""
    job = new_job(nodes)
    a = field()
    save(nodes.services["n1"], job, a)
    nodes.services["n1"].wait_idle()
    forged = forge(nodes, job, "n2", field(seed=9), gen=2)
    nodes.store.delete(nodes.keys.ckpt(job, 0, 1))  # the genuine shared record
    nodes.up.discard("n1")
    move(nodes, job, "n4")
    n4 = nodes.services["n4"]
    assert [r.generation for r in n4.trusted_records(job, 0)] == [1]
    result = n4.restore(job, 0)
    assert result is not None and result.generation == 1
    assert materialize(result.restored.manifest, result.restored.buffer).tobytes() == a.tobytes()
    assert result.restored.manifest.whole_digest != forged.whole_digest
    result.restored.close()
    # The spare's next generation is numbered after the genuine one, over the forged
    # record (which it overwrites), and commits.
    n4.wait_idle()
    rec, _ = save(n4, job, a * 2, epoch=2)
    assert rec.generation == 2 and rec.primary == "n4"
    assert record(nodes, job, 2).primary == "n4"


def test_a_node_commits_only_the_ranks_it_runs(nodes: Nodes) -> None:
    job = new_job(nodes)
    with pytest.raises(Fenced, match="runs on n1, not on n2"):
        save(nodes.services["n2"], job, field(20_000))
    assert nodes.store.get_prefix(nodes.keys.ckpt_prefix(job, 0)) == []


def test_a_node_the_rank_left_cannot_publish_a_newer_generation(nodes: Nodes) -> None:
    """Rank 0 ran on n1 at epoch 1 and moved to n4, which restored generation 1 and made
    it its own at epoch 2. Root on n1 then publishes a generation 7 at epoch 1 (n1 did
    run the rank then). When n4 dies too, n3 restores n4's epoch, never n1's late one."""
    job = new_job(nodes)
    a = field()
    save(nodes.services["n1"], job, a)
    nodes.services["n1"].wait_idle()
    nodes.up.discard("n1")
    move(nodes, job, "n4")
    first = nodes.services["n4"].restore(job, 0)
    assert first is not None and first.generation == 1
    first.restored.close()
    kv = nodes.store.get(nodes.keys.ckpt_commit("n4", job, 0, 1))
    assert kv is not None and CkptRecord.from_json(kv.key, kv.value).epoch == 2
    forge(nodes, job, "n1", field(seed=9), gen=7, epoch=1)
    nodes.up.discard("n4")
    move(nodes, job, "n3")
    n3 = nodes.services["n3"]
    assert [(r.generation, r.epoch) for r in restore_order(n3.trusted_records(job, 0))] == \
        [(1, 2), (7, 1)]
    result = n3.restore(job, 0)
    assert result is not None and result.generation == 1
    assert materialize(result.restored.manifest, result.restored.buffer).tobytes() == a.tobytes()
    result.restored.close()
