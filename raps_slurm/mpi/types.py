"""Datatypes and reduction operations of :mod:`raps_slurm.mpi` (buffer specifications:
:mod:`raps_slurm.mpi.buffers`).

A predefined datatype names a numpy dtype (``MPI.DOUBLE`` is ``float64``); a derived one
lists element offsets in its base type. Reductions apply their operation element by
element in the order the collective fixes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
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


class MPIException(RuntimeError):
    """An MPI error (``MPI.Exception``: e.g. a message longer than the receive buffer)."""


class Namespace(type):
    """Metaclass of the MPI classes: a class attribute they lack (``MPI.Op.Create``,
    ``MPI.Comm.Get_parent``) raises :class:`Unsupported` naming it."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported(f"MPI.{cls.__name__}.{name}")


class Datatype(metaclass=Namespace):
    """An MPI datatype. A predefined one names the numpy dtype of one element; a derived
    one (``Create_contiguous``, ``Create_vector``, ``Create_indexed``,
    ``Create_subarray``) is a list of element offsets in units of its one predefined
    ``base`` type, with an extent in the same units; a ``Create_struct`` of several
    types has ``BYTE`` for base, its offsets the bytes of its fields' data."""

    def __init__(self, name: str, dtype: npt.DTypeLike, base: Datatype | None = None,
                 offsets: Sequence[int] | None = None, extent: int = 1, lb: int = 0,
                 mixed: bool = False, align: int = 0) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)
        self.base = base if base is not None else self
        self.offsets = np.asarray(offsets if offsets is not None else [0], dtype=np.int64)
        self.units, self.lb_units = extent, lb
        self.committed = base is None
        self.freed = False
        k = self.offsets.size
        # whether ``count`` elements are ``count * len(offsets)`` base elements in a row
        self.contiguous = self.units == k and lb == 0 and bool(
            (self.offsets == np.arange(k)).all())
        self.last = int(self.offsets.max(initial=-1))  # the highest offset of an element
        # a Create_struct of several types: its base is BYTE, offsets in bytes, and no
        # reduction applies to it (MPI's predefined operations take no struct type)
        self.mixed = mixed
        self.align = align or self.dtype.alignment
        # bytes of data in one element: an attribute, read on every send and receive
        self.size = int(self.offsets.size * self.base.dtype.itemsize)

    @property
    def extent(self) -> int:
        """Bytes from one element to the next."""
        return int(self.units * self.base.dtype.itemsize)

    @property
    def lb(self) -> int:
        """Lower bound, bytes."""
        return int(self.lb_units * self.base.dtype.itemsize)

    @property
    def ub(self) -> int:
        """Upper bound, bytes."""
        return self.lb + self.extent

    def Get_size(self) -> int:
        """Bytes of data in one element."""
        return self.size

    def Get_extent(self) -> tuple[int, int]:
        """(lower bound, extent) in bytes."""
        return self.lb, self.extent

    def Get_name(self) -> str:
        """The MPI name."""
        return self.name

    def Commit(self) -> Datatype:
        """Make it usable in communication."""
        self.committed = True
        return self

    def Free(self) -> None:
        """Release a derived type (a predefined one is never freed)."""
        if self.base is not self:
            self.freed = True

    def Dup(self) -> Datatype:
        """A copy (committed if this one is)."""
        if self.base is self:
            return self
        d = self._derived(f"{self.name}.Dup", self.offsets.tolist(), self.units, self.lb_units)
        d.committed = self.committed
        return d

    def _derived(self, name: str, offsets: Sequence[int], extent: int, lb: int = 0
                 ) -> Datatype:
        if self.freed:
            raise ValueError(f"MPI.Datatype.{name.split('.')[-1]}: {self.name} was freed")
        return Datatype(name, self.base.dtype, self.base, offsets, extent, lb, self.mixed,
                        self.align)

    def _expand(self, starts: Sequence[int]) -> list[int]:
        """This type's base offsets for one element at each of ``starts`` (base units)."""
        return [int(s + o) for s in starts for o in self.offsets]

    def Create_contiguous(self, count: int) -> Datatype:
        """``count`` elements in a row."""
        _nonneg("Create_contiguous", count=count)
        return self._derived(f"contiguous({count},{self.name})",
                             self._expand([i * self.units for i in range(count)]),
                             count * self.units, self.lb_units)

    def Create_vector(self, count: int, blocklength: int, stride: int) -> Datatype:
        """``count`` blocks of ``blocklength`` elements, ``stride`` elements apart."""
        return self._strided("Create_vector", count, blocklength, stride * self.units)

    def _strided(self, call: str, count: int, blocklength: int, stride: int) -> Datatype:
        """``count`` blocks of ``blocklength`` elements, ``stride`` base elements apart."""
        _nonneg(call, count=count, blocklength=blocklength)
        starts = [b * stride + i * self.units for b in range(count) for i in range(blocklength)]
        return self._spanning(f"{call[7:].lower()}({count},{blocklength},{self.name})", starts)

    def Create_indexed(self, blocklengths: Sequence[int], displacements: Sequence[int]
                       ) -> Datatype:
        """Blocks of ``blocklengths[i]`` elements at ``displacements[i]`` (elements)."""
        if len(blocklengths) != len(displacements):
            raise ValueError(f"MPI.Datatype.Create_indexed: {len(blocklengths)} block "
                             f"lengths for {len(displacements)} displacements")
        _nonneg("Create_indexed", blocklength=min(blocklengths, default=0))
        starts = [(int(d) + i) * self.units for n, d in zip(blocklengths, displacements,
                                                             strict=True)
                  for i in range(int(n))]
        return self._spanning(f"indexed({self.name})", starts)

    def Create_hvector(self, count: int, blocklength: int, stride: int) -> Datatype:
        """``Create_vector`` with ``stride`` in bytes (a whole number of base elements
        here)."""
        return self._strided("Create_hvector", count, blocklength,
                             self._in_units(stride, "Create_hvector"))

    def Create_hindexed(self, blocklengths: Sequence[int], displacements: Sequence[int]
                        ) -> Datatype:
        """``Create_indexed`` with displacements in bytes (whole base elements here)."""
        _nonneg("Create_hindexed", blocklength=min(blocklengths, default=0))
        if len(blocklengths) != len(displacements):
            raise ValueError(f"MPI.Datatype.Create_hindexed: {len(blocklengths)} block "
                             f"lengths for {len(displacements)} displacements")
        starts = [self._in_units(int(d), "Create_hindexed") + i * self.units
                  for n, d in zip(blocklengths, displacements, strict=True)
                  for i in range(int(n))]
        return self._spanning(f"hindexed({self.name})", starts)

    def _in_units(self, nbytes: int, call: str) -> int:
        unit = self.base.dtype.itemsize
        if nbytes % unit:
            raise ValueError(f"MPI.Datatype.{call}: {nbytes} bytes is not a whole number of "
                             f"{self.base.name} elements ({unit} bytes): not supported")
        return nbytes // unit

    def Create_subarray(self, sizes: Sequence[int], subsizes: Sequence[int],
                        starts: Sequence[int], order: int = 0) -> Datatype:
        """The block ``subsizes`` at ``starts`` of an array of ``sizes`` (``order``:
        ``ORDER_C``, 0, or ``ORDER_FORTRAN``, 1); its extent is the whole array's."""
        if not len(sizes) == len(subsizes) == len(starts) or not sizes:
            raise ValueError("MPI.Datatype.Create_subarray: sizes, subsizes and starts "
                             "must have the same length, at least 1")
        for n, s, st in zip(sizes, subsizes, starts, strict=True):
            if not (n >= 1 and s >= 1 and st >= 0 and st + s <= n):
                raise ValueError(f"MPI.Datatype.Create_subarray: subsize {s} at {st} does "
                                 f"not fit in size {n}")
        index = np.indices(tuple(subsizes)).reshape(len(sizes), -1).T + np.asarray(starts)
        flat = np.ravel_multi_index(tuple(index.T), tuple(sizes),
                                    order="F" if order == ORDER_FORTRAN else "C")
        whole = int(np.prod(sizes)) * self.units
        # memory order is the order MPI packs a subarray in, C or Fortran alike
        return self._derived(f"subarray({self.name})",
                             self._expand([int(i) * self.units for i in np.sort(flat)]), whole)

    @staticmethod
    def Create_struct(blocklengths: Sequence[int], displacements: Sequence[int],
                      datatypes: Sequence[Datatype]) -> Datatype:
        """Blocks of ``blocklengths[i]`` elements of ``datatypes[i]`` at byte
        ``displacements[i]``. Its data are bytes (base ``BYTE``); its extent is rounded up
        to the largest alignment of its types, as the MPI standard and Open MPI do, so
        that it matches a C struct (or a numpy ``align=True`` dtype) of those fields."""
        if not len(blocklengths) == len(displacements) == len(datatypes):
            raise ValueError(f"MPI.Datatype.Create_struct: {len(blocklengths)} block lengths, "
                             f"{len(displacements)} displacements and {len(datatypes)} "
                             "datatypes: expected as many of each")
        _nonneg("Create_struct", blocklength=min(blocklengths, default=0))
        offs: list[int] = []
        lo, hi, align = 0, 0, 1
        spans: list[tuple[int, int]] = []
        for n, d, t in zip(blocklengths, displacements, datatypes, strict=True):
            t = as_datatype(t, "MPI.Datatype.Create_struct", need_commit=False)
            item = t.base.dtype.itemsize
            byte = np.arange(item, dtype=np.int64)
            for i in range(int(n)):
                start = int(d) + i * t.extent
                offs.extend((start + t.offsets[:, None] * item + byte[None, :]).reshape(-1)
                            .tolist())
            if n:
                spans.append((int(d) + t.lb, int(d) + t.lb + int(n) * t.extent))
                align = max(align, t.align)
        if offs and min(offs) < 0:
            # a buffer here starts at its first byte: nothing lies before it
            raise ValueError(f"MPI.Datatype.Create_struct: data at byte {min(offs)}: "
                             "expected displacements that put every byte at 0 or after")
        if spans:
            lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        extent = -(-(hi - lo) // align) * align
        names = ",".join(t.name if isinstance(t, Datatype) else str(t) for t in datatypes)
        return Datatype(f"struct({names})", BYTE.dtype, BYTE, offs, extent, lo, True, align)

    def Create_resized(self, lb: int, extent: int) -> Datatype:
        """The same data with lower bound ``lb`` and extent ``extent`` (bytes, whole
        base elements)."""
        unit = self.base.dtype.itemsize
        if lb % unit or extent % unit or extent <= 0:
            raise ValueError(f"MPI.Datatype.Create_resized: lb {lb} and extent {extent} "
                             f"must be positive multiples of {unit} bytes here")
        return self._derived(f"resized({self.name})", self.offsets.tolist(), extent // unit,
                             lb // unit)

    def _spanning(self, name: str, starts: list[int]) -> Datatype:
        offs = self._expand(starts)
        if not offs:
            return self._derived(name, [], 0)
        lo = min(starts) + self.lb_units
        hi = max(starts) + self.lb_units + self.units
        return self._derived(name, offs, hi - lo, lo)

    def __repr__(self) -> str:
        return f"<MPI.{self.name}>"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported(f"MPI.Datatype.{name}")


ORDER_C, ORDER_FORTRAN = 0, 1
ORDER_F = ORDER_FORTRAN


def _nonneg(call: str, **values: int) -> None:
    for k, v in values.items():
        if v < 0:
            raise ValueError(f"MPI.Datatype.{call}: {k} {v}: expected a count >= 0")


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
    "C_LONG_DOUBLE_COMPLEX": np.clongdouble,
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

# mpi4py's typecodes (its TypeDict): struct/array codes and numpy's sized names.
TYPECODES: dict[str, Datatype] = {c: TYPES[n] for c, n in {
    "?": "C_BOOL", "c": "CHAR", "b": "SIGNED_CHAR", "h": "SHORT", "i": "INT", "l": "LONG",
    "q": "LONG_LONG", "p": "AINT", "B": "UNSIGNED_CHAR", "H": "UNSIGNED_SHORT",
    "I": "UNSIGNED", "L": "UNSIGNED_LONG", "Q": "UNSIGNED_LONG_LONG", "f": "FLOAT",
    "d": "DOUBLE", "g": "LONG_DOUBLE", "F": "C_FLOAT_COMPLEX", "D": "C_DOUBLE_COMPLEX",
    "G": "C_LONG_DOUBLE_COMPLEX", "Zf": "C_FLOAT_COMPLEX", "Zd": "C_DOUBLE_COMPLEX",
    "Zg": "C_LONG_DOUBLE_COMPLEX", "b1": "C_BOOL", "i1": "INT8_T", "i2": "INT16_T",
    "i4": "INT32_T", "i8": "INT64_T", "u1": "UINT8_T", "u2": "UINT16_T", "u4": "UINT32_T",
    "u8": "UINT64_T", "f4": "FLOAT", "f8": "DOUBLE", "c8": "C_FLOAT_COMPLEX",
    "c16": "C_DOUBLE_COMPLEX",
}.items()}


def as_datatype(t: Any, what: str, need_commit: bool = True) -> Datatype:
    """A Datatype, or the one a typecode string names (as mpi4py's ``TypeDict``)."""
    if isinstance(t, Datatype):
        if t.freed:
            raise ValueError(f"{what}: datatype {t.name} was freed")
        if need_commit and not t.committed:
            raise ValueError(f"{what}: datatype {t.name} is not committed (call Commit())")
        return t
    key = t.lstrip("@=<") if isinstance(t, str) else t
    if isinstance(key, str) and key in TYPECODES:
        return TYPECODES[key]
    raise KeyError(f"{what}: cannot map {t!r} to an MPI datatype (typecodes: "
                   f"{' '.join(sorted(TYPECODES))})")


_BY_DTYPE: dict[np.dtype[Any], Datatype] = {}
for _dt in reversed(TYPES.values()):
    _BY_DTYPE[_dt.dtype] = _dt  # the first name of each dtype wins, as listed


def datatype_of(dtype: np.dtype[Any]) -> Datatype:
    """The datatype an array's dtype stands for (one of its own when none does)."""
    t = _BY_DTYPE.get(dtype)
    return t if t is not None else Datatype(f"<{dtype}>", dtype)


def reducible(t: Datatype, call: str) -> None:
    """Refuse a reduction on a struct of several types (MPI defines none)."""
    if t.mixed:
        raise ValueError(f"{call}: datatype {t.name} mixes several types: a reduction takes "
                         "a predefined type or a derived type of one")


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
