"""Buffer specifications as mpi4py reads them (its ``message_simple`` and
``message_vector``), for every call of :mod:`raps_slurm.mpi` that takes a buffer.

A specification is a buffer (a numpy array, ``bytes``, ``bytearray``, ``memoryview``)
or a list/tuple: ``[buf, type]``, ``[buf, count]``, ``[buf, (count, displ)]``,
``[buf, count, type]``, ``[buf, (count, displ), type]``, ``[buf, count, displ, type]``;
``type`` is a Datatype or a typecode string (``'d'``, ``'i'``, ``'B'``). ``displ`` and
``count`` are in elements of the type (its extent). Without a count, the buffer's
length after ``displ`` gives it; a collective that splits the buffer into ``blocks``
(one per process) divides it by ``blocks``. An explicit count in a collective is the
count per process, as in mpi4py. Vector specifications (``Gatherv`` ...) are
``[buf, counts, displs, type]`` and its shorter forms (:func:`as_vector`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from raps_slurm.mpi.types import BYTE, Datatype, MPIException, as_datatype, datatype_of


def _is_spec_type(x: Any) -> bool:
    return isinstance(x, Datatype | str)


def _is_count(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


@dataclass
class Buffer:
    """``count`` elements of ``datatype`` starting at ``flat[0]``; ``flat`` is the rest
    of the buffer, viewed as the datatype's base type (one predefined type)."""

    flat: np.ndarray[Any, Any]
    datatype: Datatype
    count: int

    @property
    def nbytes(self) -> int:
        """Bytes of data (packed)."""
        return self.count * self.datatype.size

    def _index(self) -> np.ndarray[Any, Any]:
        t = self.datatype
        idx = (np.arange(self.count, dtype=np.int64)[:, None] * t.units + t.offsets[None, :])
        return idx.reshape(-1)

    @property
    def array(self) -> np.ndarray[Any, Any]:
        """The elements' base values, packed: a view when the type is contiguous."""
        if self.datatype.contiguous:
            return self.flat[:self.count * self.datatype.offsets.size]
        out: np.ndarray[Any, Any] = self.flat[self._index()]
        return out

    def raw(self) -> memoryview:
        """The packed bytes (a view of the buffer when the type is contiguous)."""
        if self.datatype.contiguous and self.count * self.datatype.units == self.flat.size:
            return self.flat.data.cast("B")  # all of it: no slicing on the way
        return memoryview(np.ascontiguousarray(self.array).data).cast("B")

    def put(self, data: bytes | memoryview, call: str) -> None:
        """Unpack ``data`` (at most ``nbytes``) into the buffer."""
        if len(data) > self.nbytes:
            raise MPIException(f"{call}: message truncated: {len(data)} bytes into a "
                                   f"buffer of {self.nbytes}")
        if self.datatype.contiguous:
            self.raw()[:len(data)] = data
            return
        vals = np.frombuffer(data, dtype=self.flat.dtype)
        self.flat[self._index()[:vals.size]] = vals

    def sub(self, start: int, count: int, call: str) -> Buffer:
        """``count`` elements from element ``start`` (in extents of the type)."""
        t = self.datatype
        off = start * t.units
        if start < 0 or count < 0 or (count and off + (count - 1) * t.units + t.last
                                      >= self.flat.size):
            raise ValueError(f"{call}: {count} {t.name} elements at element {start} exceed "
                             f"the buffer ({self.flat.size * self.flat.itemsize} bytes)")
        return Buffer(self.flat[off:], t, count)


def _base_view(buf: Any, datatype: Datatype | None, what: str, readonly: bool
               ) -> tuple[np.ndarray[Any, Any], Datatype]:
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except TypeError:
            raise TypeError(f"{what}: {type(buf).__name__} is not a buffer (a numpy array, "
                            "bytes, bytearray or memoryview)") from None
    if arr.flags.c_contiguous:
        flat = arr.reshape(-1)
    elif arr.flags.f_contiguous:  # its memory in order, as mpi4py takes it
        flat = arr.reshape(-1, order="F")
    else:
        raise TypeError(f"{what}: the array is not contiguous")
    if not readonly and not arr.flags.writeable:
        raise BufferError(f"{what}: the receive buffer is not writable")
    if datatype is None:
        datatype = datatype_of(flat.dtype)
    base = datatype.base.dtype
    if flat.dtype != base:
        raw = flat.view(np.uint8)
        if raw.size % base.itemsize:
            raise ValueError(f"{what}: {raw.size} bytes is not a whole number of "
                             f"{datatype.base.name} elements")
        flat = raw.view(base)
    return flat, datatype


def _unpack(spec: Any, what: str) -> tuple[Any, Any, Any, Any]:
    """(buf, count, displ, type) of a specification, as mpi4py unpacks it."""
    if not isinstance(spec, list | tuple):
        return spec, None, None, None
    n = len(spec)
    if n == 2:
        buf, count = spec
        if _is_spec_type(count):
            return buf, None, None, count
        if isinstance(count, tuple | list):
            return buf, count[0], count[1], None
        return buf, count, None, None
    if n == 3:
        buf, count, dtype = spec
        if isinstance(count, tuple | list):
            return buf, count[0], count[1], dtype
        return buf, count, None, dtype
    if n == 4:
        return spec[0], spec[1], spec[2], spec[3]
    raise ValueError(f"{what}: a buffer specification has 2 to 4 items ([buf, type], "
                     f"[buf, count, type], [buf, (count, displ), type], [buf, count, displ, "
                     f"type]), got {n}")


