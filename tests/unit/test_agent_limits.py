"""What a user can make the agent hold: restores allocate only the non-zero state, and a
uid's restores, log reads and appends are bounded in number and memory."""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from raps_slurm.agent.ckpt_api import CheckpointOps
from raps_slurm.agent.local_api import LocalApiServer, RankInfo, RankTable
from raps_slurm.agent.msg_api import LOG_PIECE, copy_log
from raps_slurm.agent.uid_limits import LOG, RESTORE, UidLimits
from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.logstore import LogStore
from raps_slurm.checkpoint.service import CheckpointService
from raps_slurm.checkpoint.sparse import allocated_bytes, layout
from raps_slurm.config import Config
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry
from raps_slurm.errors import Refused
from raps_slurm.runtime.agent_client import AgentError
from raps_slurm.runtime.checkpoint import CheckpointClient
from raps_slurm.store import Keys, MemoryStore
from raps_slurm.testing.jobs import damage_chunks

USER = 1000
MIB = 1 << 20


class Agent:
    """One agent's checkpoint ops on a unix socket, with the given per-uid limits."""

    def __init__(self, tmp: Path, limits: UidLimits) -> None:
        self.store, self.keys = MemoryStore(), Keys("/raps/v1/")
        self.store.put(self.keys.job("5"), JobRecord("5", 0, USER, ("n1", "n2"),
                                                     JobSpec(spares=0)).to_json())
        self.store.put(self.keys.job_rank("5", 0), RankEntry(0, "n1", 1, "running", ()).to_json())
        self.root = tmp / "store"
        self.service = CheckpointService(Config(), self.store, self.keys, "n1",
                                         secrets.token_bytes(32), ChunkStore(self.root),
                                         peers=lambda: {})
        self.table = RankTable()
        now = time.monotonic()
        self.table.register(RankInfo("5", 0, 1, os.getpid(), USER, now, now))
        self.sock = tmp / "agent.sock"
        self.limits = limits
        self.api = LocalApiServer(self.sock, "n1", owner_of=lambda job: USER,
                                  valid_for=lambda: 10.0, table=self.table,
                                  extensions=CheckpointOps(self.service, self.table,
                                                           limits=limits).extensions())
        self.api.peer_uid_override = USER
        self.api.start()

    def client(self) -> CheckpointClient:
        return CheckpointClient(self.sock, "5", 0, 1, timeout=30)

    def stored_bytes(self) -> int:
        """What the job's checkpoints take on disk."""
        return sum(p.stat().st_blocks * 512 for p in self.root.rglob("*") if p.is_file())

    def raw_restore(self) -> tuple[dict[str, object], list[int]]:
        """The reply and descriptors of a ``ckpt_restore``, as the rank gets them."""
        c = self.client()
        try:
            return c._call({"op": "ckpt_restore", "job": "5", "rank": 0})
        finally:
            c.close()

    def close(self) -> None:
        self.api.stop()
        self.store.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(tmp_path, UidLimits(1, 4, memory_bytes=8 * MIB))
    yield a
    a.close()


def test_a_huge_zero_state_costs_the_agent_only_what_is_stored(agent: Agent) -> None:
    """256 MiB of zeros is a few KiB on disk; its restore must not make the agent (root,
    its own cgroup) allocate 256 MiB. The memory file handed over holds only what is not
    zero, well within the uid's 8 MiB share, and still reads back as the state."""
    c = agent.client()
    zeros = np.zeros(256 * MIB, dtype=np.uint8)  # untouched pages: nothing allocated here
    c.save({"z": zeros, "tag": b"v1"})
    stored = agent.stored_bytes()
    assert stored < MIB
    reply, fds = agent.raw_restore()
    try:
        assert reply["ok"] is True and reply["size"] == 256 * MIB + 2, reply
        data_fd = fds[0]
        assert allocated_bytes(data_fd) <= stored + 2 * os.sysconf("SC_PAGE_SIZE"), (
            allocated_bytes(data_fd), stored)
    finally:
        for fd in fds:
            os.close(fd)
    loaded = c.restore()
    assert loaded is not None and isinstance(loaded.state, dict)
    assert loaded.state["tag"] == b"v1" and not np.any(loaded.state["z"])
    c.close()


