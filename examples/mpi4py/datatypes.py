"""Derived datatypes: ``Create_contiguous``, ``Create_vector``, ``Create_indexed``,
``Create_hvector``, ``Create_hindexed``, ``Create_subarray``, ``Create_resized``,
``Create_struct``, ``Commit``, ``Free``, ``Get_size``,
``Get_extent``, used in sends, receives and collectives (a matrix's columns, halo
faces of a 3-D block, records of a numpy structured dtype). Rank 0 prints what every
rank got. Run and crash it as common.py says.
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
        lines.extend(structs(comm, step))
    for t in (pair, column, col_rs, upper, face, face_f, xpose, corners):
        t.Free()
    print_all(comm, lines)


# a particle as C lays it out: {char kind; double x[3]; int id; char tag[3];} (40 bytes)
PART = np.dtype([("kind", "i1"), ("x", "f8", 3), ("id", "i4"), ("tag", "i1", 3)], align=True)


def structs(comm, step):
    """Records of a structured dtype moved whole, some of their fields only, and
    gathered, with types made by Create_struct (one of them nesting a derived type)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    displs = [PART.fields[f][1] for f in PART.names]
    part = MPI.Datatype.Create_struct([1, 3, 1, 3], displs,
                                      [MPI.CHAR, MPI.DOUBLE, MPI.INT, MPI.CHAR]).Commit()
    # x and id only: the receiver's kind and tag stay as they were
    xid = MPI.Datatype.Create_struct([3, 1], displs[1:3], [MPI.DOUBLE, MPI.INT])
    xid_r = xid.Create_resized(0, PART.itemsize).Commit()
    # a struct of a derived type and a base type: two ints 8 bytes apart, then a short
    pair = MPI.INT.Create_vector(2, 1, 2).Commit()
    mixed = MPI.Datatype.Create_struct([1, 1], [0, 16], [pair, MPI.SHORT]).Commit()
    lines = [f"struct sizes {[t.Get_size() for t in (part, xid, xid_r, mixed)]} "
             f"extents {[t.Get_extent() for t in (part, xid, xid_r, mixed)]}"] if not step else []
    mine = np.zeros(3, dtype=PART)
    for i, p in enumerate(mine):
        p["kind"], p["x"], p["id"] = rank + i, [rank + step, i * 0.5, -i], 100 * rank + i
        p["tag"] = [rank, step, i]
    got = []
    r = np.full(3, -1, dtype=PART)
    comm.Sendrecv([mine, 3, part], right, 8, [r, 3, part], left, 8)
    got.append(r)
    r = np.full(3, -1, dtype=PART)
    comm.Sendrecv([mine, 3, xid_r], right, 9, [r, 3, xid_r], left, 9)
    got.append(r)
    b = mine.copy() if rank == 1 % size else np.full(3, -1, dtype=PART)
    comm.Bcast([b, 2, part], root=1 % size)
    got.append(b)
    every = np.full(size, -1, dtype=PART)
    comm.Allgather([mine[step:step + 1], 1, part], [every, 1, part])
    got.append(every)
    at_root = np.full(size, -1, dtype=PART) if rank == 0 else None
    comm.Gather([mine[1:2], 1, xid_r], [at_root, 1, xid_r], root=0)
    if rank == 0:
        got.append(at_root)
    ints = np.full(6, -1, dtype="i")
    comm.Sendrecv([np.arange(6, dtype="i") + 10 * rank + step, 1, mixed], right, 10,
                  [ints, 1, mixed], left, 10)
    got.append(ints)
    for t in (part, xid, xid_r, pair, mixed):
        t.Free()
    return lines + [f"rank {rank} step {step} struct {i}: {records(a)}"
                    for i, a in enumerate(got)]


def records(a):
    """Plain lists (numpy's printing of a record's array fields varies by version)."""
    if a.dtype.names is None:
        return a.tolist()
    return [[p[f].tolist() for f in a.dtype.names] for p in a]


if __name__ == "__main__":
    main()
