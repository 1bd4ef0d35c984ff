"""Every call of the mpi4py API that raps_slurm.mpi supports and the example programs do
not already use, in the usual mpi4py style; rank 0 prints one line per result. Run by
tests/unit/test_mpi_programs.py under Open MPI's mpirun and under RAPS: the outputs
must be equal (integer data only, so any MPI library prints the same)."""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    out: list[tuple[str, object]] = []
    t0 = MPI.Wtime()

    # Point-to-point: status, ANY_TAG, Get_count, probe, iprobe, sendrecv.
    comm.Send([np.arange(5, dtype=np.float64) + rank, MPI.DOUBLE], dest=right, tag=40 + rank)
    st = MPI.Status()
    comm.Probe(source=left, tag=MPI.ANY_TAG, status=st)
    got = np.zeros(8, dtype=np.float64)
    st2 = MPI.Status()
    comm.Recv([got, MPI.DOUBLE], source=st.Get_source(), tag=st.Get_tag(), status=st2)
    out.append(("Probe+Recv", comm.gather((st.Get_source(), st.Get_tag(), st.Get_count(MPI.DOUBLE),
                                           st2.Get_count(MPI.DOUBLE), got[:5].tolist()), root=0)))
    comm.send({"from": rank}, dest=right, tag=3)
    while not comm.iprobe(source=MPI.ANY_SOURCE, tag=3):
        time.sleep(0.0005)
    st3 = MPI.Status()
    comm.probe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st3)
    msg = comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st3)
    out.append(("iprobe+recv ANY", comm.gather((msg, st3.Get_source(), st3.Get_tag()), root=0)))
    back = comm.sendrecv(rank * 3, dest=right, sendtag=5, source=left, recvtag=5)
    out.append(("sendrecv", comm.gather(back, root=0)))
    comm.send(None, dest=MPI.PROC_NULL)
    out.append(("PROC_NULL recv", comm.recv(source=MPI.PROC_NULL)))

    # Requests: isend/irecv objects with waitall; buffers with Waitall, Test, Testall,
    # Waitany, Testany.
    reqs = [comm.irecv(source=left, tag=11), comm.isend(("obj", rank), dest=right, tag=11)]
    objs = MPI.Request.waitall(reqs)
    out.append(("isend/irecv waitall", comm.gather(objs[0], root=0)))
    a = np.zeros(3, dtype=np.int32)
    b = np.zeros(3, dtype=np.int32)
    rr = [comm.Irecv([a, MPI.INT], source=left, tag=12),
          comm.Irecv([b, MPI.INT], source=right, tag=13)]
    sr = [comm.Isend([np.full(3, rank, dtype=np.int32), MPI.INT], dest=right, tag=12),
          comm.Isend([np.full(3, -rank, dtype=np.int32), MPI.INT], dest=left, tag=13)]
    MPI.Request.Waitall(rr + sr)
    out.append(("Irecv/Isend Waitall", comm.gather((a.tolist(), b.tolist()), root=0)))
    c = np.zeros(2, dtype=np.int64)
    req = comm.Irecv(c, source=left, tag=14)
    comm.Isend(np.array([rank, rank * rank], dtype=np.int64), dest=right, tag=14).Wait()
    while not req.Test():
        time.sleep(0.0005)
    out.append(("Test", comm.gather(c.tolist(), root=0)))
    d = [np.zeros(1, dtype=np.int32) for _ in range(2)]
    rq = [comm.Irecv(d[0], source=left, tag=15), comm.Irecv(d[1], source=right, tag=16)]
    comm.Send(np.array([rank + 100], dtype=np.int32), dest=right, tag=15)
    comm.Send(np.array([rank + 200], dtype=np.int32), dest=left, tag=16)
    while not MPI.Request.Testall(rq):
        time.sleep(0.0005)
    out.append(("Testall", comm.gather([int(x[0]) for x in d], root=0)))
    e = [np.zeros(1, dtype=np.int32) for _ in range(2)]
    rq = [comm.Irecv(e[0], source=left, tag=17), comm.Irecv(e[1], source=right, tag=18)]
    comm.Send(np.array([rank + 300], dtype=np.int32), dest=right, tag=17)
    comm.Send(np.array([rank + 400], dtype=np.int32), dest=left, tag=18)
    seen = set()
    while len(seen) < 2:
        idx = MPI.Request.Waitany(rq)
        seen.add(idx)
    while True:  # all complete: Testany says so with UNDEFINED
        idx, flag = MPI.Request.Testany(rq)
        if flag:
            break
    out.append(("Waitany/Testany", comm.gather((sorted(seen), idx == MPI.UNDEFINED,
                                                [int(x[0]) for x in e]), root=0)))

    # Buffer collectives not in examples/mpi_collectives.py.
    ints = np.arange(4, dtype=np.int32) if rank == 0 else np.zeros(4, dtype=np.int32)
    comm.Bcast([ints, MPI.INT], root=0)
    out.append(("Bcast INT", ints.tolist()))
    flags = np.array([rank % 2, 1, 0], dtype=np.int32)
    land, lor = np.zeros(3, dtype=np.int32), np.zeros(3, dtype=np.int32)
    comm.Allreduce(flags, land, op=MPI.LAND)
    comm.Allreduce(flags, lor, op=MPI.LOR)
    bor = np.zeros(1, dtype=np.int64)
    comm.Allreduce(np.array([1 << rank], dtype=np.int64), bor, op=MPI.BOR)
    out.append(("LAND/LOR/BOR", (land.tolist(), lor.tolist(), bor.tolist())))
    mx = np.zeros(2, dtype=np.int64) if rank == 1 % size else None
    comm.Reduce(np.array([rank, -rank], dtype=np.int64), mx, op=MPI.MAX, root=1 % size)
    if rank == 1 % size:
        comm.send(mx.tolist() if mx is not None else None, dest=0, tag=19)
    if rank == 0:
        out.append(("Reduce MAX root 1", comm.recv(source=1 % size, tag=19)))
    g = np.full(size * 2, -1, dtype=np.int32)
    g[rank * 2:rank * 2 + 2] = rank + 1
    if rank == 0:
        comm.Gather(MPI.IN_PLACE, g, root=0)
        out.append(("Gather IN_PLACE", g.tolist()))
    else:
        comm.Gather(g[rank * 2:rank * 2 + 2], None, root=0)
    s = np.arange(size * 2, dtype=np.int32) * 7
    if rank == 0:
        comm.Scatter(s, MPI.IN_PLACE, root=0)
        mine = s[:2].copy()
    else:
        mine = np.zeros(2, dtype=np.int32)
        comm.Scatter(None, mine, root=0)
    out.append(("Scatter IN_PLACE", comm.gather(mine.tolist(), root=0)))
    t = np.array([rank * 10 + j for j in range(size)], dtype=np.int32)
    comm.Alltoall(MPI.IN_PLACE, t)
    out.append(("Alltoall IN_PLACE", comm.gather(t.tolist(), root=0)))
    ag = np.zeros(size, dtype=np.int32)
    comm.Allgather(np.array([rank * 5], dtype=np.int32), ag)
    out.append(("Allgather", ag.tolist()))

    # Communicators: Split with UNDEFINED, Dup, Free; collectives on them.
    sub = comm.Split(MPI.UNDEFINED if rank == 0 else 1, key=rank)
    info = None if sub == MPI.COMM_NULL else (sub.Get_rank(), sub.Get_size(),
                                             sub.allreduce(rank, op=MPI.SUM))
    out.append(("Split UNDEFINED", comm.gather(info, root=0)))
    if sub != MPI.COMM_NULL:
        sub.Free()
    dup = comm.Dup()
    dup.send(rank, dest=right, tag=1)
    comm.send(-rank, dest=right, tag=1)
    from_comm = comm.recv(source=left, tag=1)
    from_dup = dup.recv(source=left, tag=1)
    out.append(("Dup separates messages", comm.gather((from_comm, from_dup), root=0)))
    dup.barrier()
    dup.Free()
    comm.Barrier()
    out.append(("Wtime", isinstance(t0, float) and MPI.Wtime() >= t0))
    if rank == 0:
        for name, value in out:
            print(name, value, flush=True)
    MPI.Finalize()
    out.append(("Is_finalized", MPI.Is_finalized()))
    if rank == 0:
        print(*out[-1], flush=True)


def abort() -> None:
    """``abort``: rank 1 calls Abort(3) while the others wait for it: the job ends."""
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 1:
        comm.Abort(3)
    comm.recv(source=1)


if __name__ == "__main__":
    abort() if sys.argv[1:] == ["abort"] else main()
