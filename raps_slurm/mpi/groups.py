"""Groups of :mod:`raps_slurm.mpi` (``Comm.Get_group``): world ranks in order, and the
comparison results communicators share."""

from __future__ import annotations

from typing import Any

from raps_slurm.mpi.requests import UNDEFINED
from raps_slurm.mpi.types import Namespace, unsupported
from raps_slurm.mpi.world import world

IDENT, CONGRUENT, SIMILAR, UNEQUAL = 0, 1, 2, 3


class Group(metaclass=Namespace):
    """A group: world ranks in order (``Comm.Get_group``)."""

    def __init__(self, ranks: list[int] | None = None) -> None:
        self._ranks = list(ranks or [])

    def Get_size(self) -> int:
        """Number of ranks."""
        return len(self._ranks)

    def Get_rank(self) -> int:
        """This process's rank in the group (UNDEFINED if not in it)."""
        me = world().rank
        return self._ranks.index(me) if me in self._ranks else UNDEFINED

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self.Get_size()

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.Get_rank()

    def Incl(self, ranks: list[int]) -> Group:
        """The ranks listed, in that order."""
        return Group([self._ranks[self._check(r)] for r in ranks])

    def Excl(self, ranks: list[int]) -> Group:
        """All but the ranks listed."""
        drop = {self._check(r) for r in ranks}
        return Group([w for i, w in enumerate(self._ranks) if i not in drop])

    def _check(self, r: int) -> int:
        if not 0 <= r < len(self._ranks):
            raise ValueError(f"MPI.Group: rank {r}: expected 0..{len(self._ranks) - 1}")
        return r

    @staticmethod
    def Translate_ranks(group1: Group, ranks1: list[int] | None, group2: Group
                        ) -> list[int]:
        """The rank in ``group2`` of each of ``ranks1`` in ``group1`` (UNDEFINED if
        absent)."""
        picked = group1._ranks if ranks1 is None else [group1._ranks[group1._check(r)]
                                                        for r in ranks1]
        return [group2._ranks.index(w) if w in group2._ranks else UNDEFINED for w in picked]

    def Translate_ranks_to(self, ranks: list[int], other: Group) -> list[int]:
        """``Translate_ranks(self, ranks, other)``."""
        return Group.Translate_ranks(self, ranks, other)

    @staticmethod
    def compare_ranks(a: list[int], b: list[int], same: int) -> int:
        """``same`` for the same ranks in order, SIMILAR in another order, else UNEQUAL."""
        if a == b:
            return same
        return SIMILAR if sorted(a) == sorted(b) else UNEQUAL

    @staticmethod
    def Compare(group1: Group, group2: Group) -> int:
        """``IDENT`` (same ranks, same order), ``SIMILAR`` or ``UNEQUAL``."""
        return Group.compare_ranks(group1._ranks, group2._ranks, IDENT)

    def Free(self) -> None:
        """Nothing to release."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported(f"MPI.Group.{name}")
