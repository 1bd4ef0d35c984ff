"""The program ``rapsctl bench mpi`` times, the same file under Open MPI and under RAPS:
it imports nothing but ``from mpi4py import MPI`` and numpy, so it runs unchanged with
``mpirun ... python3 mpi_prog.py`` and with the local launcher's ``--mpi4py``.

``pingpong`` (2 ranks): rank 0 sends a float64 buffer with ``Send`` and rank 1 sends it
back, for 8 bytes, 4 KiB, 1 MiB and 8 MiB. ``allreduce`` (any number of ranks): ``Allreduce``
with ``SUM`` of 8 MiB of float64. Each measure runs ``--warmup`` untimed iterations, then
``--repeats`` timed blocks of ``--iterations`` (a barrier before and after each block;
the 8-byte and 4 KiB ping-pongs run ``--latency-factor`` times as many round trips); rank 0 prints
one line ``RESULT {json}`` with the seconds of every block.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI  # type: ignore[import-not-found]  # the venv has only the shim

MIB = 1 << 20
PINGPONG_BYTES = (8, 4096, MIB, 8 * MIB)
SMALL = 64 << 10  # a ping-pong below this runs latency_factor times the iterations
ALLREDUCE_BYTES = 8 * MIB


def _blocks(comm: Any, body: Any, iterations: int, warmup: int, repeats: int) -> list[float]:
    """Seconds of each timed block of ``iterations`` calls of ``body``."""
    for _ in range(warmup):
        body()
    out = []
    for _ in range(repeats):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(iterations):
            body()
        comm.Barrier()
        out.append(time.perf_counter() - t)
    return out


def _round_trip(comm: Any, buf: Any) -> Callable[[], None]:
    """One round trip of ``buf``: rank 0 sends first, rank 1 answers, others idle."""
    rank = comm.Get_rank()

    def ping() -> None:
        comm.Send([buf, MPI.DOUBLE], dest=1, tag=1)
        comm.Recv([buf, MPI.DOUBLE], source=1, tag=2)

    def pong() -> None:
        comm.Recv([buf, MPI.DOUBLE], source=0, tag=1)
        comm.Send([buf, MPI.DOUBLE], dest=0, tag=2)

    return ping if rank == 0 else pong if rank == 1 else lambda: None


def pingpong(comm: Any, iterations: int, warmup: int, repeats: int, latency_factor: int,
             sizes: tuple[int, ...] = PINGPONG_BYTES) -> dict[str, Any]:
    """Round trips between ranks 0 and 1 (other ranks only join the barriers) for each of
    ``sizes`` (multiples of 8 bytes); those below 64 KiB ``latency_factor`` times as many."""
    result: dict[str, Any] = {}
    for nbytes in sizes:
        buf = np.arange(nbytes // 8, dtype=np.float64)
        n = iterations * latency_factor if nbytes < SMALL else iterations
        secs = _blocks(comm, _round_trip(comm, buf), n, warmup, repeats)
        if comm.Get_rank() < 2 and buf[-1] != buf.size - 1:
            raise RuntimeError(f"ping-pong of {nbytes} bytes came back changed")
        result[str(nbytes)] = {"round_trips": n, "seconds": secs}
    return result


def allreduce(comm: Any, iterations: int, warmup: int, repeats: int) -> dict[str, Any]:
    """``Allreduce(SUM)`` of 8 MiB of float64 on every rank of ``comm``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    send = np.full(ALLREDUCE_BYTES // 8, float(rank + 1))
    recv = np.empty_like(send)

    def body() -> None:
        comm.Allreduce([send, MPI.DOUBLE], [recv, MPI.DOUBLE], op=MPI.SUM)

    secs = _blocks(comm, body, iterations, warmup, repeats)
    want = size * (size + 1) / 2
    if recv[0] != want or recv[-1] != want:
        raise RuntimeError(f"allreduce gave {recv[0]}, expected {want}")
    return {str(ALLREDUCE_BYTES): {"ranks": size, "calls": iterations, "seconds": secs}}


def main(argv: list[str] | None = None) -> None:
    """Run one measure and print rank 0's ``RESULT`` line."""
    p = argparse.ArgumentParser()
    p.add_argument("measure", choices=["pingpong", "allreduce"])
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-factor", type=int, default=100)
    p.add_argument("--sizes", default=",".join(map(str, PINGPONG_BYTES)),
                   help="ping-pong sizes in bytes, comma-separated multiples of 8")
    a = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    if a.measure == "pingpong":
        sizes = tuple(int(x) for x in a.sizes.split(","))
        result = pingpong(comm, a.iterations, a.warmup, a.repeats, a.latency_factor, sizes)
    else:
        result = allreduce(comm, a.iterations, a.warmup, a.repeats)
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"measure": a.measure, "results": result}), flush=True)


if __name__ == "__main__":
    main()
