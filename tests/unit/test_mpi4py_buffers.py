"""Buffer specifications as mpi4py 3.1 reads them, and derived datatypes: pure parsing
and packing, without ranks (the programs of examples/mpi4py check the same against
Open MPI)."""

from __future__ import annotations

import numpy as np
import pytest

from raps_slurm.mpi import MPI
from raps_slurm.mpi.buffers import as_buffer, as_vector
from raps_slurm.mpi.types import TYPES, reducible


def test_every_simple_form_names_the_same_elements_as_mpi4py() -> None:
    a = np.arange(10, dtype="d")
    assert as_buffer([a, "d"]).datatype is TYPES["DOUBLE"]
    assert as_buffer([a, 3]).array.tolist() == [0.0, 1.0, 2.0]          # no type: dtype's
    assert as_buffer([a, (3, 2)]).array.tolist() == [2.0, 3.0, 4.0]
    assert as_buffer([a, [3, 2], "d"]).array.tolist() == [2.0, 3.0, 4.0]  # list as the pair
    assert as_buffer([a, 2, 7, MPI.DOUBLE]).array.tolist() == [7.0, 8.0]
    assert as_buffer([a, (0, 10), "d"]).count == 0
    assert as_buffer([a, "B"]).count == 80 and as_buffer([a, 16, "B"]).nbytes == 16
    assert as_buffer([None, 0, "i"]).count == 0
    with pytest.raises(KeyError, match="cannot map 'z'"):
        as_buffer([a, "z"])
    with pytest.raises(ValueError, match="2 to 4 items"):
        as_buffer([a, 1, 1, "d", 0])
    with pytest.raises(ValueError, match="count -1"):
        as_buffer([a, -1, "d"])
    with pytest.raises(BufferError, match="not writable"):
        as_buffer(b"xx", "Recv", readonly=False)


def test_a_collectives_count_is_per_process() -> None:
    buf = bytearray(4)
    b = as_buffer([buf, 1, MPI.BYTE], "Allgather", 4)
    assert b.count == 1 and [b.sub(r, 1, "x").nbytes for r in range(4)] == [1] * 4
    inferred = as_buffer(np.zeros(12, "i"), "Gather", 3)
    assert inferred.count == 4
    with pytest.raises(ValueError, match="7 elements do not split into 3 equal blocks"):
        as_buffer(np.zeros(7, "i"), "Gather", 3)
    with pytest.raises(ValueError, match="exceed the buffer"):
        as_buffer([np.zeros(5, "i"), 2, "i"], "Gather", 3)   # 3 blocks of 2 need 6


def test_vector_forms() -> None:
    a = np.arange(10, dtype="i")
    v = as_vector([a, ([1, 2, 3], [0, 4, 7]), MPI.INT], "Gatherv", 3)
    assert [v.block(i, "x").array.tolist() for i in range(3)] == [[0], [4, 5], [7, 8, 9]]
    even = as_vector(a, "Gatherv", 3)           # 10 split as evenly as it goes
    assert even.counts == [4, 3, 3] and even.displs == [0, 4, 7]
    strided = as_vector([a, 2, 3, "i"], "Gatherv", 3)
    assert strided.counts == [2, 2, 2] and strided.displs == [0, 3, 6]
    with pytest.raises(ValueError, match="exceed the buffer"):
        as_vector([a, ([5, 5, 5], [0, 5, 9]), "i"], "Gatherv", 3)


def test_derived_datatypes_pack_and_unpack_like_mpi() -> None:
    m = np.arange(16, dtype="d").reshape(4, 4)
    col = MPI.DOUBLE.Create_vector(4, 1, 4).Commit()
    assert (col.Get_size(), col.Get_extent()) == (32, (0, 104))
    assert as_buffer([m, 1, col]).array.tolist() == [0.0, 4.0, 8.0, 12.0]
    two = col.Create_resized(0, 8).Commit()
    assert as_buffer([m, 2, two]).array.tolist() == [0.0, 4.0, 8.0, 12.0, 1.0, 5.0, 9.0, 13.0]
    idx = MPI.INT.Create_indexed([2, 1], [1, 5]).Commit()
    assert idx.Get_extent() == (4, 20) and idx.Get_size() == 12
    sub = MPI.INT.Create_subarray([3, 4], [2, 2], [1, 1]).Commit()
    assert sub.Get_extent() == (0, 48)
    out = np.zeros(12, "i")
    as_buffer([out, 1, sub], readonly=False).put(np.array([1, 2, 3, 4], "i").tobytes(), "x")
    assert out.reshape(3, 4).tolist() == [[0, 0, 0, 0], [0, 1, 2, 0], [0, 3, 4, 0]]
    fort = MPI.INT.Create_subarray([3, 4], [2, 2], [1, 1], order=MPI.ORDER_FORTRAN).Commit()
    assert as_buffer([np.arange(12, dtype="i"), 1, fort]).array.tolist() == [4, 5, 7, 8]
    loose = MPI.DOUBLE.Create_contiguous(2)
    with pytest.raises(ValueError, match="not committed"):
        as_buffer([m, 1, loose])
    col.Free()
    with pytest.raises(ValueError, match="was freed"):
        as_buffer([m, 1, col])


