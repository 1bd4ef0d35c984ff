"""The replication lane copies each rank's newest generation once per pass.

A rank that checkpoints faster than its copies go (8 ranks of 128 MiB on one node) would
otherwise have every generation wait behind older ones and stay under-replicated for ever;
and a rank whose newer generation is always queued before the lane reaches it must still
get its copy.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from pathlib import Path

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.restore_parts import Once
from raps_slurm.checkpoint.service import CheckpointService
from raps_slurm.config import Config
from raps_slurm.core.checkpoints import CkptRecord, expired_records
from raps_slurm.store import Keys, MemoryStore


def drain(svc: CheckpointService) -> None:
    """Run the queued copies in order, as the background worker would."""
    while True:
        try:
            item = svc._queue.get_nowait()
        except queue.Empty:
            return
        assert item is not None
        item()
        svc._queue.task_done()


def service(root: Path, copied: list[tuple[str, int, int]]) -> CheckpointService:
    svc = CheckpointService(Config(), MemoryStore(), Keys(), "n1", secrets.token_bytes(32),
                            ChunkStore(root), peers=dict)

    def replicate(job: str, rank: int, gen: int) -> None:
        copied.append((job, rank, gen))
    svc.replicate = replicate  # type: ignore[method-assign,assignment]
    return svc


def test_only_the_newest_queued_generation_of_a_rank_is_copied(tmp_path: Path) -> None:
    copied: list[tuple[str, int, int]] = []
    svc = service(tmp_path, copied)
    for gen in (1, 2, 3):
        svc._later("7", 0, gen)
    svc._later("7", 1, 1)  # another rank's generation is not affected
    drain(svc)
    assert copied == [("7", 0, 3), ("7", 1, 1)]
    assert svc.skipped_copies == 2


def test_a_generation_queued_after_the_copy_ran_is_copied_too(tmp_path: Path) -> None:
    copied: list[tuple[str, int, int]] = []
    svc = service(tmp_path, copied)
    svc._later("7", 0, 1)
    drain(svc)
    svc._later("7", 0, 2)
    svc._later("7", 0, 2)  # a repair pass finding it short again queues nothing more
    drain(svc)
    assert copied == [("7", 0, 1), ("7", 0, 2)]
    assert svc.skipped_copies == 0


def test_a_rank_that_always_checkpoints_again_before_its_copy_is_still_copied(
        tmp_path: Path) -> None:
    """Eight ranks whose next generation is always queued while the lane copies another
    rank's: each rank still gets one copy per pass of the lane, its newest."""
    copied: list[tuple[str, int, int]] = []
    svc = service(tmp_path, copied)
    gens = dict.fromkeys(range(8), 1)
    for r in range(8):
        svc._later("7", r, 1)

    def replicate(job: str, rank: int, gen: int) -> None:
        copied.append((job, rank, gen))
        for r in range(8):  # every rank checkpoints again while this copy runs
            gens[r] += 1
            svc._later(job, r, gens[r])
    svc.replicate = replicate  # type: ignore[method-assign,assignment]
    for _ in range(40):
        item = svc._queue.get_nowait()
        assert item is not None
        item()
        svc._queue.task_done()
    first_pass = copied[:8]
    assert sorted(r for _, r, _ in first_pass) == list(range(8))
    # each copy is of the newest generation its rank had when the lane reached it
    assert [g for _, _, g in first_pass] == list(range(1, 9))
    assert {r for _, r, _ in copied[8:16]} == set(range(8))


def record(gen: int, state: str = "under_replicated", primary: str = "n1",
           cold: bool = False) -> CkptRecord:
    return CkptRecord(0, gen, 1, "d", 10, 10, 1, "w", primary, (primary,), 2, state, 0.0,
                      cold=cold)


def test_the_newest_whole_generation_keeps_its_record_behind_newer_uncopied_ones() -> None:
    """A rank that commits faster than its copies go: the primary must not delete the
    record of the last generation its group holds, or a crash leaves nothing to restore."""
    records = [record(1, "committed"), record(2, "committed"), *map(record, range(3, 9))]
    assert expired_records(records, 5, "n1") == [3, 1]
    # once a newer generation is whole, the older whole one goes like any other
    records[7] = record(8, "committed")
    assert expired_records(records, 5, "n1") == [3, 2, 1]


def test_only_the_primary_deletes_and_the_newest_cold_record_stays() -> None:
    records = [record(1, cold=True), record(2, primary="n2"), *map(record, range(3, 9))]
    assert expired_records(records, 5, "n1") == [3]
    assert expired_records(records, 5, "n2") == [2]



def test_pulled_chunks_are_stored_after_the_nodes_other_restores(tmp_path: Path) -> None:
    """Storing a restore's pulled chunks waits while another restore runs on the node:
    the CPU it takes is what the ranks still waiting for their state would lose."""
    svc = service(tmp_path, [])
    running, release = threading.Event(), threading.Event()

    def slow_restore(job: str, rank: int, *charge: object) -> None:
        running.set()
        release.wait(10)
    svc._restore = slow_restore  # type: ignore[method-assign,assignment]
    restore = threading.Thread(target=svc.restore, args=("7", 1))
    restore.start()
    assert running.wait(10)
    waited = threading.Thread(target=svc._after_restores)
    waited.start()
    waited.join(0.3)
    assert waited.is_alive()  # held back while the restore runs
    release.set()
    restore.join(10)
    waited.join(10)
    assert not waited.is_alive() and svc._waiting_restores == 0
    t0 = time.monotonic()
    svc._after_restores()  # none running: no wait
    assert time.monotonic() - t0 < 0.5


def test_a_restored_ranks_pulled_chunks_are_stored_before_its_next_save(
        tmp_path: Path) -> None:
    """Storing the pulled chunks waits for the node's other restores, unless the rank
    saves first: then its save stores them (its base), and the queued store is a no-op."""
    svc = service(tmp_path, [])
    stored: list[str] = []
    svc._keep_later("7", 3, Once(lambda: stored.append("kept")))
    svc._waiting_restores = 1  # another rank of the node still restoring
    sid, _ = svc.begin("7", 3, 2, None)
    assert stored == ["kept"]
    svc.abort(sid)
    svc._waiting_restores = 0
    drain(svc)
    assert stored == ["kept"] and svc._keeps == {}
    # not saved first: stored by the lane, once
    svc._keep_later("7", 4, Once(lambda: stored.append("lane")))
    drain(svc)
    svc.begin("7", 4, 2, None)
    assert stored == ["kept", "lane"]
