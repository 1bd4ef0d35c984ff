"""The one place a Slurm command is executed: timeout, missing binary and failure handling."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from raps_slurm.errors import SlurmCommandError


class CommandRunner:
    """Runs Slurm commands; raises SlurmCommandError with argv, exit code and stderr.

    ``env`` is merged over the current environment (e.g. ``SLURM_CONF`` of a test cluster).
    """

    def __init__(self, timeout: float = 30.0, env: Mapping[str, str] | None = None) -> None:
        self.timeout = timeout
        self.env = dict(env or {})

    def run(self, argv: Sequence[str], timeout: float | None = None) -> str:
        """Run ``argv`` and return its stdout; any failure becomes SlurmCommandError."""
        args = list(argv)
        limit = self.timeout if timeout is None else timeout
        env = {**os.environ, **self.env} if self.env else None
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=limit,
                                  env=env, stdin=subprocess.DEVNULL, check=False)
        except FileNotFoundError:
            raise SlurmCommandError(
                args, f"command not found: {args[0]} (is Slurm installed and on PATH?)") from None
        except PermissionError:
            raise SlurmCommandError(args, f"permission denied running {args[0]}") from None
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
            raise SlurmCommandError(args, f"timed out after {limit:g}s", None, err) from None
        if proc.returncode != 0:
            raise SlurmCommandError(args, "failed", proc.returncode, proc.stderr)
        return proc.stdout

    def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        """Start a long-running command (a job step's srun) without waiting; its output goes
        where ours goes. It is SIGKILLed by the kernel if this process dies first (Linux's
        parent-death signal, armed for the calling thread: call this from the main one):
        an srun must not outlive the run that started it (see :func:`kill_step`).
        SlurmCommandError if it cannot be started."""
        args = list(argv)
        try:
            return subprocess.Popen(args, env={**env, **self.env}, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent())
        except FileNotFoundError:
            raise SlurmCommandError(
                args, f"command not found: {args[0]} (is Slurm installed and on PATH?)") from None
        except PermissionError:
            raise SlurmCommandError(args, f"permission denied running {args[0]}") from None


def kill_step(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL an srun started by :meth:`CommandRunner.spawn`, its helper processes first.

    srun forks a helper (its "shepherd") that, when srun dies without saying goodbye,
    cancels the step *by its number*; and an srun told to end waits ``KillWait`` + 2 s for
    its tasks, then kills the step by number too. After a requeue, step numbers start
    again at 0: either would cancel the requeued run's step of that number. Killed this
    way (helpers, then srun) none of them sends Slurm anything more; the step itself is
    ended by Slurm, which is ending the job.
    """
    if proc.poll() is not None:
        return
    for child in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux /proc: each thread's ``children``, else every
    process's parent in ``stat``; [] where neither can be read)."""
    try:
        return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    except (OSError, ValueError):
        pass
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(d.name))
    return found


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child SIGKILLed when its parent dies (None where
    prctl is not there). libc is looked up here, before the fork: the child only calls."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)

    return arm
