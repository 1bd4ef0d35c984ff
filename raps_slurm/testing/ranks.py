"""Ranks of a local job inside the test process, for tests of the runtime on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.runtime.context import Context, Settings
from raps_slurm.runtime.ports import LocalPort

PARAMS = CodecParams(avg_chunk_kb=4)  # small chunks: small test states still split


@contextmanager
def local_pair(root: Path, settings: Settings, port0: LocalPort | None = None
               ) -> Iterator[tuple[Context, Context]]:
    """Ranks 0 and 1 of local job "1" under ``root`` (rank 0 on ``port0`` if given),
    closed afterwards. Sends never wait, so one thread can drive both."""
    a = Context(port0 or LocalPort(root, "1", 0, 1, PARAMS), 0, 2, 1, settings)
    b = Context(LocalPort(root, "1", 1, 1, PARAMS), 1, 2, 1, settings)
    try:
        yield a, b
    finally:
        for c in (a, b):
            c.close()
