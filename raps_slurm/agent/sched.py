"""What the kernel's scheduler says about a local rank: one :class:`SchedSample` of it, read
from ``/proc/PID/task/*/schedstat`` and ``/proc/PID/stat``, and the relay's view of which
ranks to report (:class:`RankLiveness`); the decisions are :mod:`raps_slurm.core.liveness`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

from raps_slurm.agent.local_api import RankInfo
from raps_slurm.core.liveness import SchedSample, active_between, waited_ms
from raps_slurm.wire.heartbeat import RankProgress

log = logging.getLogger("raps.agent")


def _stat(path: Path) -> tuple[str, int] | None:
    """(state letter, start time) from a ``stat`` file; None if unreadable."""
    try:
        text = path.read_bytes()[:4096].decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return fields[0], int(fields[19])


def _schedstat(path: Path) -> tuple[int, int] | None:
    """(ns on the CPU, ns waiting for one) from a ``schedstat`` file; None if unreadable."""
    try:
        fields = path.read_bytes()[:256].split()
    except OSError:
        return None
    if len(fields) < 2 or not (fields[0].isdigit() and fields[1].isdigit()):
        return None
    return int(fields[0]), int(fields[1])


def read_sched(pid: int, proc_root: str | os.PathLike[str] = "/proc",
               now: float | None = None) -> SchedSample | None:
    """One reading of process ``pid``: every thread's CPU and run-delay times summed, the
    main thread's run delay and state; None when the process is gone or the kernel keeps
    no scheduler statistics (``CONFIG_SCHEDSTATS`` off: then nobody is vouched for)."""
    base = Path(proc_root) / str(pid)
    at = time.monotonic() if now is None else now
    head = _stat(base / "stat")
    main = _schedstat(base / "schedstat")
    if head is None or main is None:
        return None
    cpu = wait = 0
    try:
        tids = os.listdir(base / "task")
    except OSError:
        return None
    for tid in tids:
        got = main if tid == str(pid) else _schedstat(base / "task" / tid / "schedstat")
        if got is not None:  # a thread that ended between the listing and the read
            cpu += got[0]
            wait += got[1]
    state, start = head
    return SchedSample(at, start, cpu, wait, main[1], state)


class RankLiveness:
    """Which registered ranks to report, from the agent's own readings of them.

    A rank that heartbeated since the last report is reported; so is a silent one whose
    process was on or waiting for a CPU since the previous reading (its heartbeat thread
    is starved, the rank is not hung). Each entry carries its main thread's run delay.
    """

    def __init__(self, proc_root: str | os.PathLike[str] = "/proc") -> None:
        self.proc_root = proc_root
        self._last: dict[tuple[str, int], tuple[int, SchedSample]] = {}  # key -> (pid, sample)
        self._vouched: set[tuple[str, int]] = set()  # silent ranks reported, for the log

    def entries(self, ranks: Iterable[RankInfo], since: float) -> list[RankProgress]:
        """Entries for ``ranks`` (numeric jobs only): those heartbeated after ``since``
        (server clock) and those silent but alive by the scheduler."""
        out: list[RankProgress] = []
        seen: set[tuple[str, int]] = set()
        for r in ranks:
            if not r.job.isdigit():
                continue
            key = (r.job, r.rank)
            seen.add(key)
            sample = read_sched(r.pid, self.proc_root)
            prev = self._last.get(key)
            if sample is not None:
                self._last[key] = (r.pid, sample)
            else:
                self._last.pop(key, None)
            fresh = r.last_heartbeat_at > since
            alive = prev is not None and prev[0] == r.pid and active_between(prev[1], sample)
            if not fresh and not alive:
                continue
            if fresh:
                self._vouched.discard(key)
            elif key not in self._vouched:
                self._vouched.add(key)
                log.info("rank %d of job %s (pid %d) is silent but runs or waits for a CPU: "
                         "reported as alive (starved, not hung)", r.rank, r.job, r.pid)
            waited = None if sample is None else waited_ms(sample)
            out.append(RankProgress(int(r.job), r.rank, r.step, r.blocked_on, waited))
        for key in set(self._last) - seen:  # unregistered ranks
            del self._last[key]
        self._vouched &= seen
        return out
