"""Persistent requests and completion of many: ``Send_init``, ``Recv_init``, ``Start``,
``Startall``, ``Waitall``, ``Waitsome``, ``Testsome``, ``Waitany`` on a ring exchange
repeated with the same requests. Rank 0 prints what every rank got (the order requests
complete in is up to MPI: the program prints what it received, sorted by source).
Run and crash it as common.py says.
"""

import numpy as np
from common import crash_knob, print_all
from mpi4py import MPI


def main() -> None:
    maybe_die = crash_knob()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    out = np.zeros(4, dtype="d")
    back = np.zeros(4, dtype="d")
    fwd = np.zeros(4, dtype="d")
    reqs = [comm.Send_init([out, MPI.DOUBLE], right, tag=1),
            comm.Send_init(out, left, tag=2),
            comm.Recv_init([fwd, MPI.DOUBLE], left, tag=1),
            comm.Recv_init(back, right, tag=2)]
    lines = []
    for step in range(4):
        maybe_die(rank, step)
        out[:] = np.arange(4) + 10 * rank + step   # read by each Start
        if step % 2 == 0:
            MPI.Prequest.Startall(reqs)
            MPI.Request.Waitall(reqs)
        else:
            for r in reqs:
                r.Start()
            done = set()
            while len(done) < 4:
                idx = MPI.Request.Waitsome(reqs) if step == 1 else MPI.Request.Testsome(reqs)
                done.update(idx or [])
        lines.append(f"rank {rank} step {step}: from left {fwd.tolist()} "
                     f"from right {back.tolist()}")
    for r in reqs:
        r.Free()
    # non-persistent receives from every other rank, completed by Waitany then Waitsome
    bufs = {src: np.zeros(2, dtype="i") for src in range(size) if src != rank}
    recvs = [comm.Irecv(bufs[src], src, tag=3) for src in sorted(bufs)]
    for dst in range(size):
        if dst != rank:
            comm.Send(np.array([rank, dst], dtype="i"), dst, tag=3)
    first = MPI.Request.Waitany(recvs)
    rest = MPI.Request.Waitall(recvs)
    lines.append(f"rank {rank}: any {first >= 0} all {rest} "
                 f"{[bufs[s].tolist() for s in sorted(bufs)]}")
    print_all(comm, lines)


if __name__ == "__main__":
    main()
