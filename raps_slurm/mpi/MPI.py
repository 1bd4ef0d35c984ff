"""The ``MPI`` namespace of :mod:`raps_slurm.mpi`: what ``from mpi4py import MPI`` gives a
program run with ``--mpi4py`` (docs/mpi.md lists what is supported). A name it does
not have raises NotImplementedError naming it.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from raps_slurm.mpi import world as _world
from raps_slurm.mpi.collective import Intracomm
from raps_slurm.mpi.comm import COMM_NULL, Comm, Exception
from raps_slurm.mpi.comm import KEY_APPNUM as APPNUM
from raps_slurm.mpi.comm import KEY_IO as IO
from raps_slurm.mpi.comm import KEY_TAG_UB as TAG_UB
from raps_slurm.mpi.comm import KEY_UNIVERSE_SIZE as UNIVERSE_SIZE
from raps_slurm.mpi.comm import KEY_WTIME_IS_GLOBAL as WTIME_IS_GLOBAL
from raps_slurm.mpi.engine import ANY_SOURCE, ANY_TAG, PROC_NULL
from raps_slurm.mpi.groups import CONGRUENT, IDENT, SIMILAR, UNEQUAL, Group
from raps_slurm.mpi.requests import UNDEFINED, Prequest, Request, Status
from raps_slurm.mpi.tree import IN_PLACE
from raps_slurm.mpi.types import (
    OPS,
    ORDER_C,
    ORDER_F,
    ORDER_FORTRAN,
    TYPES,
    Datatype,
    Op,
    unsupported,
)

__all__ = ["ANY_SOURCE", "ANY_TAG", "APPNUM", "COMM_NULL", "COMM_SELF", "COMM_WORLD",
           "CONGRUENT", "IDENT", "IN_PLACE", "IO", "ORDER_C", "ORDER_F", "ORDER_FORTRAN",
           "PROC_NULL", "REQUEST_NULL", "SIMILAR", "TAG_UB", "UNDEFINED", "UNEQUAL",
           "UNIVERSE_SIZE", "WTIME_IS_GLOBAL", "Abort", "Comm", "Datatype", "Exception",
           "Finalize", "Group", "Init", "Intracomm", "Op", "Prequest", "Request", "Status",
           "Wtime"]


class _SelfComm(Intracomm):
    def _members(self) -> list[int]:
        return [_world.world().rank]


COMM_WORLD = Intracomm._make(0, None, "MPI_COMM_WORLD")
COMM_SELF = _SelfComm._make(2, None, "MPI_COMM_SELF")
REQUEST_NULL = Request(None)
GROUP_EMPTY = Group([])
SUCCESS, ERR_OTHER = 0, 16
THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = 0, 1, 2, 3
MAX_PROCESSOR_NAME = 256
VERSION, SUBVERSION = 3, 1

globals().update(TYPES)
globals().update(OPS)
_START = time.time()


def Wtime() -> float:
    """Seconds of wall-clock time."""
    return time.time()


def Wtick() -> float:
    """Resolution of :func:`Wtime`."""
    return time.get_clock_info("time").resolution


def Init() -> None:
    """Start the world (it also starts on first use)."""
    _world.world()


def Init_thread(required: int = THREAD_MULTIPLE) -> int:
    """Start the world; one application thread may call MPI at a time."""
    _world.world()
    return THREAD_SERIALIZED


def Query_thread() -> int:
    """The thread level: serialized."""
    return THREAD_SERIALIZED


def Is_thread_main() -> bool:
    """Whether this is the main thread."""
    import threading

    return threading.current_thread() is threading.main_thread()


def Is_initialized() -> bool:
    """Whether the world has started."""
    return _world.started()


def Is_finalized() -> bool:
    """Whether Finalize has run."""
    return _world.started() and _world.world().finalized


def Finalize() -> None:
    """Wait until every rank is done (they may still need this rank's log), then close."""
    if _world.started():
        _world.world().finalize()


def Abort(errorcode: int = 1) -> None:
    """End this rank at once with ``errorcode``. Under the local launcher the whole job
    ends (a marker tells it not to relaunch the rank and to stop the others)."""
    rank = _world.world().rank if _world.started() else os.environ.get("RAPS_RANK", "?")
    print(f"raps_slurm.mpi: Abort({errorcode}) on rank {rank}", file=sys.stderr, flush=True)
    root = os.environ.get("RAPS_LOCAL_DIR")
    if root:
        from raps_slurm.runtime.local import ABORT_FILE

        try:
            with open(os.path.join(root, ABORT_FILE), "a") as f:
                f.write(f"{rank} {errorcode}\n")
        except OSError as exc:  # the rank still ends; the launcher may relaunch it
            print(f"raps_slurm.mpi: Abort could not tell the launcher: {exc}",
                  file=sys.stderr, flush=True)
    os._exit(errorcode or 1)


BSEND_OVERHEAD = 128  # Open MPI's: programs size their Bsend buffers with it
_attached: list[Any] = []


def Attach_buffer(buf: Any) -> None:
    """Accept a buffer for buffered sends. Every send is buffered by the runtime's log
    here, so it is only kept for :func:`Detach_buffer`."""
    if _attached:
        raise Exception("MPI.Attach_buffer: a buffer is attached already")
    _attached.append(buf)


def Detach_buffer() -> Any:
    """The buffer :func:`Attach_buffer` attached."""
    if not _attached:
        raise Exception("MPI.Detach_buffer: no buffer is attached")
    return _attached.pop()


def Get_processor_name() -> str:
    """This host's name."""
    return socket.gethostname()


def Get_version() -> tuple[int, int]:
    """The MPI standard version the API follows."""
    return VERSION, SUBVERSION


def Get_library_version() -> str:
    """This library."""
    return "raps_slurm.mpi (mpi4py-compatible API on the RAPS logged runtime)"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise unsupported(f"MPI.{name}")
