"""``raps-run``: starts a RAPS job's ranks, one job step each, and follows their recoveries.

Used in the batch script where ``srun`` would be::

    raps-run [SRUN OPTIONS] -- python app.py ARGS

It asks the local agent (never etcd: it runs as the user, DESIGN.md 4b) for the rank map
the coordinator built for this run of the job, starts each rank as its own step
(``srun -N1 -n1 -w NODE --exact --no-kill``, the user's options passed through) with
``RAPS_JOB``, ``RAPS_RANK``, ``RAPS_SIZE``, ``RAPS_EPOCH`` and the agent socket in its
environment, and then follows the job's recovery plans: when the leader moves a rank to
a spare with a new epoch, raps-run starts it there (it restores and replays on start)
and reports the launch. Its exit code is the application's: 0 once every rank finished,
else the exit code of a rank that failed with no recovery coming.

``SIGUSR1`` (``sbatch --signal=B:USR1@120`` with ``exec raps-run`` in the script) is
forwarded to every rank: the runtime checkpoints at the next ``checkpoint_due()`` and
exits; raps-run then requeues the job, which resumes from those checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import typing
from collections.abc import Sequence
from types import FrameType
from typing import Any

from raps_slurm.config import Config, load_config, node_dir
from raps_slurm.core.launch import (
    FENCED_EXIT,
    PREEMPTED_EXIT,
    Incarnation,
    moves_to_prepare,
    outcome,
    relaunches,
    split_command,
)
from raps_slurm.errors import RapsError, SlurmCommandError
from raps_slurm.runtime.agent_client import AgentError
from raps_slurm.runtime.checkpoint import CheckpointClient
from raps_slurm.slurm import SlurmClient, commands
from raps_slurm.slurm.runner import CommandRunner

POLL_SEC = 0.25


def say(text: str) -> None:
    """One line on stderr (the job's error file), prefixed so it is found among the ranks'."""
    print(f"raps-run: {text}", file=sys.stderr, flush=True)


class Launcher:
    """One raps-run: the steps it started and the plans it followed."""

    def __init__(self, cfg: Config, job: str, run: int, agent: CheckpointClient,
                 slurm: SlurmClient, srun_options: list[str], program: list[str],
                 socket_template: str) -> None:
        self.cfg, self.job, self.run, self.agent, self.slurm = cfg, job, run, agent, slurm
        self.srun_options, self.program = srun_options, program
        self.socket_template = socket_template
        self.size = 0
        self.current: dict[int, Incarnation] = {}
        self.procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
        self.preempted = False
        self.preempt_exit_at: float | None = None  # when the first rank stopped after USR1
        self.from_plan: dict[tuple[int, int], str] = {}  # (rank, epoch) -> plan that started it
        self.plan_state: dict[str, str] = {}  # as the agent last reported
        self.moving: dict[int, int] = {}  # rank -> epoch of its planned move (asked to stop)
        self.not_followed: set[str] = set()  # plans left alone while the job is requeued
        # A rank that failed on a node the detector still calls alive gets this long for
        # a verdict and a plan before raps-run gives up on the job.
        self.grace = 3 * cfg.detection.lease_duration_sec + 2 * cfg.coordinator.cycle_interval_sec

    # -- talking to the agent -----------------------------------------------------

    def _ask(self, op: str, **fields: Any) -> dict[str, Any]:
        reply, _ = self.agent.request({"op": op, "job": self.job, **fields})
        return reply

    def layout(self, timeout: float) -> dict[str, Any]:
        """The rank map of this run, waiting for the coordinator to build it."""
        deadline = time.monotonic() + timeout
        seen: dict[str, Any] = {}
        while time.monotonic() < deadline:
            seen = self._ask("job_layout")
            if seen.get("ready") and seen.get("run") == self.run:
                return seen
            time.sleep(POLL_SEC)
        raise RapsError(f"job {self.job} run {self.run}: no rank map from the coordinator "
                        f"after {timeout:g}s (last answer: {seen}); is raps-coordinator "
                        "running and was the job submitted with --raps?")

    # -- steps -----------------------------------------------------------------------

    def start(self, rank: int, node: str, epoch: int) -> None:
        """Start one rank as its own job step."""
        env = {**os.environ, "RAPS_JOB": self.job, "RAPS_RANK": str(rank),
               "RAPS_SIZE": str(self.size), "RAPS_EPOCH": str(epoch),
               "RAPS_AGENT_SOCKET": self.socket_template}
        argv = commands.srun_rank(node, f"raps-{self.job}-r{rank}e{epoch}", self.srun_options,
                                  self.program)
        self.procs[(rank, epoch)] = self.slurm.runner.spawn(argv, env)
        self.current[rank] = Incarnation(rank, node, epoch)
        say(f"rank {rank} epoch {epoch} started on {node}")

    def poll(self) -> None:
        """Note which newest incarnations exited, and how."""
        for (rank, epoch), proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.procs[(rank, epoch)]
            inc = self.current.get(rank)
            if inc is None or inc.epoch != epoch:
                continue  # an older incarnation ending (fenced, or its srun killed)
            self.current[rank] = Incarnation(rank, inc.node, epoch, code, time.monotonic())
            if code == 0:
                say(f"rank {rank} epoch {epoch} finished")
            elif code == PREEMPTED_EXIT and rank in self.moving and not self.preempted:
                say(f"rank {rank} epoch {epoch} checkpointed and stopped for its move")
                with contextlib.suppress(AgentError):
                    self._ask("recovery_event", rank=rank, epoch=self.moving[rank],
                              phase="checkpointed", detail={"node": inc.node})
            elif code == PREEMPTED_EXIT and self.preempted:
                say(f"rank {rank} epoch {epoch} checkpointed after SIGUSR1 and stopped")
                self.preempt_exit_at = self.preempt_exit_at or time.monotonic()
            elif code == FENCED_EXIT:
                say(f"rank {rank} epoch {epoch} stopped as fenced; waiting up to "
                    f"{self.cfg.recovery.recovery_timeout_sec}s for a newer epoch")
            else:
                say(f"rank {rank} epoch {epoch} on {inc.node} exited with {code}; waiting "
                    f"up to {self.grace:g}s for a recovery plan")
                pid = self.from_plan.get((rank, epoch))
                if pid is not None and self.plan_state.get(pid) == "running":
                    # started by a plan but never restored: the launch itself failed
                    with contextlib.suppress(AgentError):
                        self._ask("recovery_event", rank=rank, epoch=epoch,
                                  phase="launch_failed",
                                  detail={"node": inc.node, "exit_code": code})

    def follow_plans(self) -> bool:
        """Start what new plans say; False when the job was escalated to a requeue."""
        reply = self._ask("job_plans")
        if reply.get("escalated") == self.run:
            return False
        self.plan_state = {str(p["plan_id"]): str(p["state"]) for p in reply.get("plans") or []}
        for rank, epoch in moves_to_prepare(self.current, reply.get("plans") or [], self.run,
                                            self.moving):
            proc = self.procs.get((rank, epoch - 1))
            if proc is not None and proc.poll() is None:
                # The rank saves at its next checkpoint_due() and exits; then the leader
                # starts the move and the rank restores that state on the spare.
                say(f"rank {rank} moves off {self.current[rank].node} (drained for health): "
                    "checkpoint now")
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGUSR1)
                self.moving[rank] = epoch
        todo = relaunches(self.current, reply.get("plans") or [], self.run)
        if todo and self.preempted:
            # Every rank checkpoints and the job is requeued; a rank that stopped after its
            # SIGUSR1 checkpoint while a peer still saves looks hung to the leader. The
            # requeue ends this run, and its plans with it.
            for r in todo:
                if r.plan_id not in self.not_followed:
                    self.not_followed.add(r.plan_id)
                    say(f"plan {r.plan_id}: not followed, the job is being requeued after "
                        "SIGUSR1")
            return True
        if not todo:
            return True
        try:
            nodes = set(self.slurm.job(int(self.job)).nodes)  # never $SLURM_JOB_NODELIST
        except SlurmCommandError as exc:
            say(f"cannot read the job's node list: {exc}")
            nodes = set()
        for r in todo:
            if nodes and r.node not in nodes:
                say(f"plan {r.plan_id}: {r.node} is not in the job's allocation any more; "
                    "waiting for the coordinator")
                continue
            old = self.current[r.rank]
            proc = self.procs.get((r.rank, old.epoch))
            if proc is not None and proc.poll() is None:
                proc.kill()  # the local srun of a rank on a dead or hung node
            say(f"plan {r.plan_id}: rank {r.rank} moves from {old.node} to {r.node}")
            self.start(r.rank, r.node, r.epoch)
            self.from_plan[(r.rank, r.epoch)] = r.plan_id
            with contextlib.suppress(AgentError):
                self._ask("recovery_event", rank=r.rank, epoch=r.epoch, phase="launched",
                          detail={"node": r.node})
        return True

    def preempt(self) -> None:
        """Forward SIGUSR1 to every running step (srun passes it on to the task)."""
        self.preempted = True
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGUSR1)

    def stop_all(self) -> None:
        """Kill every step still running (the job failed)."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def run_job(self, map_timeout: float) -> int:
        """Start every rank, follow recoveries, return the job's exit code."""
        lay = self.layout(map_timeout)
        if lay.get("error"):
            say(f"job {self.job} cannot be mapped: {lay['error']}")
            return 1
        self.size = int(lay["size"])
        nodes = set(self.slurm.job(int(self.job)).nodes)
        missing = sorted({n for _, n, _ in lay["ranks"]} - nodes)
        if missing:
            say(f"the rank map names nodes outside the job's allocation: {', '.join(missing)}")
            return 1
        say(f"job {self.job} run {self.run}: {self.size} ranks, spares "
            f"{','.join(lay.get('spares') or []) or '-'}")
        for rank, node, epoch in lay["ranks"]:
            self.start(int(rank), str(node), int(epoch))
        escalated = False
        while True:
            time.sleep(POLL_SEC)
            self.poll()
            try:
                if not self.follow_plans() and not escalated:
                    escalated = True
                    say("the coordinator escalated this job to a requeue; waiting for Slurm")
            except AgentError as exc:
                say(f"agent: {exc}")  # keep the ranks running; ask again next round
            if self.preempted:
                # A rank waiting for a peer that already stopped cannot reach its own
                # checkpoint: after the grace period it is stopped, and on the next run it
                # restores its previous checkpoint and replays from its peers' logs.
                first = self.preempt_exit_at
                if not self.procs or (first is not None
                                      and time.monotonic() - first >= self.grace):
                    self.stop_all()
                    return self._requeue()
                continue
            o = outcome(self.current, time.monotonic(), self.grace,
                        float(self.cfg.recovery.recovery_timeout_sec))
            if o.done:
                say(f"all {self.size} ranks finished")
                return 0
            if o.failed and not escalated:
                say(f"rank {o.rank} failed with exit code {o.exit_code} and no recovery "
                    "came: stopping the other ranks")
                self.stop_all()
                return o.exit_code

    def _requeue(self) -> int:
        say("every rank checkpointed after SIGUSR1: requeueing the job")
        try:
            self.slurm.requeue(int(self.job))
        except SlurmCommandError as exc:
            say(f"requeue failed: {exc}")
            return 1
        return 0


USAGE = """usage: raps-run [SRUN OPTIONS] -- PROGRAM [ARGS]

Starts each rank of this --raps job as its own job step on the node the coordinator
chose, and relaunches a rank on a spare when its node dies. SRUN OPTIONS (e.g.
--cpus-per-task, --mem, --gres) go to every rank's step. The config comes from
$RAPS_CONFIG, then /etc/raps/raps.yaml."""

MAP_TIMEOUT_SEC = 120.0


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``raps-run``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        sys.exit(0)
    try:
        srun_options, program = split_command(args)
    except ValueError as exc:
        _usage_error(str(exc))
    job = os.environ.get("SLURM_JOB_ID", "")
    if not (job.isascii() and job.isdigit()):
        _usage_error("SLURM_JOB_ID is not set: raps-run runs inside a Slurm job "
                     "(sbatch --raps ...)")
    run_text = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
    if not (run_text.isascii() and run_text.isdigit()):
        _usage_error(f"SLURM_RESTART_COUNT={run_text!r}: expected an integer")
    try:
        cfg = load_config(None)
    except RapsError as exc:
        say(str(exc))
        sys.exit(1)
    template = os.environ.get("RAPS_AGENT_SOCKET") or cfg.agent.socket_path
    here = os.environ.get("SLURMD_NODENAME", "")
    if "%n" in template and not here:
        _usage_error("SLURMD_NODENAME is not set (needed for %n in the agent socket path)")
    agent = CheckpointClient(node_dir(template, here) if "%n" in template else template,
                             job, 0, 1, timeout=30)
    launcher = Launcher(cfg, job, int(run_text), agent, SlurmClient(CommandRunner(timeout=30)),
                        srun_options, program, template)

    def on_usr1(signum: int, frame: FrameType | None) -> None:
        say("SIGUSR1: every rank checkpoints now, then the job is requeued")
        launcher.preempt()

    signal.signal(signal.SIGUSR1, on_usr1)
    try:
        code = launcher.run_job(MAP_TIMEOUT_SEC)
    except (RapsError, AgentError, SlurmCommandError) as exc:
        say(str(exc))
        launcher.stop_all()
        code = 1
    finally:
        agent.close()
    sys.exit(code)


def _usage_error(text: str) -> typing.NoReturn:
    say(text)
    sys.exit(2)
