"""Datatypes, reduction operations and buffer specifications of :mod:`raps_slurm.mpi`.

A datatype names a numpy dtype (``MPI.DOUBLE`` is ``float64``); a buffer argument is a
numpy array or another writable buffer, alone (its dtype gives the datatype) or as
``[buf, DATATYPE]``, ``[buf, count, DATATYPE]`` or ``[buf, (count, displ), DATATYPE]``.
Reductions apply their operation element by element in the order the collective fixes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt


class Unsupported(NotImplementedError, AttributeError):
    """An mpi4py name this layer does not support. A NotImplementedError naming it when
    used; an AttributeError too, so that ``hasattr(MPI, name)`` is False (programs probe
    for optional features that way)."""


def unsupported(what: str) -> Unsupported:
    """The error every unsupported mpi4py call raises."""
    return Unsupported(f"{what} is not supported by raps_slurm.mpi (docs/mpi.md lists what "
                       "is)")


class Namespace(type):
    """Metaclass of the MPI classes: a class attribute they lack (``MPI.Op.Create``,
    ``MPI.Comm.Get_parent``) raises :class:`Unsupported` naming it."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported(f"MPI.{cls.__name__}.{name}")


class Datatype(metaclass=Namespace):
    """An MPI datatype: a name and the numpy dtype of one element."""

    def __init__(self, name: str, dtype: npt.DTypeLike) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)

    @property
    def size(self) -> int:
        """Bytes of one element."""
        return int(self.dtype.itemsize)

    def Get_size(self) -> int:
        """Bytes of one element."""
        return self.size

    def Get_extent(self) -> tuple[int, int]:
        """(lower bound, extent): contiguous types only."""
        return 0, self.size

    def Get_name(self) -> str:
        """The MPI name."""
        return self.name

    def Commit(self) -> Datatype:
        """Predefined types are committed already."""
        return self

    def Free(self) -> None:
        """Predefined types are not freed."""

    def __repr__(self) -> str:
        return f"<MPI.{self.name}>"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported(f"MPI.Datatype.{name} (predefined contiguous datatypes only)")


_PAIR = {"FLOAT_INT": np.float32, "DOUBLE_INT": np.float64, "LONG_INT": np.int64,
         "TWOINT": np.int32, "SHORT_INT": np.int16, "LONG_DOUBLE_INT": np.longdouble}
TYPES: dict[str, Datatype] = {n: Datatype(n, t) for n, t in {
    "BYTE": np.uint8, "CHAR": np.int8, "SIGNED_CHAR": np.int8, "UNSIGNED_CHAR": np.uint8,
    "WCHAR": np.int32, "SHORT": np.int16, "UNSIGNED_SHORT": np.uint16, "INT": np.int32,
    "UNSIGNED": np.uint32, "UNSIGNED_INT": np.uint32, "LONG": np.int64,
    "UNSIGNED_LONG": np.uint64, "LONG_LONG": np.int64, "UNSIGNED_LONG_LONG": np.uint64,
    "FLOAT": np.float32, "DOUBLE": np.float64, "LONG_DOUBLE": np.longdouble,
    "BOOL": np.bool_, "C_BOOL": np.bool_, "INT8_T": np.int8, "INT16_T": np.int16,
    "INT32_T": np.int32, "INT64_T": np.int64, "UINT8_T": np.uint8, "UINT16_T": np.uint16,
    "UINT32_T": np.uint32, "UINT64_T": np.uint64, "C_COMPLEX": np.complex64,
    "C_FLOAT_COMPLEX": np.complex64, "C_DOUBLE_COMPLEX": np.complex128,
    "COMPLEX": np.complex64, "DOUBLE_COMPLEX": np.complex128, "AINT": np.int64,
    "OFFSET": np.int64, "COUNT": np.int64, "INTEGER": np.int32, "REAL": np.float32,
    "DOUBLE_PRECISION": np.float64, "LOGICAL": np.int32, "CHARACTER": np.int8,
    "PACKED": np.uint8,
}.items()}
for _n, _t in _PAIR.items():
    # C struct layout (aligned, as MPI's extent is: DOUBLE_INT is 16 bytes)
    TYPES[_n] = Datatype(_n, np.dtype([("v", _t), ("i", np.int32)], align=True))
TYPES["2INT"] = TYPES["TWOINT"]
BYTE = TYPES["BYTE"]


def datatype_of(dtype: np.dtype[Any]) -> Datatype:
    """The datatype an array's dtype stands for (a plain BYTE view when none does)."""
    for t in TYPES.values():
        if t.dtype == dtype:
            return t
    return Datatype(f"<{dtype}>", dtype)


@dataclass
class Buffer:
    """A message buffer: a 1-D numpy view of ``count`` elements of ``datatype``."""

    array: np.ndarray[Any, Any]
    datatype: Datatype

    @property
    def count(self) -> int:
        """Elements."""
        return int(self.array.size)

    def raw(self) -> memoryview:
        """The bytes (the array is contiguous)."""
        return memoryview(self.array.data).cast("B")


