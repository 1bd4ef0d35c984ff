"""Derived datatypes: ``Create_contiguous``, ``Create_vector``, ``Create_indexed``,
``Create_hvector``, ``Create_hindexed``, ``Create_subarray``, ``Create_resized``,
``Commit``, ``Free``, ``Get_size``,
``Get_extent``, used in sends, receives and collectives (a matrix's columns, halo
faces of a 3-D block). Rank 0 prints what every rank got. Run and
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
    n = 4
    pair = MPI.DOUBLE.Create_contiguous(2).Commit()
    column = MPI.DOUBLE.Create_vector(n, 1, n).Commit()          # one column of n x n
    col_rs = column.Create_resized(0, 8).Commit()                 # columns one after another
    upper = MPI.INT.Create_indexed([3, 2, 1], [0, 4, 8]).Commit()  # upper triangle of 3x4
    face = MPI.DOUBLE.Create_subarray([3, 4, 5], [3, 1, 5], [0, 2, 0]).Commit()
    face_f = MPI.INT.Create_subarray([4, 3], [2, 2], [1, 1], order=MPI.ORDER_FORTRAN).Commit()
    _, dsize = MPI.DOUBLE.Get_extent()
    # a transpose as a type: rows (stride n) interleaved one double apart (hvector)
    xpose = MPI.DOUBLE.Create_vector(n, 1, n).Create_hvector(n, 1, dsize).Commit()
    corners = MPI.INT.Create_hindexed([1, 1], [0, 11 * 4]).Commit()
    lines = [f"sizes {[t.Get_size() for t in (pair, column, col_rs, upper, face, face_f)]}",
             f"extents {[t.Get_extent() for t in (pair, column, col_rs, upper, face, face_f)]}"]
    for step in range(3):
        maybe_die(rank, step)
        got = []
        m = (np.arange(n * n, dtype="d") + 100 * rank + step).reshape(n, n)
        r = np.full((n, n), -1.0)
        comm.Sendrecv([m, 1, column], right, 1, [r.reshape(-1)[2:], 1, column], left, 1)
        got.append(r)
        r = np.full(6, -1.0)
        comm.Sendrecv([m, 3, pair], right, 2, [r, 3, pair], left, 2)
        got.append(r)
        t = np.full(12, -1, dtype="i")
        comm.Sendrecv([np.arange(12, dtype="i") + rank, 1, upper], right, 3,
                      [t, 1, upper], left, 3)
        got.append(t)
        b = (np.arange(60, dtype="d") + 1000 * rank + step).reshape(3, 4, 5)
        r3 = np.full((3, 4, 5), -1.0)
        comm.Sendrecv([b, 1, face], right, 4, [r3, 1, face], left, 4)
        got.append(r3[:, 2, :])
        f = np.full(12, -1, dtype="i")
        comm.Sendrecv([np.arange(12, dtype="i") * (rank + 1), 1, face_f], right, 5,
                      [f, 1, face_f], left, 5)
        got.append(f)
        cols = np.full((n, size), -1.0)
        mine = np.array([rank * 10.0 + i + step for i in range(n)])
        # every rank's vector lands in column ``rank`` of an n x size matrix
        colsz = MPI.DOUBLE.Create_vector(n, 1, size).Create_resized(0, 8).Commit()
        comm.Allgather([mine, n, MPI.DOUBLE], [cols, 1, colsz])
        colsz.Free()
        got.append(cols)
        g = np.full((n, n), -1.0)
        comm.Bcast([g if rank else m, 2, col_rs], root=0)
        got.append(g if rank else m[:, :2])
        fm = np.asfortranarray(m)  # a Fortran-ordered buffer: its memory, in order
        tr = np.full((n, n), -1.0, order="F")
        comm.Sendrecv([fm, 1, xpose], right, 6, [tr, MPI.DOUBLE], left, 6)
        got.append(tr)
        cc = np.full(12, -1, dtype="i")
        comm.Sendrecv([np.arange(12, dtype="i") * (step + 2), 1, corners], right, 7,
                      [cc, 1, corners], left, 7)
        got.append(cc)
        lines.extend(f"rank {rank} step {step} got {i}: {a.tolist()}" for i, a in enumerate(got))
    for t in (pair, column, col_rs, upper, face, face_f, xpose, corners):
        t.Free()
    print_all(comm, lines)


if __name__ == "__main__":
    main()
