"""Argv builders and the runner's error handling (the runner runs real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm import CommandRunner, commands
from raps_slurm.slurm.runner import kill_step


@pytest.mark.parametrize(("argv", "expected"), [
    (commands.sinfo_nodes(), ["sinfo", "--json"]),
    (commands.scontrol_show_nodes(["n2", "n1", "n3"]), ["scontrol", "-o", "show", "node", "n[1-3]"]),
    (commands.scontrol_show_nodes(), ["scontrol", "-o", "show", "node"]),
    (commands.squeue_jobs([5, 7]), ["squeue", "--json", "--jobs", "5,7"]),
    (commands.squeue_jobs(), ["squeue", "--json"]),
    (commands.scontrol_show_job(42), ["scontrol", "-o", "show", "job", "42"]),
    (commands.drain(["n1", "n2", "n4"], "bad disk"),
     ["scontrol", "update", "NodeName=n[1-2,4]", "State=DRAIN", "Reason=bad disk"]),
    (commands.resume(["n3"]), ["scontrol", "update", "NodeName=n3", "State=RESUME"]),
    (commands.set_weight(["n5"], 100), ["scontrol", "update", "NodeName=n5", "Weight=100"]),
    (commands.requeue(9), ["scontrol", "requeue", "9"]),
    (commands.cancel(9), ["scancel", "9"]),
    (commands.cancel(9, "USR1"), ["scancel", "--signal=USR1", "9"]),
])
def test_argv(argv: list[str], expected: list[str]) -> None:
    assert argv == expected


@pytest.mark.parametrize(("build", "needle"), [
    (lambda: commands.drain(["n1"], "  "), "non-empty reason"),
    (lambda: commands.set_weight(["n1"], -1), "weight must be an integer"),
    (lambda: commands.set_weight(["n1"], True), "weight must be an integer"),
    (lambda: commands.resume([]), "empty node list"),
])
def test_bad_arguments(build: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build()  # type: ignore[operator]


def test_runner_returns_stdout() -> None:
    assert CommandRunner().run(["echo", "hello"]) == "hello\n"


def test_runner_env_is_merged() -> None:
    out = CommandRunner(env={"SLURM_CONF": "/x/slurm.conf"}).run(["sh", "-c", "echo $SLURM_CONF"])
    assert out.strip() == "/x/slurm.conf"


def test_runner_failure_carries_argv_code_stderr() -> None:
    with pytest.raises(SlurmCommandError) as info:
        CommandRunner().run(["sh", "-c", "echo oops >&2; exit 3"])
    e = info.value
    assert (e.returncode, e.stderr.strip(), e.argv[0]) == (3, "oops", "sh")
    assert "exit 3" in str(e) and "oops" in str(e)


def test_runner_missing_binary() -> None:
    with pytest.raises(SlurmCommandError, match="command not found: no-such-slurm-cmd"):
        CommandRunner().run(["no-such-slurm-cmd", "x"])


def test_runner_timeout() -> None:
    with pytest.raises(SlurmCommandError, match=r"timed out after 0\.3s"):
        CommandRunner(timeout=0.3).run(["sleep", "5"])


# An "srun" that forks a helper like srun's shepherd: the helper waits for its parent to
# go (EOF on a pipe) and then "cancels the step" (writes a file), unless told goodbye.
_FAKE_SRUN = """
import os, sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.close(w)
    if os.read(r, 1) == b"":
        open(sys.argv[1], "w").write("step cancelled by number")
    os._exit(0)
os.close(r)
open(sys.argv[2], "w").write(str(os.getpid()))
time.sleep(60)
"""


def _wait_for(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.02)
    raise AssertionError(f"{path} not written")


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def test_kill_step_kills_srun_helpers_first_so_none_cancels_a_step(tmp_path: Path) -> None:
    cancelled, started = tmp_path / "cancelled", tmp_path / "started"
    proc = CommandRunner().spawn([sys.executable, "-c", _FAKE_SRUN, str(cancelled),
                                  str(started)], dict(os.environ))
    _wait_for(started)
    kill_step(proc)
    assert proc.returncode == -signal.SIGKILL
    time.sleep(0.3)
    assert not cancelled.exists()
    kill_step(proc)  # already gone: nothing to do


def test_plain_kill_lets_the_helper_cancel_the_step(tmp_path: Path) -> None:
    """What kill_step avoids (and the fake srun models): srun killed alone."""
    cancelled, started = tmp_path / "cancelled", tmp_path / "started"
    proc = CommandRunner().spawn([sys.executable, "-c", _FAKE_SRUN, str(cancelled),
                                  str(started)], dict(os.environ))
    _wait_for(started)
    proc.kill()
    proc.wait(5)
    assert _wait_for(cancelled) == "step cancelled by number"


def test_a_spawned_srun_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """raps-run killed outright (no SIGTERM handler run): its srun does not linger."""
    started = tmp_path / "started"
    starter = ("import os, sys, time\n"
               "from raps_slurm.slurm import CommandRunner\n"
               "CommandRunner().spawn([sys.executable, '-c', sys.argv[1], '/dev/null',"
               " sys.argv[2]], dict(os.environ))\n"
               "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", starter, _FAKE_SRUN, str(started)])
    try:
        srun = int(_wait_for(started))
        parent.kill()
        parent.wait(5)
        assert _gone(srun), "the srun outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()
