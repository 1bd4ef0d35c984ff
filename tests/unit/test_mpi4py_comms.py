"""Communicator handles and groups as mpi4py builds them, without starting a world
(examples/mpi4py/comms.py checks the rest against Open MPI)."""

from __future__ import annotations

import pytest

from raps_slurm.mpi import MPI


class Sub(MPI.Intracomm):
    def __new__(cls, comm: MPI.Comm | None = None) -> Sub:
        return super().__new__(cls, comm)  # type: ignore[return-value]

    def twice(self) -> int:
        return 2 * self._ctx_id


def test_handles_of_one_communicator_are_equal_and_a_null_handle_is_comm_null() -> None:
    w = MPI.COMM_WORLD
    same, sub = MPI.Intracomm(w), Sub(w)
    assert same == w and sub == w and hash(sub) == hash(w) and sub.twice() == 0
    assert isinstance(sub, MPI.Intracomm) and sub is not w
    assert MPI.Intracomm() == MPI.COMM_NULL and MPI.COMM_NULL.__eq__(MPI.Intracomm())
    assert not MPI.Intracomm() and w != MPI.COMM_NULL and w != MPI.COMM_SELF
    assert MPI.Comm.Compare(w, sub) == MPI.IDENT
    with pytest.raises(TypeError, match="expected a communicator, got int"):
        MPI.Intracomm(3)  # type: ignore[arg-type]


def test_groups() -> None:
    g = MPI.Group([10, 11, 12, 13])
    evens = g.Incl([0, 2])
    assert evens.Get_size() == 2 and g.Excl([0, 2]).Translate_ranks_to([0, 1], g) == [1, 3]
    assert MPI.Group.Translate_ranks(evens, [0, 1], g) == [0, 2]
    assert MPI.Group.Translate_ranks(g, [1], evens) == [MPI.UNDEFINED]
    assert MPI.Group.Compare(g, MPI.Group([10, 11, 12, 13])) == MPI.IDENT
    assert MPI.Group.Compare(g, MPI.Group([13, 12, 11, 10])) == MPI.SIMILAR
    assert MPI.Group.Compare(g, evens) == MPI.UNEQUAL
    with pytest.raises(ValueError, match=r"rank 4: expected 0\.\.3"):
        g.Incl([4])
