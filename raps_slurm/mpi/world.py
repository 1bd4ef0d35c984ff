"""The rank's MPI world: the runtime context, the matching engine, and what a
checkpoint keeps besides the program's state.

The world starts at the first MPI call that needs it (``Get_rank`` included): it calls
``runtime.init()`` (the launcher's ``RAPS_*`` variables; none at all: a single rank, as
``python prog.py`` is under mpi4py) and restores at once, before anything is sent. A
rank restored from a checkpoint re-executes the program from its start: communicators
it creates before it calls :func:`restore` are given back from the checkpoint (their
messages were consumed long ago), and any other communication before :func:`restore`
is refused with a clear error.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
from typing import Any

from raps_slurm import runtime
from raps_slurm.mpi.engine import Engine
from raps_slurm.runtime.context import Context

ITEM = "mpi"  # the checkpoint item holding the program's state and this layer's


class World:
    """One rank's MPI state (see the module docstring)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.rank, self.size = ctx.rank, ctx.size
        self.engine = Engine(ctx)
        self.finalized = False
        self.restored_state: Any = None
        self.has_restored = False     # a checkpoint was restored at start-up
        self.restore_called = False   # ... and the program has asked for it
        self.saved_comms: list[tuple[int, list[int] | None]] = []
        self.created = 0              # communicators created (creation order)
        self.children: dict[int, int] = {}  # context id -> communicators made from it
        self.saved_children: dict[int, int] = {}
        got = ctx.restore()
        if got is not None:
            raw = got.get(ITEM) if isinstance(got, dict) else None
            if raw is None:
                raise RuntimeError("the checkpoint restored was not written by "
                                   "raps_slurm.mpi.checkpoint()")
            saved = pickle.loads(bytes(raw))
            self.engine.load(saved["engine"], ctx.replayed_records())
            self.saved_comms = saved["comms"]
            self.saved_children = saved["children"]
            self.restored_state = saved["state"]
            self.has_restored = True
        else:
            self.engine.load({}, ctx.replayed_records())

    def check_may_communicate(self, call: str) -> None:
        """A restored rank communicates only once the program has restored its state."""
        if self.has_restored and not self.restore_called:
            raise RuntimeError(
                f"{call}: this rank was restored from a checkpoint; call "
                "raps_slurm.mpi.restore() before communicating (only communicator "
                "creation may come before it)")

    def replaying_setup(self) -> bool:
        """Communicator creation is given back from the checkpoint."""
        return self.has_restored and not self.restore_called

    def restore(self) -> Any:
        """The state the last checkpoint saved (None when this rank starts afresh)."""
        if self.has_restored and not self.restore_called:
            self.restore_called = True
            self.created = len(self.saved_comms)
            self.children = dict(self.saved_children)
            return self.restored_state
        self.restore_called = True
        return None

    def checkpoint(self, state: Any) -> int:
        """Save ``state`` (any picklable object) with this layer's matching state and
        communicators; returns the generation."""
        if self.has_restored and not self.restore_called:
            raise RuntimeError("checkpoint before restore(): a restored rank calls "
                               "raps_slurm.mpi.restore() first")
        blob = pickle.dumps({"state": state, "engine": self.engine.state(),
                             "comms": self.saved_comms, "children": self.children},
                            protocol=5)
        return self.ctx.checkpoint({ITEM: blob})

    def finalize(self) -> None:
        """MPI_Finalize: wait for every rank to finish (they may still need this rank's
        log to replay), then close."""
        if not self.finalized:
            self.finalized = True
            self.ctx.finalize()


_world: World | None = None
_failed: list[bool] = []


def world() -> World:
    """The rank's world, started on first use."""
    global _world
    if _world is None:
        env = os.environ
        local = None if env.get("RAPS_LOCAL_DIR") or env.get("RAPS_AGENT_SOCKET") else 1
        _world = World(runtime.init(local=local))
        atexit.register(_at_exit)
        previous = sys.excepthook

        def hook(*exc: Any) -> None:
            _failed.append(True)
            previous(*exc)
        sys.excepthook = hook
    return _world


def started() -> bool:
    """Whether the world has started."""
    return _world is not None


def _at_exit() -> None:
    # mpi4py finalizes at exit: so does this layer (the rank serves its peers' replays
    # until they are done).
    # A rank that died of an exception exits non-zero at once: the launcher relaunches
    # it (or reports the failure); finalizing would wait for peers it leaves hanging.
    if _world is not None and not _world.finalized and not _failed:
        try:
            _world.finalize()
        except Exception as exc:
            print(f"raps_slurm.mpi: finalize at exit failed: {exc}", file=sys.stderr)
