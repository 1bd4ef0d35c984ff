"""A 1-D heat stencil in the usual mpi4py style: the rod is split into one block per
rank; each step every rank swaps its edge cells with both neighbours through
``Sendrecv`` on numpy buffers (``MPI.PROC_NULL`` at the rod's ends) and updates its
block. Every ``--every`` steps ``Allreduce`` gives the total heat: the order of its sum
is MPI's, so another MPI library may print it rounded otherwise (the line says
``rounded``). At the end rank 0 gathers the rod and prints its checksum: every value of
the rod is computed in a fixed order, so any MPI library prints the same bits.

Under RAPS it checkpoints its block every ``--every`` steps (``restore`` and
``checkpoint``, absent under plain mpi4py), and ``--die RANK:STEP`` makes RANK exit at
that step in its first epoch (to watch it relaunched: ``--restarts 1``).

    mpirun -n 4 python examples/mpi_stencil.py
    python -m raps_slurm.runtime.local -n 4 --restarts 1 --mpi4py -- \\
        python examples/mpi_stencil.py --die 2:130
"""

from __future__ import annotations

import argparse
import hashlib
import os

import numpy as np
from mpi4py import MPI

try:  # the checkpoint API (absent under plain mpi4py)
    from raps_slurm import mpi as raps
except ImportError:
    raps = None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cells", type=int, default=64, help="cells per rank")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--die", default=None, help="RANK:STEP")
    a = p.parse_args()
    die_rank, die_at = (int(x) for x in a.die.split(":")) if a.die else (-1, -1)
    first_epoch = os.environ.get("RAPS_EPOCH", "1") == "1"
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    left = rank - 1 if rank > 0 else MPI.PROC_NULL
    right = rank + 1 if rank < size - 1 else MPI.PROC_NULL
    n = a.cells
    st = raps.restore() if raps else None
    if st is None:
        u = np.zeros(n + 2, dtype=np.float64)  # one ghost cell at each end
        x = (np.arange(n) + rank * n) / (n * size)
        # a polynomial, not np.sin: numpy versions round sin differently, and the rod's
        # bits must not depend on which numpy the MPI library's Python has
        u[1:-1] = 4.0 * x * (1.0 - x) + (x > 0.4) * (x < 0.6)
        st = {"step": 0, "u": u, "heat": []}
    u = st["u"]
    while st["step"] < a.steps:
        step = st["step"]
        if rank == die_rank and step == die_at and first_epoch:
            os._exit(17)
        comm.Sendrecv([u[1:2], MPI.DOUBLE], dest=left, sendtag=1,
                      recvbuf=[u[-1:], MPI.DOUBLE], source=right, recvtag=1)
        comm.Sendrecv([u[-2:-1], MPI.DOUBLE], dest=right, sendtag=2,
                      recvbuf=[u[0:1], MPI.DOUBLE], source=left, recvtag=2)
        if left == MPI.PROC_NULL:
            u[0] = 0.0
        if right == MPI.PROC_NULL:
            u[-1] = 0.0
        u[1:-1] = u[1:-1] + 0.25 * (u[:-2] - 2.0 * u[1:-1] + u[2:])
        st["step"] = step + 1
        if st["step"] % a.every == 0:
            heat = np.array([u[1:-1].sum()])
            total = np.zeros(1)
            comm.Allreduce([heat, MPI.DOUBLE], [total, MPI.DOUBLE], op=MPI.SUM)
            st["heat"].append(float(total[0]))
            if raps:
                raps.checkpoint(st)
    rod = np.empty(n * size, dtype=np.float64) if rank == 0 else None
    comm.Gather([np.ascontiguousarray(u[1:-1]), MPI.DOUBLE], rod, root=0)
    if rank == 0:
        assert rod is not None
        print("rounded heat", *(repr(h) for h in st["heat"]), flush=True)
        print("rod", hashlib.sha256(rod.tobytes()).hexdigest()[:16],
              "max", repr(float(rod.max())), flush=True)


if __name__ == "__main__":
    main()