def as_buffer(spec: Any, what: str = "buffer", blocks: int = 0, readonly: bool = True
              ) -> Buffer:
    """The buffer a specification names. ``blocks`` >= 2: the buffer holds one block per
    process and the count (given or inferred) is per block."""
    if blocks < 2 and type(spec) is list and len(spec) == 2:
        # The common ``[array, MPI.DOUBLE]`` of a point-to-point call, in a few checks:
        # the general path costs microseconds a call, as much as a small message's send.
        buf, t = spec
        if (type(buf) is np.ndarray and type(t) is Datatype and t.base is t
                and t.contiguous and not t.freed and buf.dtype is t.dtype and buf.flags.c_contiguous
                and (readonly or buf.flags.writeable)):
            return Buffer(buf if buf.ndim == 1 else buf.reshape(-1), t, buf.size)
    buf, count, displ, dtype = _unpack(spec, what)
    datatype = as_datatype(dtype, what) if dtype is not None else None
    if buf is None:
        if count:
            raise ValueError(f"{what}: the buffer is None but the count is {count}")
        t = datatype or BYTE
        return Buffer(np.zeros(0, dtype=t.base.dtype), t, 0)
    flat, datatype = _base_view(buf, datatype, what, readonly)
    units = max(datatype.units, 1)
    if displ is not None:
        if not _is_count(displ) or displ < 0:
            raise ValueError(f"{what}: displacement {displ!r}: expected an integer >= 0")
        if displ * units > flat.size:
            raise ValueError(f"{what}: displacement {displ} is past the buffer's "
                             f"{flat.size // units} elements")
        flat = flat[int(displ) * units:]
    if count is not None:
        if not _is_count(count) or count < 0:
            raise ValueError(f"{what}: count {count!r}: expected an integer >= 0")
        n = int(count)
    else:
        if flat.size % units:
            raise ValueError(f"{what}: a buffer of {flat.size * flat.itemsize} bytes is "
                             f"not a whole number of {datatype.name} elements "
                             f"(extent {datatype.extent})")
        n = flat.size // units
        if blocks >= 2:
            if n % blocks:
                raise ValueError(f"{what}: {n} elements do not split into {blocks} equal "
                                 "blocks (give the count per process: [buf, count, type])")
            n //= blocks
    b = Buffer(flat, datatype, n)
    if n:
        b.sub(0, n * max(blocks, 1), what)  # every block fits in the buffer
    return b


@dataclass
class Vector:
    """A vector collective's buffer: block ``i`` is ``counts[i]`` elements at element
    ``displs[i]``."""

    buf: Buffer
    counts: list[int]
    displs: list[int]

    def block(self, i: int, call: str) -> Buffer:
        """Block ``i``."""
        return self.buf.sub(self.displs[i], self.counts[i], call)


def _ints(x: Any, blocks: int, what: str, name: str) -> list[int]:
    vals = [int(v) for v in x]
    if len(vals) != blocks or any(v < 0 for v in vals):
        raise ValueError(f"{what}: {name} {list(x)!r}: expected {blocks} integers >= 0")
    return vals


def as_vector(spec: Any, what: str, blocks: int, readonly: bool = True) -> Vector:
    """A vector specification, as mpi4py reads it: ``buf``, ``[buf, type]``,
    ``[buf, counts]``, ``[buf, (counts, displs)]``, ``[buf, counts, type]``,
    ``[buf, (counts, displs), type]``, ``[buf, counts, displs, type]``. ``counts``
    missing: the buffer split as evenly as it goes (the first blocks one more);
    an integer: that many in each block; ``displs`` missing: blocks one after the
    other; an integer: a stride; displacements are in elements."""
    counts: Any = None
    displs: Any = None
    buf: Any = spec
    dtype: Any = None
    if isinstance(spec, list | tuple):
        n = len(spec)
        if n == 2:
            buf, counts = spec
            if _is_spec_type(counts):
                counts, dtype = None, counts
            elif isinstance(counts, tuple):
                counts, displs = counts
        elif n == 3:
            buf, counts, dtype = spec
            if isinstance(counts, tuple):
                counts, displs = counts
        elif n == 4:
            buf, counts, displs, dtype = spec
        else:
            raise ValueError(f"{what}: a vector specification has 2 to 4 items ([buf, "
                             f"counts, displs, type] ...), got {n}")
    datatype = as_datatype(dtype, what) if dtype is not None else None
    if buf is None:
        t = datatype or BYTE
        whole = Buffer(np.zeros(0, dtype=t.base.dtype), t, 0)
    else:
        flat, t = _base_view(buf, datatype, what, readonly)
        whole = Buffer(flat, t, flat.size // max(t.units, 1))
    if counts is None:
        total = whole.count
        cs = [total // blocks + (total % blocks > i) for i in range(blocks)]
    elif _is_count(counts):
        cs = [int(counts)] * blocks
    else:
        cs = _ints(counts, blocks, what, "counts")
    if displs is None:
        ds = [sum(cs[:i]) for i in range(blocks)]
    elif _is_count(displs):
        ds = [int(displs) * i for i in range(blocks)]
    else:
        ds = _ints(displs, blocks, what, "displs")
    v = Vector(whole, cs, ds)
    for i in range(blocks):
        v.block(i, what)  # every block fits in the buffer
    return v
