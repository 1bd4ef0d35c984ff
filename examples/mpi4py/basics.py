"""The world and point-to-point calls the other programs leave out: a program that
starts MPI itself (``mpi4py.rc.initialize = False``, ``Init_thread``), thread queries,
``COMM_SELF``, names, ``Sendrecv_replace``, ``REQUEST_NULL`` among requests, object
requests, buffered sends with an attached buffer, and the bitwise and logical
reductions. Rank 0 prints what every rank got.
Run and crash it as common.py says.
"""

import mpi4py

mpi4py.rc.initialize = False  # this program starts MPI itself

import numpy as np  # noqa: E402
from common import crash_knob, print_all  # noqa: E402
from mpi4py import MPI  # noqa: E402


def main() -> None:
    maybe_die = crash_knob()
    before = MPI.Is_initialized()
    provided = MPI.Init_thread(MPI.THREAD_SERIALIZED)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    lines = [f"rank {rank}: started {before} {MPI.Is_initialized()} "
             f"threads {provided >= MPI.THREAD_SERIALIZED} "
             f"{MPI.Query_thread() >= MPI.THREAD_SERIALIZED} {MPI.Is_thread_main()} "
             f"version {MPI.Get_version()[0] >= 3} {isinstance(MPI.Get_processor_name(), str)} "
             f"{0 < MPI.Wtick() < 1}",
             f"rank {rank}: self {MPI.COMM_SELF.Get_size()} {MPI.COMM_SELF.Get_rank()} "
             f"{MPI.COMM_SELF.allreduce(rank + 5)}"]
    attached = np.empty(1024 + MPI.BSEND_OVERHEAD, dtype="b")
    MPI.Attach_buffer(attached)
    name = comm.Get_name()
    comm.Set_name("numbers")
    lines.append(f"rank {rank}: names {name} {comm.Get_name()}")
    for step in range(3):
        maybe_die(rank, step)
        buf = np.arange(4, dtype="i") + 10 * rank + step
        comm.Sendrecv_replace(buf, right, 1, left, 1)
        odd = comm.allreduce(rank % 2 == 1, op=MPI.LXOR)
        band = comm.allreduce(rank + step + 7, op=MPI.BAND)
        bx = np.array([rank + step, 1 << rank], dtype="i")
        comm.Allreduce(MPI.IN_PLACE, bx, op=MPI.BXOR)
        reqs = [MPI.REQUEST_NULL, comm.irecv(source=left, tag=2),
                comm.isend({"step": step, "from": rank}, right, tag=2)]
        got = MPI.Request.waitall(reqs)
        flag = comm.Iprobe(source=MPI.ANY_SOURCE, tag=99)  # nothing is ever sent on 99
        sent = comm.Isend(buf, right, tag=3)
        sent.Free()
        back = np.zeros(4, dtype="i")
        comm.Recv(back, left, tag=3)
        comm.Bsend(buf, right, tag=4)
        comm.bsend(step, right, tag=5)
        comm.Recv(back, left, tag=4)
        lines.append(f"rank {rank} step {step}: bsend {back.tolist()} {comm.recv(None, left, 5)}")
        lines.append(f"rank {rank} step {step}: {buf.tolist()} {odd} {band} {bx.tolist()} "
                     f"{got[1]} {got[0]} {flag} {back.tolist()}")
    lines.append(f"rank {rank}: detached {MPI.Detach_buffer() is attached}")
    print_all(comm, lines)
    MPI.Finalize()


if __name__ == "__main__":
    main()
