"""The plumbing every collective of :mod:`raps_slurm.mpi` runs on: messages on a
communicator's collective context (``id + 1``: a program's point-to-point messages never
match them) with named sources, the binomial broadcast and reduction trees, and
``IN_PLACE``. None of it takes a timing-dependent decision, and the order of every
reduction is fixed by the communicator's size alone.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from raps_slurm.mpi.comm import Comm
from raps_slurm.mpi.engine import RAW, Recv
from raps_slurm.mpi.types import Op


class _InPlace:
    def __repr__(self) -> str:
        return "IN_PLACE"


IN_PLACE: Any = _InPlace()
# a collective's schedule: yields each receive it waits for, is sent the message's bytes
Schedule = Generator[Recv, bytes | memoryview, Any]
T_BCAST, T_REDUCE, T_GATHER, T_SCATTER, T_ALLTOALL, T_ALLREDUCE, T_SCAN = 1, 2, 3, 4, 5, 6, 7


def in_place(spec: Any) -> bool:
    """Whether a send buffer means ``IN_PLACE`` (mpi4py reads None so too)."""
    return spec is None or spec is IN_PLACE


def dumps(obj: Any) -> bytes:
    """An object as a collective sends it."""
    return pickle.dumps(obj, protocol=5)


def view(a: np.ndarray[Any, Any]) -> memoryview:
    """The bytes of an array, not copied when contiguous (a send copies them)."""
    return np.ascontiguousarray(a).data.cast("B")


class TreeComm(Comm):
    """Collective messages and the two trees (the base of ``Intracomm``). Each tree is a
    schedule that the blocking calls run to the end at once and the non-blocking ones
    step by step."""

    def _csend(self, dst: int, data: bytes | memoryview, tag: int) -> None:
        w = self._w
        w.engine.send(self._world_rank(dst, "rank"), self._ctx_id + 1, tag, RAW, data)

    def _crecv(self, src: int, tag: int) -> bytes | memoryview:
        w = self._w
        r = w.engine.post(self._ctx_id + 1, self._world_rank(src, "rank"), tag)
        return w.engine.wait(r).data

    def _enter(self, call: str, root: int = 0) -> tuple[int, int]:
        self._w.check_may_communicate(call)
        n = self.Get_size()
        if not 0 <= root < n:
            raise ValueError(f"{call}: root {root}: expected a rank in 0..{n - 1}")
        return self.Get_rank(), n

    def _post_c(self, src: int, tag: int) -> Recv:
        return self._w.engine.post(self._ctx_id + 1, self._world_rank(src, "rank"), tag)

    def _run(self, schedule: Schedule) -> Any:
        """Run a schedule to its end, waiting at each receive."""
        eng = self._w.engine
        try:
            r = next(schedule)
            while True:
                r = schedule.send(eng.wait(r).data)
        except StopIteration as stop:
            return stop.value

    def _bcast_bytes(self, data: bytes | memoryview | None, root: int
                     ) -> bytes | memoryview:
        """Binomial-tree broadcast of bytes from ``root``."""
        return self._run(self._bcast_steps(data, root, T_BCAST))  # type: ignore[no-any-return]

    def _reduce_tree(self, value: Any, combine: Callable[[Any, Any], Any],
                     pack: Callable[[Any], bytes | memoryview],
                     unpack: Callable[[bytes | memoryview], Any], root: int) -> Any:
        """Binomial-tree reduction to ``root``; the result at the root, None elsewhere."""
        return self._run(self._reduce_steps(value, combine, pack, unpack, root, T_REDUCE))

    def _binomial(self, root: int) -> tuple[int | None, list[int]]:
        """This rank's parent (None at the root) and children (nearest first) in the
        binomial tree rooted at ``root``."""
        me, n = self.Get_rank(), self.Get_size()
        vr = (me - root) % n
        children: list[int] = []
        mask = 1
        while mask < n:
            if vr & mask:
                return (vr - mask + root) % n, children
            if vr + mask < n:
                children.append((vr + mask + root) % n)
            mask <<= 1
        return None, children

    def _bcast_steps(self, data: bytes | memoryview | None, root: int, tag: int
                     ) -> Schedule:
        """The broadcast's schedule (farthest child first): it yields each receive it
        waits for."""
        parent, children = self._binomial(root)
        if parent is not None:
            data = yield self._post_c(parent, tag)
        assert data is not None
        for child in reversed(children):
            self._csend(child, data, tag)
        return data

    def _reduce_steps(self, value: Any, combine: Callable[[Any, Any], Any],
                      pack: Callable[[Any], bytes | memoryview],
                      unpack: Callable[[bytes | memoryview], Any], root: int, tag: int
                      ) -> Schedule:
        """The reduction's schedule (``own op child``, nearest child first); the result
        at the root, None elsewhere."""
        parent, children = self._binomial(root)
        for child in children:
            value = combine(value, unpack((yield self._post_c(child, tag))))
        if parent is not None:
            self._csend(parent, pack(value), tag)
            return None
        return value

    def _array_steps(self, mine: np.ndarray[Any, Any], op: Op, root: int, tag: int
                     ) -> Schedule:
        """The reduction of arrays (``mine`` is the caller's own copy, combined into)."""
        def combine(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            op.apply_into(a, b, a)  # ``a`` is this call's own copy
            return a
        return self._reduce_steps(mine, combine, view,
                                  lambda d: np.frombuffer(d, dtype=mine.dtype), root, tag)
