"""Non-blocking collectives: ``Ibarrier``, ``Ibcast``, ``Ireduce``, ``Iallreduce``,
completed by ``Wait``, by ``Waitall``, by a ``Test`` loop that does other work
meanwhile, and some at a time by ``Waitany``, ``Testany``, ``Waitsome`` and
``Testsome`` beside a point-to-point receive (integer reductions: the same under any
order; the order in which those complete them is timing, so only the set is printed).
Rank 0 prints what every rank got. Run and crash it as common.py says.
"""

import numpy as np
from common import crash_knob, print_all
from mpi4py import MPI


def main() -> None:
    maybe_die = crash_knob()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    lines = []
    for step in range(4):
        maybe_die(rank, step)
        data = np.arange(5, dtype="l") * (rank + 1) + step
        total = np.zeros(5, dtype="l")
        top = np.zeros(5, dtype="l")
        b = np.arange(3, dtype="i") + 10 * step if rank == size - 1 else np.zeros(3, "i")
        reqs = [comm.Iallreduce(data, total, op=MPI.SUM),
                comm.Ireduce([data, MPI.LONG], [top, MPI.LONG] if rank == 0 else None,
                             op=MPI.MAX, root=0),
                comm.Ibcast(b, root=size - 1)]
        work = 0
        if step % 2:
            while not MPI.Request.Testall(reqs):
                work += 1          # the program's own work while they complete
        else:
            MPI.Request.Waitall(reqs)
        inplace = data.copy()
        comm.Iallreduce(MPI.IN_PLACE, inplace, op=MPI.BXOR).Wait()
        bar = comm.Ibarrier()
        while not bar.Test():
            work += 1
        lines.append(f"rank {rank} step {step}: {total.tolist()} "
                     f"{top.tolist() if rank == 0 else None} {b.tolist()} {inplace.tolist()} "
                     f"worked {work >= 0}")
        lines.append(f"rank {rank} step {step} one by one: {one_by_one(comm, step)}")
    print_all(comm, lines)


def one_by_one(comm, step):
    """Collectives and a ring's receive completed by ``Waitany``, a ``Testany`` loop,
    ``Waitsome`` or a ``Testsome`` loop (steps 0, 1, 2, 3)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    data = np.arange(4, dtype="l") * (rank + 2) - step
    total = np.zeros(4, dtype="l")
    halo = np.full(2, -1, dtype="l")
    b = np.full(2, rank + 100 * step, dtype="i")
    reqs = [comm.Irecv(halo, source=(rank - 1) % size, tag=step),
            comm.Iallreduce(data, total, op=MPI.SUM),
            comm.Ibcast(b, root=0),
            comm.Ibarrier()]
    comm.Send(data[:2], dest=(rank + 1) % size, tag=step)
    done = set()
    while len(done) < len(reqs):
        if step % 4 == 0:
            done.add(MPI.Request.Waitany(reqs))
        elif step % 4 == 1:
            i, flag = MPI.Request.Testany(reqs)
            if flag:
                done.add(i)
        elif step % 4 == 2:
            done.update(MPI.Request.Waitsome(reqs))
        else:
            done.update(MPI.Request.Testsome(reqs))
    # none active: Waitany says UNDEFINED, Waitsome None
    last = (MPI.Request.Waitany(reqs), MPI.Request.Waitsome(reqs))
    return (f"{sorted(done)} {last == (MPI.UNDEFINED, None)} {halo.tolist()} "
            f"{total.tolist()} {b.tolist()}")


if __name__ == "__main__":
    main()