def test_the_non_zero_part_is_allocated_charged_and_restored(agent: Agent) -> None:
    """A state with zeros and data: the data is allocated (and charged), the zeros are
    not; every byte comes back."""
    rng = np.random.default_rng(3)
    data = rng.integers(0, 255, 2 * MIB, dtype=np.uint8)
    state = np.concatenate([np.zeros(64 * MIB, np.uint8), data, np.zeros(64 * MIB, np.uint8)])
    c = agent.client()
    c.save(state)
    reply, fds = agent.raw_restore()
    try:
        assert reply["ok"] is True
        held = allocated_bytes(fds[0])
        assert data.nbytes <= held < data.nbytes + 4 * MIB, held
    finally:
        for fd in fds:
            os.close(fd)
    loaded = c.restore()
    assert loaded is not None and np.array_equal(loaded.state, state)
    assert agent.limits.held(USER) == 0  # released with the op
    c.close()


def test_a_restore_over_the_uid_memory_share_is_refused(agent: Agent) -> None:
    """12 MiB of data against an 8 MiB share: refused with kind ``quota`` before the
    memory file is allocated; root (the agent, the admins) is not charged."""
    c = agent.client()
    c.save(np.random.default_rng(4).integers(0, 255, 12 * MIB, dtype=np.uint8))
    with pytest.raises(AgentError, match=r"agent\.uid_memory_percent") as e:
        c.restore()
    assert e.value.kind == "quota"
    assert agent.limits.held(USER) == 0
    c.close()
    agent.api.peer_uid_override = 0
    root = agent.client()
    loaded = root.restore()
    assert loaded is not None and loaded.state.nbytes == 12 * MIB  # type: ignore[union-attr]
    root.close()


def test_a_fallback_is_charged_at_the_peak_not_again(agent: Agent) -> None:
    """The newest generation is damaged here: the restore falls back to the previous
    one. The memory of the one given up is freed first, so the fallback fits in the same
    8 MiB share that two 5 MiB states together would pass."""
    rng = np.random.default_rng(5)
    first, second = (rng.integers(0, 255, 5 * MIB, dtype=np.uint8) for _ in range(2))
    c = agent.client()
    s1 = c.save(first)
    held = set(agent.service.chunks.chunks("5"))
    c.save(second)
    assert damage_chunks(agent.service.chunks, "5",
                         set(agent.service.chunks.chunks("5")) - held) > 0
    loaded = c.restore()
    assert loaded is not None and loaded.generation == s1.generation
    assert [f["generation"] for f in loaded.fallbacks] == [s1.generation + 1]
    assert np.array_equal(loaded.state, first)
    c.close()


def test_layout_takes_only_repeated_zero_chunks_for_zeros() -> None:
    """A chunk name that comes with two sizes is never taken for zeros; a single zero
    chunk is read like any other."""
    from raps_slurm.checkpoint.manifest import Manifest
    from raps_slurm.checkpoint.sparse import zero_digest

    def manifest(chunks: list[tuple[str, int]]) -> Manifest:
        m = Manifest.__new__(Manifest)
        object.__setattr__(m, "chunks", tuple(chunks))
        object.__setattr__(m, "digest_algo", "blake3")
        return m

    z = zero_digest("blake3", 4096)
    other = "ab" * 32
    assert layout(manifest([(other, 10), (z, 4096), (z, 4096), (other, 10)])).ranges == (
        (0, 10), (8202, 10))
    assert layout(manifest([(z, 4096), (other, 10)])).nonzero_bytes == 4106
    assert layout(manifest([(z, 4096), (z, 4096), (z, 100)])).nonzero_bytes == 8292


