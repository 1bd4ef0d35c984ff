"""raps-run's decisions that need no cluster: --mpi4py in the ranks' environment, and a
job RAPS gave up on stopped with the reason in the job's output."""

from __future__ import annotations

from typing import Any

import pytest

from raps_slurm.config import parse_config
from raps_slurm.core.launch import Incarnation
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
    on = launcher(Agent({}), ctl, mpi4py=True)
    assert on.rank_env["PYTHONPATH"].split(":") == [SHIM_DIR, "/opt/app"]
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
