"""What both of raps-run's modes ask the node's agent about their job (never etcd)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from raps_slurm.errors import RapsError
from raps_slurm.runtime.checkpoint import CheckpointClient

POLL_SEC = 0.25


def ask(agent: CheckpointClient, op: str, job: str, **fields: Any) -> dict[str, Any]:
    """One request about ``job`` to the agent; its reply (AgentError if refused)."""
    reply, _ = agent.request({"op": op, "job": job, **fields})
    return reply


def wait_layout(agent: CheckpointClient, job: str, run: int, timeout: float) -> dict[str, Any]:
    """The rank map of run ``run`` of ``job``, waiting for the coordinator to build it;
    RapsError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    seen: dict[str, Any] = {}
    while time.monotonic() < deadline:
        seen = ask(agent, "job_layout", job)
        if seen.get("ready") and seen.get("run") == run:
            return seen
        time.sleep(POLL_SEC)
    raise RapsError(f"job {job} run {run}: no rank map from the coordinator "
                    f"after {timeout:g}s (last answer: {seen}); is raps-coordinator "
                    "running and was the job submitted with --raps?")


def on_sigterm(say: Callable[[str], None], what: str, terminate: Callable[[], None]) -> None:
    """Install raps-run's SIGTERM handler (Slurm ends this run): say so, ``terminate``
    (kill the sruns: none may outlive the run), exit 128 + SIGTERM."""
    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say(f"SIGTERM: Slurm ends this run; killing {what}")
        terminate()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
