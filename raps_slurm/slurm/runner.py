"""The one place a Slurm command is executed: timeout, missing binary and failure handling."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence

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
        """Start a long-running command (a job step) without waiting; its output goes where
        ours goes. SlurmCommandError if it cannot be started."""
        args = list(argv)
        try:
            return subprocess.Popen(args, env={**env, **self.env}, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise SlurmCommandError(
                args, f"command not found: {args[0]} (is Slurm installed and on PATH?)") from None
        except PermissionError:
            raise SlurmCommandError(args, f"permission denied running {args[0]}") from None