def test_a_uids_ops_wait_their_turn_and_too_many_are_refused() -> None:
    limits = UidLimits(1, 2, memory_bytes=MIB, queue=1, wait_s=5.0)
    entered = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def first() -> None:
        with limits.op(RESTORE, USER, "ckpt_restore"):
            entered.set()
            release.wait(5)
            order.append("first")

    def second() -> None:
        with limits.op(RESTORE, USER, "ckpt_restore"):
            order.append("second")

    t1 = threading.Thread(target=first)
    t1.start()
    assert entered.wait(5)
    t2 = threading.Thread(target=second)
    t2.start()
    deadline = time.monotonic() + 5
    while limits._waiting.get((USER, RESTORE)) != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(Refused, match=r"agent\.uid_restores_at_once") as e, \
            limits.op(RESTORE, USER, "ckpt_restore"):
        pass  # a third: one runs, one waits, the queue of one is full
    assert e.value.kind == "busy"
    with limits.op(RESTORE, USER + 1, "ckpt_restore"):  # another uid is not held up
        pass
    with limits.op(LOG, USER, "log_read"), limits.op(RESTORE, 0, "ckpt_restore"):
        pass  # another kind, and root, neither
    release.set()
    t1.join(5)
    t2.join(5)
    assert order == ["first", "second"]


def test_a_wait_longer_than_allowed_is_refused() -> None:
    limits = UidLimits(1, 1, memory_bytes=MIB, wait_s=0.2)
    with limits.op(LOG, USER, "log_read"), pytest.raises(Refused, match="waited") as e, \
            limits.op(LOG, USER, "log_append"):
        pass
    assert e.value.kind == "busy"


def test_memory_charges_add_up_per_uid_and_end_with_the_op() -> None:
    limits = UidLimits(2, 2, memory_bytes=MIB)
    with limits.op(LOG, USER, "log_read") as a, limits.op(LOG, USER, "log_append") as b:
        a(MIB // 2)
        with pytest.raises(Refused, match="above its 1048576") as e:
            b(MIB // 2 + 1)
        assert e.value.kind == "quota"
        b(MIB // 2)
        assert limits.held(USER) == MIB
        with limits.op(LOG, USER + 1, "log_read") as other:
            other(MIB)  # a share per uid
    assert limits.held(USER) == limits.held(USER + 1) == 0


def test_uid_limits_from_config() -> None:
    cfg = Config().agent
    limits = UidLimits.from_config(cfg, node_memory=64 << 30)
    assert limits.at_once == {RESTORE: cfg.uid_restores_at_once, LOG: cfg.uid_log_ops_at_once}
    assert limits.memory_bytes == int((64 << 30) * cfg.uid_memory_percent / 100)


def test_log_read_copies_the_log_in_pieces_after_charging_it(tmp_path: Path) -> None:
    """The reply's memory file holds exactly what the store reads back; a log larger
    than the uid's share is refused before anything is copied."""
    logs = LogStore(tmp_path)
    for n in range(3):
        logs.append("5", 0, bytes([n + 1]) * (LOG_PIECE + 1000 * n), check=False)
    whole = logs.read("5", 0)
    limits = UidLimits(1, 1, memory_bytes=len(whole))
    with limits.op(LOG, USER, "log_read") as charge:
        fd, size = copy_log(logs, "5", 0, charge)
        try:
            assert size == len(whole) and os.pread(fd, size + 1, 0) == whole
            assert limits.held(USER) == len(whole)
        finally:
            os.close(fd)
    limits = UidLimits(1, 1, memory_bytes=len(whole) - 1)
    with limits.op(LOG, USER, "log_read") as charge, pytest.raises(Refused) as e:
        copy_log(logs, "5", 0, charge)
    assert e.value.kind == "quota"