def as_buffer(spec: Any, what: str = "buffer") -> Buffer:
    """A buffer from an mpi4py buffer specification (TypeError naming what is wrong)."""
    datatype: Datatype | None = None
    count: int | None = None
    displ = 0
    buf = spec
    if isinstance(spec, list | tuple):
        if not 1 <= len(spec) <= 4 or isinstance(spec[0], int | float):
            raise TypeError(f"{what}: expected [buf, DATATYPE] or [buf, count, DATATYPE], "
                            f"got {type(spec).__name__} of {len(spec)}")
        buf = spec[0]
        rest = list(spec[1:])
        if rest and isinstance(rest[-1], Datatype):
            datatype = rest.pop()
        if rest and isinstance(rest[0], tuple | list):
            count, displ = int(rest[0][0]), int(rest[0][1])
        elif rest and isinstance(rest[0], int):
            count = int(rest[0])
        elif rest and rest[0] is not None:
            raise TypeError(f"{what}: {rest[0]!r} is neither a count, (count, displ) nor an "
                            "MPI datatype")
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except TypeError:
            raise TypeError(f"{what}: {type(buf).__name__} is not a buffer (a numpy array, "
                            "bytearray or memoryview)") from None
    if not arr.flags.c_contiguous:
        raise TypeError(f"{what}: the array is not contiguous")
    flat = arr.reshape(-1)
    if datatype is None:
        datatype = datatype_of(flat.dtype)
    if flat.dtype != datatype.dtype:
        flat = flat.view(np.uint8)
        if flat.size % datatype.size:
            raise TypeError(f"{what}: {flat.size} bytes is not a whole number of "
                            f"{datatype.name} elements")
        flat = flat.view(datatype.dtype)
    if count is not None or displ:
        end = displ + (flat.size - displ if count is None else count)
        if end > flat.size:
            raise ValueError(f"{what}: count {count} at displacement {displ} exceeds the "
                             f"buffer's {flat.size} elements")
        flat = flat[displ:end]
    return Buffer(flat, datatype)


def _loc(pick: Callable[[Any, Any], bool]) -> Callable[[Any, Any], Any]:
    def f(a: Any, b: Any) -> Any:
        # (value, index) pairs: the better value, the lower index on a tie
        if a[0] == b[0]:
            return a if a[1] <= b[1] else b
        return a if pick(a[0], b[0]) else b
    return f


def copy_array(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A copy of ``a`` with the same bytes, a structured type's padding included. numpy's
    own copy of a padded structured array (``DOUBLE_INT``'s 16-byte pairs) may leave the
    padding undefined; these bytes are sent, and a re-executed rank must send the same
    ones (else its peers see a checksum change and call it not deterministic)."""
    if a.dtype.fields is None:
        return np.array(a, copy=True)
    if not a.flags.c_contiguous:
        out = np.zeros(a.shape, dtype=a.dtype)  # fields assigned one by one: padding 0
        out[...] = a
        return out
    out = np.empty(a.shape, dtype=a.dtype)
    out.reshape(-1).view(np.uint8)[:] = a.reshape(-1).view(np.uint8)
    return out


def _loc_arrays(pick: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def f(a: Any, b: Any) -> Any:
        out = copy_array(a)
        take_b = pick(b["v"], a["v"]) | ((b["v"] == a["v"]) & (b["i"] < a["i"]))
        out[take_b] = b[take_b]
        return out
    return f


class Op(metaclass=Namespace):
    """A predefined reduction: on Python objects and on numpy arrays."""

    def __init__(self, name: str, py: Callable[[Any, Any], Any],
                 arr: Callable[[Any, Any], Any]) -> None:
        self.name, self.py, self.arr = name, py, arr

    def __call__(self, a: Any, b: Any) -> Any:
        return self.py(a, b)

    def apply(self, a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Element-wise ``a op b`` (a's dtype kept)."""
        return np.asarray(self.arr(a, b)).astype(a.dtype, copy=False)

    def apply_into(self, a: np.ndarray[Any, Any], b: np.ndarray[Any, Any],
                   out: np.ndarray[Any, Any]) -> None:
        """:meth:`apply` written into ``out`` (which may be ``a`` or ``b``): a numpy
        ufunc writes there directly, the same operations in the same order."""
        if isinstance(self.arr, np.ufunc):
            self.arr(a, b, out=out)
        else:
            out[...] = self.apply(a, b)

    def __repr__(self) -> str:
        return f"<MPI.{self.name}>"

    def Is_commutative(self) -> bool:
        """Every predefined operation is."""
        return True

    def Free(self) -> None:
        """Predefined operations are not freed."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported(f"MPI.Op.{name}")


OPS: dict[str, Op] = {
    "SUM": Op("SUM", operator.add, np.add),
    "PROD": Op("PROD", operator.mul, np.multiply),
    "MAX": Op("MAX", lambda a, b: b if b > a else a, np.maximum),
    "MIN": Op("MIN", lambda a, b: b if b < a else a, np.minimum),
    "LAND": Op("LAND", lambda a, b: bool(a) and bool(b), np.logical_and),
    "LOR": Op("LOR", lambda a, b: bool(a) or bool(b), np.logical_or),
    "LXOR": Op("LXOR", lambda a, b: bool(a) != bool(b), np.logical_xor),
    "BAND": Op("BAND", operator.and_, np.bitwise_and),
    "BOR": Op("BOR", operator.or_, np.bitwise_or),
    "BXOR": Op("BXOR", operator.xor, np.bitwise_xor),
    "MAXLOC": Op("MAXLOC", _loc(operator.gt), _loc_arrays(np.greater)),
    "MINLOC": Op("MINLOC", _loc(operator.lt), _loc_arrays(np.less)),
}
