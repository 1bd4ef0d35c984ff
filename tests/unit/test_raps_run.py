"""raps-run's decisions that need no cluster: --mpi4py in the ranks' environment, a
job RAPS gave up on stopped with the reason in the job's output, and no srun left behind
when Slurm ends the run."""

from __future__ import annotations

import signal
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from raps_slurm.config import parse_config
from raps_slurm.core.launch import Incarnation, hash_seed
from raps_slurm.launcher.control import ControlServer
from raps_slurm.launcher.run import Launcher
from raps_slurm.mpi import SHIM_DIR


class Agent:
    """The agent's answers to raps-run's questions (the agent is not under test)."""

    def __init__(self, plans: dict[str, Any]) -> None:
        self.plans = plans
        self.asked: list[str] = []

    def request(self, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        self.asked.append(str(msg["op"]))
        return dict(self.plans), []


class Rank:
    def __init__(self) -> None:
        self.killed = False

    def poll(self) -> int | None:
        return -9 if self.killed else None

    def kill(self) -> None:
        self.killed = True


def launcher(agent: Agent, ctl: ControlServer, *, mpi4py: bool = False) -> Launcher:
    return Launcher(parse_config({}), "7", 1, agent, None, [], ["true"], "/run/raps/a.sock",  # type: ignore[arg-type]
                    ctl, mpi4py=mpi4py)


@pytest.fixture
def ctl() -> Any:
    c = ControlServer("127.0.0.1")
    yield c
    c.close()


def test_mpi4py_puts_the_shim_first_on_the_ranks_path(ctl: ControlServer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/opt/app")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    on = launcher(Agent({}), ctl, mpi4py=True)
    assert on.rank_env["PYTHONPATH"].split(":") == [SHIM_DIR, "/opt/app"]
    # every rank of job 7, in every incarnation, hashes strings alike, and its heap
    # grows in huge pages
    huge = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert launcher(Agent({}), ctl).rank_env == {**hash_seed({}, "7"), **huge}
    assert hash_seed({}, "7") != {}
    # the user's own reach the ranks as they are
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert launcher(Agent({}), ctl).rank_env == {}


def test_a_job_raps_gave_up_on_stops_its_ranks_and_says_why(
        ctl: ControlServer, capsys: pytest.CaptureFixture[str]) -> None:
    agent = Agent({"ok": True, "plans": [], "escalated": 1,
                   "gave_up": "4 requeues within 3600s (recovery.max_requeues is 3)"})
    run = launcher(agent, ctl)
    run.size = 2
    ranks = {0: Rank(), 1: Rank()}
    for r, proc in ranks.items():
        run.current[r] = Incarnation(r, f"n{r + 1}", 1)
        run.procs[(r, 1)] = proc  # type: ignore[assignment]
    assert run._follow() == 1
    assert all(p.killed for p in ranks.values())
    err = capsys.readouterr().err
    assert "RAPS gave up on job 7: 4 requeues within 3600s" in err
    assert "escalated this job to a requeue" not in err
    assert agent.asked == ["job_plans"]


def test_an_escalation_alone_keeps_waiting_for_slurm(
        ctl: ControlServer, capsys: pytest.CaptureFixture[str]) -> None:
    agent = Agent({"ok": True, "plans": [], "escalated": 1, "gave_up": ""})
    run = launcher(agent, ctl)
    run.size = 1
    run.current[0] = Incarnation(0, "n1", 1)
    proc = Rank()
    run.procs[(0, 1)] = proc  # type: ignore[assignment]
    assert run.follow_plans() is False
    assert run.gave_up == "" and not proc.killed


class Failed:
    """A rank that exited 1, its node's agent found out of reach or not."""

    def __init__(self, agent_lost: bool) -> None:
        self.agent_lost = agent_lost

    def poll(self) -> int:
        return 1


def test_a_rank_that_could_not_reach_its_agent_is_a_failure_of_its_node(
        ctl: ControlServer, capsys: pytest.CaptureFixture[str]) -> None:
    run = launcher(Agent({}), ctl)
    for r, lost in ((0, True), (1, False)):
        run.current[r] = Incarnation(r, "n5", 1)
        run.procs[(r, 1)] = Failed(lost)  # type: ignore[assignment]
    run.poll()
    assert run.current[0].node_failed and not run.current[1].node_failed
    err = capsys.readouterr().err
    assert ("rank 0 epoch 1 on n5 exited with 1: it could not reach its node's agent, a "
            "failure of n5; waiting up to 300s for its move to a spare") in err
    assert "rank 1 epoch 1 on n5 exited with 1; waiting up to" in err


class Runner:
    """Spawns a stand-in for each srun (a sleeping process)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        assert argv[0] == "srun"
        self.procs.append(subprocess.Popen([sys.executable, "-c", "import time; "
                                            "time.sleep(60)"]))
        return self.procs[-1]


def test_sigterm_kills_every_srun_at_once_and_any_started_after(ctl: ControlServer) -> None:
    """Slurm ends the run (a requeue): no srun of it may wait out KillWait and then
    cancel a step by its number, by then the requeued run's."""
    runner = Runner()
    run = launcher(Agent({}), ctl)
    run.slurm = SimpleNamespace(runner=runner)  # type: ignore[assignment]
    run.start_step(["n1", "n2"], 1, "raps-7-run1")
    run.start_step(["n3"], 1, "raps-7-n3-e2")
    try:
        assert all(p.poll() is None for p in runner.procs)
        run.terminate()
        assert [p.returncode for p in runner.procs] == [-signal.SIGKILL] * 2
        run.start_step(["n4"], 1, "raps-7-n4-e3")  # racing the signal
        assert runner.procs[-1].returncode == -signal.SIGKILL
    finally:
        for p in runner.procs:
            if p.poll() is None:
                p.kill()
