"""Waitany, Testany, Waitsome and Testsome over non-blocking collectives' requests: each collective's
progress is a recorded decision, so a re-executed rank completes the same request in
the same call and sends at the same points (the matching engine on a scripted runtime;
examples/mpi4py/nonblocking.py checks the whole against Open MPI)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from raps_slurm.mpi import world as world_module
from raps_slurm.mpi.engine import OBJ, Engine
from raps_slurm.mpi.nonblocking import CollRequest
from raps_slurm.mpi.requests import UNDEFINED, Request
from tests.unit.test_mpi import ScriptedRuntime


class _World:
    def __init__(self, e: Engine) -> None:
        self.engine = e


def _schedules(e: Engine) -> tuple[CollRequest, CollRequest]:
    def two_steps() -> Generator[Any, Any, str]:
        yield e.post(0, 1, 100)
        e.send(1, 0, 101, OBJ, b"after the first")  # a step that sends
        yield e.post(0, 1, 102)
        return "first"

    def one_step() -> Generator[Any, Any, str]:
        yield e.post(0, 1, 200)
        return "second"
    comm: Any = object()  # the schedules hold what they use: no communicator needed
    return CollRequest(comm, two_steps()), CollRequest(comm, one_step())


def _run(rt: ScriptedRuntime, monkeypatch: pytest.MonkeyPatch, records: list[bytes] | None,
         script: bool, some: bool = False) -> list[Any]:
    e = Engine(rt)  # type: ignore[arg-type]
    e.load({}, records or [])
    monkeypatch.setattr(world_module, "_world", _World(e))
    reqs = list(_schedules(e))
    seen: list[Any] = []
    for tag in (None, 100, 200):
        if script and tag is not None:
            rt.arrive(1, 0, tag, "x")
        seen.append((Request.Testsome(reqs) if some else Request.Testany(reqs), len(rt.sent)))
    if script:
        rt.arrive(1, 0, 102, "x")
    if some:
        seen.append((Request.Waitsome(reqs), Request.Waitsome(reqs), len(rt.sent)))
    else:
        seen.append((Request.Waitany(reqs), Request.Waitany(reqs), len(rt.sent)))
    return seen


def test_any_over_collectives_records_their_progress_and_replays_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rt = ScriptedRuntime(0, 2)
    seen = _run(rt, monkeypatch, None, script=True)
    # nothing yet; the first collective moved a step (and sent) but did not end; the
    # second ended; the first ends in Waitany, after which none is active
    assert seen == [((UNDEFINED, False), 0), ((UNDEFINED, False), 1), ((1, True), 1),
                    (0, UNDEFINED, 1)]
    # Replay: every message is there from the start, yet each call returns what it
    # returned before, and the step that sends runs in the same call
    replay = ScriptedRuntime(0, 2)
    for tag in (100, 200, 102):
        replay.arrive(1, 0, tag, "x")
    assert _run(replay, monkeypatch, rt.records, script=False) == seen


def test_some_over_collectives_records_their_progress_and_replays_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rt = ScriptedRuntime(0, 2)
    seen = _run(rt, monkeypatch, None, script=True, some=True)
    assert seen == [([], 0), ([], 1), ([1], 1), ([0], None, 1)]
    replay = ScriptedRuntime(0, 2)
    for tag in (100, 200, 102):
        replay.arrive(1, 0, tag, "x")
    assert _run(replay, monkeypatch, rt.records, script=False, some=True) == seen
