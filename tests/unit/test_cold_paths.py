"""Cold copies follow no link and enter no directory someone else owns: shared storage
may be written by others, who must not steer where the agent (root) writes or reads."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from raps_slurm.checkpoint import cold
from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.checkpoint.manifest import Manifest
from raps_slurm.checkpoint.pack import PackWriter, iter_records
from raps_slurm.checkpoint.writer import encode_state

JOB, OTHER = "7", 1000


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[tuple[ChunkStore, Manifest]]:
    """One generation in a node's store."""
    chunks = ChunkStore(tmp_path / "n1")

    def sink(pack: PackWriter) -> None:
        chunks.put_many(JOB, [(e.digest, e.raw_size, e.payload)
                              for e in iter_records(pack.fd)])

    m, _ = encode_state(np.arange(10_000, dtype=np.int64), job=JOB, rank=0, epoch=1,
                        params=CodecParams(avg_chunk_kb=16), previous=None, sink=sink)
    yield chunks, m.with_generation(1)


def test_a_copy_is_written_and_read_back_under_the_agents_own_dirs(
        tmp_path: Path, saved: tuple[ChunkStore, Manifest]) -> None:
    chunks, m = saved
    directory = cold.cold_path(str(tmp_path / "cold"), JOB, 0)
    assert cold.write_copy(chunks, m, directory)
    assert not cold.write_copy(chunks, m, directory)  # already there
    assert cold.generations(directory) == [1]
    for d in (tmp_path / "cold", directory.parent, directory):
        st = d.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o700)
    assert cold.generations(cold.cold_path(str(tmp_path / "cold"), JOB, 1)) == []


@pytest.mark.parametrize("level", ["job", "rank"])
def test_a_planted_link_is_not_followed(tmp_path: Path, saved: tuple[ChunkStore, Manifest],
                                       level: str) -> None:
    """Someone who can write the shared dir plants a link where the job's or the rank's
    directory goes: the copy is refused, nothing lands where it points, and a restore's
    listing refuses it too."""
    chunks, m = saved
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    directory = cold.cold_path(str(tmp_path / "cold"), JOB, 0)
    if level == "job":
        (tmp_path / "cold").mkdir(mode=0o700)
        directory.parent.symlink_to(target)
    else:
        directory.parent.mkdir(mode=0o700, parents=True)
        directory.symlink_to(target)
    with pytest.raises(cold.ColdCopyError, match="link is not followed"):
        cold.write_copy(chunks, m, directory)
    with pytest.raises(cold.ColdCopyError, match="link is not followed"):
        cold.generations(directory)
    assert list(target.iterdir()) == []


def test_the_cold_dir_itself_as_a_link_is_refused(tmp_path: Path,
                                                  saved: tuple[ChunkStore, Manifest]) -> None:
    chunks, m = saved
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "cold").symlink_to(target)
    with pytest.raises(cold.ColdCopyError, match="link is not followed"):
        cold.write_copy(chunks, m, cold.cold_path(str(tmp_path / "cold"), JOB, 0))
    assert list(target.iterdir()) == []


def test_someone_elses_directory_is_refused(tmp_path: Path,
                                            saved: tuple[ChunkStore, Manifest]) -> None:
    # CI runs as root (scripts/test.sh needs it): fail, not skip, where it cannot chown
    assert os.geteuid() == 0, "needs root to hand a directory to another uid"
    chunks, m = saved
    directory = cold.cold_path(str(tmp_path / "cold"), JOB, 0)
    directory.mkdir(mode=0o700, parents=True)
    os.chown(directory.parent, OTHER, OTHER)
    with pytest.raises(cold.ColdCopyError, match=f"it is uid {OTHER}"):
        cold.write_copy(chunks, m, directory)


def test_a_cold_dir_anyone_may_write_is_refused_unless_sticky(
        tmp_path: Path, saved: tuple[ChunkStore, Manifest]) -> None:
    chunks, m = saved
    top = tmp_path / "cold"
    top.mkdir()
    top.chmod(0o777)
    directory = cold.cold_path(str(top), JOB, 0)
    with pytest.raises(cold.ColdCopyError, match="mode 777"):
        cold.write_copy(chunks, m, directory)
    top.chmod(0o1777)  # as /tmp: others cannot rename or remove what the agent made
    assert cold.write_copy(chunks, m, directory)
