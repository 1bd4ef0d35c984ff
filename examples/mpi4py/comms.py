"""Communicators as mpi4py programs build them: ``MPI.Intracomm(comm)``, a subclass of
``MPI.Intracomm`` made with ``super().__new__(cls, comm)`` (mpi4py's way to add methods),
``Get_attr`` (``TAG_UB``, ``IO``, ``WTIME_IS_GLOBAL``, ``APPNUM``), ``MPI.Comm.Compare``,
``Get_group`` and groups (``Incl``, ``Excl``, ``Translate_ranks``, ``Compare``), ``Dup``
and ``Split``. Rank 0 prints what every rank got. Run and
crash it as common.py says.
"""

import mpi4py

mpi4py.rc(initialize=False)  # MPI.Init below

from common import crash_knob, print_all  # noqa: E402
from mpi4py import MPI  # noqa: E402


class Comm(MPI.Intracomm):
    """A communicator with one method more, as mpi4py's documentation shows."""

    def __new__(cls, comm=None):
        return super().__new__(cls, comm)

    def ring_sum(self, value):
        """Each rank's value passed round the ring, summed."""
        total, carry = value, value
        for _ in range(self.Get_size() - 1):
            carry = self.sendrecv(carry, (self.rank + 1) % self.size,
                                  source=(self.rank - 1) % self.size)
            total += carry
        return total


def main() -> None:
    maybe_die = crash_knob()
    MPI.Init()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    comm = Comm(world)
    same = MPI.Intracomm(world)
    dup = world.Dup()
    rev = world.Split(0, size - rank)
    half = world.Split(rank % 2, rank)
    lines = [f"rank {rank}: {type(comm).__name__} {isinstance(comm, MPI.Intracomm)} "
             f"{comm.Get_rank()} {comm.Get_size()}",
             f"rank {rank}: attrs {world.Get_attr(MPI.TAG_UB) >= 32767} "
             f"{world.Get_attr(MPI.IO)} {world.Get_attr(MPI.WTIME_IS_GLOBAL)} "
             f"{world.Get_attr(MPI.APPNUM)}",
             f"rank {rank}: compare {MPI.Comm.Compare(world, same) == MPI.IDENT} "
             f"{MPI.Comm.Compare(world, comm) == MPI.IDENT} "
             f"{MPI.Comm.Compare(world, dup) == MPI.CONGRUENT} "
             f"{MPI.Comm.Compare(world, rev) == (MPI.SIMILAR if size > 1 else MPI.CONGRUENT)} "
             f"{MPI.Comm.Compare(world, half) == (MPI.UNEQUAL if size > 1 else MPI.CONGRUENT)}"]
    group = world.Get_group()
    evens = group.Incl(list(range(0, size, 2)))
    odds = group.Excl(list(range(0, size, 2)))
    lines.append(f"rank {rank}: groups {group.Get_size()} {group.Get_rank()} "
                 f"{evens.Get_size()} {evens.Get_rank()} {odds.Get_size()} {odds.Get_rank()} "
                 f"{MPI.Group.Translate_ranks(evens, list(range(evens.Get_size())), group)} "
                 f"{MPI.Group.Compare(group, half.Get_group())} "
                 f"{MPI.Group.Compare(group, world.Get_group())}")
    for g in (group, evens, odds):
        g.Free()
    for step in range(3):
        maybe_die(rank, step)
        lines.append(f"rank {rank} step {step}: {comm.ring_sum(rank + step)} "
                     f"{rev.allgather(rank)} {half.allreduce(rank + step)} "
                     f"{dup.bcast(step * 7 if rank == 0 else None)}")
    for c in (dup, rev, half):
        c.Free()
    print_all(world, lines)
    MPI.Finalize()


if __name__ == "__main__":
    main()
