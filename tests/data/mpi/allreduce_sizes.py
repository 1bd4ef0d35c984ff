"""``Allreduce`` over counts that do and do not split evenly among the ranks (fewer
elements than ranks included), with exact operations only (integer sums, maxima, bitwise
or, MAXLOC), plain and IN_PLACE: the same lines under any MPI. Rank 0 prints.

    mpirun -n 4 python tests/data/mpi/allreduce_sizes.py
    python -m raps_slurm.runtime.local -n 4 --mpi4py -- python tests/data/mpi/allreduce_sizes.py

``--die RANK:I`` makes RANK exit (code 17) before the I-th count in its first epoch: the
relaunched rank re-executes from the start, its peers' logs replay what they sent.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import numpy as np
from mpi4py import MPI


def _digest(a: np.ndarray) -> str:
    """The array's bytes, in short: equal only if every element is."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--die", default=None, help="RANK:I")
    a = p.parse_args()
    die_rank, die_at = (int(x) for x in a.die.split(":")) if a.die else (-1, -1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rng = np.random.default_rng(77 + rank)
    lines = []
    for i, count in enumerate((1, 3, 4, 5, 7, 1001, 65537)):
        if rank == die_rank and i == die_at and os.environ.get("RAPS_EPOCH", "1") == "1":
            os._exit(17)
        a = rng.integers(-1000, 1000, count).astype(np.int64)
        s = np.empty_like(a)
        comm.Allreduce([a, MPI.INT64_T], [s, MPI.INT64_T], op=MPI.SUM)
        f = rng.standard_normal(count)
        m = np.empty_like(f)
        comm.Allreduce(f, m, op=MPI.MAX)
        b = rng.integers(0, 1 << 30, count).astype(np.int32)
        comm.Allreduce(MPI.IN_PLACE, [b, MPI.INT], op=MPI.BOR)
        pairs = np.zeros(count, dtype=np.dtype([("v", np.float64), ("i", np.int32)],
                                               align=True))
        pairs["v"], pairs["i"] = rng.integers(0, 5, count).astype(np.float64), rank
        best = np.zeros_like(pairs)
        comm.Allreduce([pairs, MPI.DOUBLE_INT], [best, MPI.DOUBLE_INT], op=MPI.MAXLOC)
        lines.append(f"count {count} sum {_digest(s)} max {_digest(m)} bor {_digest(b)} "
                     f"maxloc {_digest(best['v'])} {_digest(best['i'])}")
    if rank == 0:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