def test_byte_strided_types_and_fortran_buffers() -> None:
    m = np.asfortranarray(np.arange(9, dtype="d").reshape(3, 3))
    assert as_buffer(m).array.tolist() == [0.0, 3.0, 6.0, 1.0, 4.0, 7.0, 2.0, 5.0, 8.0]
    xpose = MPI.DOUBLE.Create_vector(3, 1, 3).Create_hvector(3, 1, 8).Commit()
    assert xpose.Get_size() == 72
    assert as_buffer([m, 1, xpose]).array.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0,
                                                       7.0, 8.0]
    ends = MPI.INT.Create_hindexed([1, 2], [0, 16]).Commit()
    assert as_buffer([np.arange(8, dtype="i"), 1, ends]).array.tolist() == [0, 4, 5]
    with pytest.raises(ValueError, match="6 bytes is not a whole number of INT elements"):
        MPI.INT.Create_hvector(2, 1, 6)
    with pytest.raises(TypeError, match="not contiguous"):
        as_buffer(m[:2, :])


def test_a_struct_type_is_a_c_structs_layout_and_moves_its_fields_bytes() -> None:
    for fields in ([("c", "i1"), ("d", "f8", 3), ("i", "i4")], [("s", "i2"), ("c", "i1")],
                   [("i", "i4"), ("l", "i8"), ("f", "f4")]):
        dt = np.dtype(fields, align=True)
        types = {"i1": MPI.CHAR, "i2": MPI.SHORT, "i4": MPI.INT, "i8": MPI.LONG,
                 "f4": MPI.FLOAT, "f8": MPI.DOUBLE}
        t = MPI.Datatype.Create_struct(
            [int(np.prod(dt[f].shape)) or 1 for f in dt.names],
            [dt.fields[f][1] for f in dt.names],
            [types[dt[f].base.str.lstrip("<|")] for f in dt.names]).Commit()
        packed = sum(dt[f].itemsize for f in dt.names)
        assert (t.Get_size(), t.Get_extent()) == (packed, (0, dt.itemsize)), fields
    dt = np.dtype([("c", "i1"), ("d", "f8"), ("i", "i4")], align=True)
    t = MPI.Datatype.Create_struct([1, 1], [dt.fields["d"][1], dt.fields["i"][1]],
                                   [MPI.DOUBLE, MPI.INT])
    t = t.Create_resized(0, dt.itemsize).Commit()     # the fields d and i, not c
    a = np.array([(1, 2.5, 3), (4, 5.5, 6)], dtype=dt)
    data = as_buffer([a, 2, t]).raw()
    packed = np.array([(2.5, 3), (5.5, 6)], dtype=[("d", "f8"), ("i", "i4")])  # no padding
    assert bytes(data) == packed.tobytes()
    r = np.full(2, -1, dtype=dt)
    as_buffer([r, 2, t], readonly=False).put(data, "Recv")
    assert [x.tolist() for x in r] == [(-1, 2.5, 3), (-1, 5.5, 6)]


def test_a_struct_type_is_refused_by_reductions_and_bad_lists_are_named() -> None:
    t = MPI.Datatype.Create_struct([1, 1], [0, 8], [MPI.DOUBLE, MPI.INT]).Commit()
    assert t.Dup().mixed and t.Create_contiguous(2).Get_extent() == (0, 32)
    with pytest.raises(ValueError,
                       match=r"Allreduce: datatype struct\(DOUBLE,INT\) mixes several types"):
        reducible(t, "Allreduce")
    reducible(MPI.DOUBLE.Create_vector(2, 1, 2).Commit(), "Allreduce")  # one type: allowed
    with pytest.raises(ValueError, match="2 block lengths, 1 displacements and 2 datatypes"):
        MPI.Datatype.Create_struct([1, 1], [0], [MPI.DOUBLE, MPI.INT])
    with pytest.raises(ValueError, match="blocklength -1"):
        MPI.Datatype.Create_struct([-1], [0], [MPI.DOUBLE])
    with pytest.raises(ValueError, match="data at byte -8: expected displacements"):
        MPI.Datatype.Create_struct([1, 1], [-8, 0], [MPI.DOUBLE, MPI.INT])
