"""Buffer specifications, every form mpi4py reads: a buffer alone, ``[buf, type]``,
``[buf, count, type]``, ``[buf, (count, displ), type]``, ``[buf, count, displ, type]``,
typecode strings (``'d'``, ``'i'``, ``'B'``), ``MPI.IN_PLACE``, ``None`` where the
buffer is not used, and explicit counts in collectives (per process). Rank 0 prints what
every rank got. Run and
crash it as common.py says.
"""

import numpy as np
from common import crash_knob, print_all
from mpi4py import MPI


def main() -> None:
    maybe_die = crash_knob()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    lines = []
    for step in range(3):
        maybe_die(rank, step)
        a = np.arange(8, dtype="d") + 10 * rank + step
        got = []
        r = np.zeros(8)
        comm.Sendrecv(a, right, 1, r, left, 1)
        got.append(r)
        r = np.zeros(8)
        comm.Sendrecv([a, MPI.DOUBLE], right, 2, [r, "d"], left, 2)
        got.append(r)
        r = np.full(8, -1.0)
        comm.Sendrecv([a, 3, MPI.DOUBLE], right, 3, [r, (3, 2), MPI.DOUBLE], left, 3)
        got.append(r)
        r = np.full(8, -1.0)
        comm.Sendrecv([a, 2, 4, "d"], right, 4, [r, 2, 5, MPI.DOUBLE], left, 4)
        got.append(r)
        raw = bytearray(16)
        st = MPI.Status()
        comm.Sendrecv([a, 16, "B"], right, 5, [raw, "B"], left, 5, status=st)
        got.append(np.frombuffer(raw, dtype="d"))
        lines.append(f"p2p count {st.Get_count(MPI.BYTE)} {st.Get_count(MPI.DOUBLE)}")

        one = bytearray(size)
        one[rank] = 65 + rank + step
        comm.Allgather(MPI.IN_PLACE, [one, 1, MPI.BYTE])
        lines.append(f"allgather in place {one.decode()}")
        g = np.full(2 * size + 3, -1, dtype="i")
        comm.Gather([np.array([rank, step, 99], "i"), 2, MPI.INT],
                    [g, 2, MPI.INT] if rank == 0 else None, root=0)
        got.append(g)
        g2 = np.full(size, -1, dtype="i")
        g2[rank] = 7 * rank + step
        comm.Gather(MPI.IN_PLACE if rank == 1 else g2[rank:rank + 1], [g2, MPI.INT], root=1)
        got.append(g2)
        s = np.arange(3 * size + 1, dtype="i") * (step + 1)
        r = np.full(4, -1, dtype="i")
        comm.Scatter([s, 3, MPI.INT], [r, 3, MPI.INT], root=2 % size)
        got.append(r)
        s2 = np.arange(size, dtype="l") + 100 * step
        mine = s2[:1].copy()
        comm.Scatter(s2 if rank == 0 else None, MPI.IN_PLACE if rank == 0 else mine, root=0)
        got.append(s2 if rank == 0 else mine)
        t = np.arange(size, dtype="i") + 10 * rank
        comm.Alltoall(MPI.IN_PLACE, [t, 1, MPI.INT])
        got.append(t)
        t2 = np.full(2 * size, -1, dtype="i")
        comm.Alltoall([np.arange(2 * size, dtype="i") * (rank + 1), 2, "i"], [t2, 2, "i"])
        got.append(t2)
        bc = np.full(5, rank, dtype="i")
        comm.Bcast([bc, 3, MPI.INT], root=1)
        got.append(bc)
        red = np.arange(4, dtype="d") * (rank + 1)
        comm.Reduce(MPI.IN_PLACE if rank == 0 else red, [red, "d"] if rank == 0 else None,
                    root=0)
        got.append(red)
        al = np.arange(6, dtype="i") + rank
        comm.Allreduce(MPI.IN_PLACE, [al, 4, "i"], op=MPI.MAX)
        got.append(al)
        lines.extend(f"rank {rank} step {step} got {i}: {x.tolist()}" for i, x in enumerate(got))
    print_all(comm, lines)


if __name__ == "__main__":
    main()
