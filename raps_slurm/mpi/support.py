"""What :mod:`raps_slurm.mpi` supports, family by family: the one list behind the
table of docs/mpi.md and the tests that run each family's programs under Open MPI and
under RAPS (tests/unit/test_mpi_programs.py, tests/unit/test_mpi4py_support.py).

A call is named as a program writes it after its object: ``MPI.Wtime`` (the module),
``Comm.Send`` (a communicator), ``Request.Wait``, ``Status.Get_count``,
``Datatype.Create_vector``, ``Group.Incl``, ``Prequest.Start``. Every call of a family
appears in one of its programs, which run under both MPIs; an alias (another name of a
call, or its object form) is listed beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CALLS_PY = "tests/data/mpi/calls.py"


@dataclass(frozen=True)
class Family:
    """One row of the table: calls, the programs that run them under both MPIs."""

    name: str
    calls: tuple[str, ...]
    programs: tuple[str, ...]
    aliases: dict[str, str] = field(default_factory=dict)
    note: str = ""


def _c(text: str) -> tuple[str, ...]:
    return tuple(text.split())


FAMILIES: tuple[Family, ...] = (
    Family("world", _c("MPI.COMM_WORLD MPI.COMM_SELF Comm.Get_rank Comm.Get_size "
                       "MPI.Wtime MPI.Wtick MPI.Init MPI.Init_thread MPI.Query_thread "
                       "MPI.Is_thread_main MPI.Is_initialized MPI.Is_finalized MPI.Finalize "
                       "MPI.Abort MPI.Get_processor_name MPI.Get_version"),
           ("examples/mpi4py/basics.py", "examples/mpi4py/comms.py", CALLS_PY),
           {"Comm.rank": "Comm.Get_rank", "Comm.size": "Comm.Get_size"},
           "the thread level is THREAD_SERIALIZED (see Threads)"),
    Family("point-to-point, objects",
           _c("Comm.send Comm.recv Comm.isend Comm.irecv Comm.sendrecv Comm.probe "
              "Comm.iprobe MPI.ANY_SOURCE MPI.ANY_TAG MPI.PROC_NULL MPI.Status "
              "Status.Get_source Status.Get_tag Status.Get_count"),
           ("examples/mpi_ring.py", "examples/mpi_master_worker.py", CALLS_PY,
            "examples/mpi4py/basics.py"),
           {"Comm.ssend": "Comm.send", "Comm.issend": "Comm.isend", "Comm.ibsend": "Comm.isend"}),
    Family("point-to-point, buffers",
           _c("Comm.Send Comm.Recv Comm.Isend Comm.Irecv Comm.Sendrecv "
              "Comm.Sendrecv_replace Comm.Probe Comm.Iprobe"),
           ("examples/mpi4py/buffers.py", "examples/mpi_ring.py", "examples/mpi_waitany.py",
            CALLS_PY, "examples/mpi4py/basics.py"),
           {"Comm.Ssend": "Comm.Send", "Comm.Rsend": "Comm.Send",
            "Comm.Issend": "Comm.Isend", "Comm.Ibsend": "Comm.Isend",
            "Comm.Irsend": "Comm.Isend"}),
    Family("buffered sends", _c("MPI.Attach_buffer MPI.Detach_buffer MPI.BSEND_OVERHEAD "
                                "Comm.Bsend Comm.bsend"),
           ("examples/mpi4py/basics.py",),
           note="every send is buffered by the message log: the attached buffer is only "
                "kept"),
    Family("requests",
           _c("Request.Wait Request.Test Request.Free Request.Waitall Request.Waitany "
              "Request.Testall Request.Testany Request.Waitsome Request.Testsome "
              "MPI.REQUEST_NULL"),
           ("examples/mpi4py/requests.py", "examples/mpi_waitany.py", CALLS_PY,
            "examples/mpi4py/basics.py", "examples/mpi4py/nonblocking.py"),
           {f"Request.{c.lower()}": f"Request.{c}" for c in
            _c("Wait Test Waitall Waitany Testall Testany Waitsome Testsome")},
           "a non-blocking collective's request in each"),
    Family("persistent requests",
           _c("Comm.Send_init Comm.Recv_init Prequest.Start Prequest.Startall"),
           ("examples/mpi4py/requests.py",)),
    Family("collectives, objects",
           _c("Comm.barrier Comm.bcast Comm.reduce Comm.allreduce Comm.gather "
              "Comm.scatter Comm.allgather Comm.alltoall"),
           ("examples/mpi_collectives.py",)),
    Family("collectives, buffers",
           _c("Comm.Barrier Comm.Bcast Comm.Reduce Comm.Allreduce Comm.Gather Comm.Scatter "
              "Comm.Allgather Comm.Alltoall MPI.IN_PLACE"),
           ("examples/mpi_collectives.py", "examples/mpi4py/buffers.py", CALLS_PY),
           note="IN_PLACE at the root of Reduce, Gather, Scatter; on every rank of "
                "Allreduce, Allgather, Alltoall, Scan, Exscan, Reduce_scatter(_block)"),
    Family("vector collectives, scans",
           _c("Comm.Gatherv Comm.Scatterv Comm.Allgatherv Comm.Alltoallv Comm.Scan "
              "Comm.Exscan Comm.Reduce_scatter_block Comm.Reduce_scatter"),
           ("examples/mpi4py/vector.py",)),
    Family("non-blocking collectives",
           _c("Comm.Ibarrier Comm.Ibcast Comm.Ireduce Comm.Iallreduce"),
           ("examples/mpi4py/nonblocking.py",),
           note="they move in the call and in the calls that wait for or test their "
                "requests only (see Non-blocking collectives)"),
    Family("operations",
           _c("MPI.SUM MPI.PROD MPI.MAX MPI.MIN MPI.LAND MPI.LOR MPI.LXOR MPI.BAND MPI.BOR "
              "MPI.BXOR MPI.MAXLOC MPI.MINLOC"),
           ("examples/mpi_reduce.py", CALLS_PY, "examples/mpi4py/basics.py"),
           note="MAXLOC/MINLOC on objects ((value, index) pairs) and on DOUBLE_INT, "
                "FLOAT_INT, LONG_INT, 2INT, SHORT_INT"),
    Family("communicators",
           _c("Comm.Dup Comm.Split Comm.Free Comm.Get_name Comm.Set_name Comm.Get_attr "
              "MPI.Comm.Compare MPI.Intracomm Comm.Get_group MPI.COMM_NULL MPI.UNDEFINED "
              "MPI.TAG_UB MPI.IO MPI.WTIME_IS_GLOBAL MPI.APPNUM MPI.IDENT MPI.CONGRUENT "
              "MPI.SIMILAR MPI.UNEQUAL"),
           ("examples/mpi4py/comms.py", "examples/mpi_collectives.py", CALLS_PY,
            "examples/mpi4py/basics.py"),
           {"Comm.Clone": "Comm.Dup"},
           "MPI.Intracomm(comm) and subclasses calling super().__new__(cls, comm); "
           "also called on the class, as MPI.Comm.Dup(comm)"),
    Family("groups",
           _c("Group.Get_size Group.Get_rank Group.Incl Group.Excl MPI.Group.Translate_ranks "
              "MPI.Group.Compare Group.Free"),
           ("examples/mpi4py/comms.py",)),
    Family("datatypes",
           _c("MPI.DOUBLE MPI.INT MPI.LONG MPI.BYTE MPI.DOUBLE_INT Datatype.Create_contiguous "
              "Datatype.Create_vector Datatype.Create_indexed Datatype.Create_hvector "
              "Datatype.Create_hindexed Datatype.Create_subarray Datatype.Create_resized "
              "MPI.Datatype.Create_struct Datatype.Commit Datatype.Free Datatype.Get_size "
              "Datatype.Get_extent MPI.ORDER_FORTRAN"),
           ("examples/mpi4py/datatypes.py", "examples/mpi4py/buffers.py",
            "examples/mpi4py/vector.py", "examples/mpi_reduce.py"),
           note="every predefined contiguous type (CHAR, FLOAT, C_BOOL, the INT*_T/UINT*_T "
                "family, complex types, ...) and mpi4py's typecodes ('d', 'i', 'B', ...); "
                "derived types of one predefined type (byte strides and displacements: "
                "whole elements of it); Create_struct of any types, in point-to-point and "
                "in collectives that move data (no reduction); C or Fortran contiguous "
                "buffers"),
)


def table() -> str:
    """The support table of docs/mpi.md (markdown)."""
    rows = ["| family | calls | notes |", "|---|---|---|"]
    for f in FAMILIES:
        names = [f"`{c.split('.', 1)[1] if c.startswith(('Comm.', 'MPI.')) else c}`"
                 for c in f.calls]
        if f.aliases:
            names.append("also " + ", ".join(f"`{a.split('.', 1)[1]}`" for a in f.aliases))
        rows.append(f"| {f.name} | {', '.join(names)} | {f.note} |")
    return "\n".join(rows) + "\n"
