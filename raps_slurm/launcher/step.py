"""``raps-run --restart-mode step``: any MPI program as one Slurm step, restarted whole
within the allocation when RAPS finds one of its nodes dead, hung or drained.

The program (C, C++, Fortran, with libraps: docs/c-api.md) runs as ONE step, ``srun
--mpi=pmix --distribution=arbitrary --kill-on-bad-exit=1``, task i on the rank map's node
of rank i (``$SLURM_HOSTFILE``), so its MPI rank is its RAPS rank. raps-run follows the
job's recovery plans as in the default mode, but a plan does not relaunch one rank: it
ends the whole step (srun killed, the step cancelled by number) and starts it again in
the same allocation, the moved ranks on their plans' targets with their new epochs
(``RAPS_EPOCH``, and ``RAPS_EPOCHS`` for the ranks whose epoch differs). Every rank then
restores the newest common generation; a rank whose node is gone gets its chunks from
its backup copies. What decides a move (detection, spares, racks, requeue limits, the
fallback to a requeue when no spare is left) is the coordinator's, as for any RAPS job.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from raps_slurm.config import Config
from raps_slurm.core.launch import (
    Incarnation,
    job_cpus_per_node,
    relaunches,
    step_epochs,
    step_hostfile,
    step_overcommit,
)
from raps_slurm.errors import SlurmCommandError
from raps_slurm.launcher.layout import POLL_SEC, ask, wait_layout
from raps_slurm.runtime.agent_client import AgentError
from raps_slurm.runtime.checkpoint import CheckpointClient
from raps_slurm.slurm import SlurmClient, commands
from raps_slurm.slurm.runner import kill_step

SETTLE_CYCLES = 1  # leader cycles to wait for the other plans of the same fault


def say(text: str) -> None:
    """One line on stderr (the job's error file)."""
    print(f"raps-run: {text}", file=sys.stderr, flush=True)


class StepLauncher:
    """One raps-run in step mode: the current step, the rank map it runs and its restarts."""

    def __init__(self, cfg: Config, job: str, run: int, agent: CheckpointClient,
                 slurm: SlurmClient, srun_options: list[str], program: list[str],
                 socket_template: str, *, label: bool = False) -> None:
        self.cfg, self.job, self.run, self.agent, self.slurm = cfg, job, run, agent, slurm
        self.srun_options = [*srun_options, *(["--label"] if label else [])]
        self.program, self.socket_template = program, socket_template
        self.allocated = job_cpus_per_node(os.environ.get("SLURM_JOB_CPUS_PER_NODE", ""))
        self.placement: dict[int, tuple[str, int]] = {}  # rank -> (node, epoch)
        self.proc: subprocess.Popen[bytes] | None = None
        self.name = ""
        self.starts = 0
        self.terminated = False
        self._dir = Path(tempfile.mkdtemp(prefix=f"raps-run-{job}-"))
        self._cancels: list[subprocess.Popen[bytes]] = []  # scancels of ended steps
        # A step that ended with a failure on a node still alive: this long for a plan.
        self.grace = 3 * cfg.detection.lease_duration_sec + 2 * cfg.coordinator.cycle_interval_sec

    def _ask(self, op: str, **fields: Any) -> dict[str, Any]:
        return ask(self.agent, op, self.job, **fields)

    def start(self) -> None:
        """Start the step the placement says (task i = rank i on its node)."""
        self.starts += 1
        hostfile = self._dir / f"hosts-{self.starts}"
        hostfile.write_text(step_hostfile(self.placement))
        self.name = f"raps-{self.job}-run{self.run}-step{self.starts}"
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAPS_RANK", "RAPS_EPOCH", "RAPS_EPOCHS")}
        env.update({"SLURM_HOSTFILE": str(hostfile), "RAPS_JOB": self.job,
                    "RAPS_SIZE": str(len(self.placement)),
                    "RAPS_AGENT_SOCKET": self.socket_template,
                    **step_epochs(self.placement)})
        # A restart shares the nodes the cancelled step still holds until Slurm has heard
        # from them all (a dead node's for as long as SlurmdTimeout).
        extra = ["--overlap"] if self.starts > 1 else []
        argv = commands.srun_mpi_step(
            len(self.placement), self.name,
            [*step_overcommit(self.placement, self.allocated), *extra, *self.srun_options],
            self.program)
        self.proc = self.slurm.runner.spawn(argv, env)
        if self.terminated:
            kill_step(self.proc)
        self._tell("started")
        nodes = sorted({n for n, _ in self.placement.values()})
        say(f"step {self.starts}: {len(self.placement)} ranks on {','.join(nodes)}")

    def end_step(self) -> None:
        """Kill the running step everywhere: its srun, then the step by number (its tasks
        on live nodes). Not waited for: a dead node's part of it is listed until Slurm
        marks the node down (``SlurmdTimeout``), and the next step overlaps it."""
        if self.proc is not None:
            kill_step(self.proc)
        try:
            number = self.slurm.steps(int(self.job)).get(self.name)
            if number is not None:
                # Not waited for: slurmctld answers a step cancel only once it has tried
                # every node of the step, a dead one for MessageTimeout (measured: 6 s).
                self._cancels.append(self.slurm.runner.spawn(
                    commands.cancel_step(int(self.job), number), dict(os.environ)))
        except SlurmCommandError as exc:
            say(f"cannot cancel step {self.name}: {exc}")

    def _tell(self, phase: str) -> None:
        """Have the agent stamp this run's step ``stopping`` or ``started``: the leader
        takes no rank's silence between the two for a hang."""
        try:
            self._ask("job_step", run=self.run, phase=phase)
        except AgentError as exc:
            say(f"agent: cannot record the step {phase}: {exc}")

    def incarnations(self) -> dict[int, Incarnation]:
        """The placement as the plan follower reads it."""
        return {r: Incarnation(r, n, e) for r, (n, e) in self.placement.items()}

    def restart(self, plans: list[dict[str, Any]]) -> bool:
        """Restart the step if started plans move ranks; True if it did."""
        todo = relaunches(self.incarnations(), plans, self.run)
        if not todo:
            return False
        try:
            nodes = set(self.slurm.job(int(self.job)).nodes)  # never $SLURM_JOB_NODELIST
        except SlurmCommandError as exc:
            say(f"cannot read the job's node list: {exc}")
            return False
        outside = sorted({r.node for r in todo} - nodes)
        if outside:
            say(f"plans name nodes outside the allocation ({','.join(outside)}); waiting "
                "for the coordinator")
            return False
        # The step cannot go on without the moved ranks: end it now. The plans of one
        # fault (a node's ranks, ranks hung together) start within a cycle or two of
        # each other: one restart for them all, not one per plan.
        self._tell("stopping")
        began = time.monotonic()
        self.end_step()
        ended = time.monotonic() - began
        time.sleep(SETTLE_CYCLES * self.cfg.coordinator.cycle_interval_sec)
        with contextlib.suppress(AgentError):
            more = relaunches(self.incarnations(), self._ask("job_plans").get("plans") or [],
                              self.run)
            todo = [r for r in more if r.node in nodes] or todo
        for r in todo:
            old = self.placement[r.rank][0]
            say(f"plan {r.plan_id}: rank {r.rank} moves from {old} to {r.node} (epoch "
                f"{r.epoch}): restarting the step")
            self.placement[r.rank] = (r.node, r.epoch)
        say(f"step {self.starts} ended in {ended:.2f}s; starting step {self.starts + 1} "
            f"{time.monotonic() - began:.2f}s after the plan")
        self.start()
        for r in todo:
            with contextlib.suppress(AgentError):
                self._ask("recovery_event", rank=r.rank, epoch=r.epoch, phase="launched",
                          detail={"node": r.node, "step": self.name})
        return True

    def run_job(self, map_timeout: float) -> int:
        """Start the step, restart it on plans, return the job's exit code."""
        lay = wait_layout(self.agent, self.job, self.run, map_timeout)
        if lay.get("error"):
            say(f"job {self.job} cannot be mapped: {lay['error']}")
            return 1
        self.placement = {int(r): (str(n), int(e)) for r, n, e in lay["ranks"]}
        nodes = set(self.slurm.job(int(self.job)).nodes)
        missing = sorted({n for n, _ in self.placement.values()} - nodes)
        if missing:
            say(f"the rank map names nodes outside the job's allocation: {', '.join(missing)}")
            return 1
        say(f"job {self.job} run {self.run}: {len(self.placement)} ranks, restart mode step, "
            f"spares {','.join(lay.get('spares') or []) or '-'}")
        self.start()
        return self._follow()

    def _follow(self) -> int:
        failed_at: float | None = None
        escalated = False
        while True:
            time.sleep(POLL_SEC)
            assert self.proc is not None
            code = self.proc.poll()
            try:
                reply = self._ask("job_plans")
            except AgentError as exc:
                say(f"agent: {exc}")
                continue
            if reply.get("gave_up"):
                say(f"RAPS gave up on job {self.job}: {reply['gave_up']}; ending the step")
                self.end_step()
                return 1
            if reply.get("escalated") == self.run:
                if not escalated:
                    escalated = True
                    say("the coordinator escalated this job to a requeue; waiting for Slurm")
                continue
            if self.restart(list(reply.get("plans") or [])):
                failed_at = None
                continue
            if code == 0:
                say(f"all {len(self.placement)} ranks finished")
                return 0
            if code is None:
                continue
            now = time.monotonic()
            if failed_at is None:
                failed_at = now
                say(f"step {self.starts} ended with {code}; waiting up to {self.grace:g}s "
                    "for a recovery plan")
            elif now - failed_at >= self.grace:
                say(f"step {self.starts} ended with {code} and no recovery came")
                return code if code > 0 else 1

    def terminate(self) -> None:
        """Slurm ends this run (SIGTERM): kill the srun at once."""
        self.terminated = True
        if self.proc is not None:
            kill_step(self.proc)

    def close(self) -> None:
        """Let the step cancels finish (10 s at most), remove the host files."""
        deadline = time.monotonic() + 10
        for proc in self._cancels:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        for f in self._dir.glob("hosts-*"):
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._dir.rmdir()
