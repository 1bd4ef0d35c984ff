"""Argv builders and the runner's error handling (the runner runs real processes)."""

from __future__ import annotations

import pytest

from raps_slurm.errors import SlurmCommandError
from raps_slurm.slurm import CommandRunner, commands


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
