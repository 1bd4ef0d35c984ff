"""``raps-run``: starts a RAPS job's ranks through one node supervisor per node, and
follows their recoveries.

Used in the batch script where ``srun`` would be::

    raps-run [SRUN OPTIONS] -- python app.py ARGS

It asks the local agent (never etcd: it runs as the user) for the rank map the
coordinator built for this run of the job and starts the job as ONE step over the nodes
that run ranks (``srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1``, the user's
options passed through): one node supervisor per node
(:mod:`raps_slurm.launcher.supervisor`) connects back over the control channel and
starts that node's ranks, each with ``RAPS_JOB``, ``RAPS_RANK``, ``RAPS_SIZE``,
``RAPS_EPOCH`` and the agent socket in its environment, pinned to its share of the
node's CPUs. raps-run then follows the job's recovery plans: ranks that move to a spare
are started there by one new step (one supervisor) per target node; a rank restarted on
its own node (HUNG) is restarted by that node's supervisor, without a new step. The
batch host holds raps-run, one srun for the job's step and one per recovery step,
whatever the rank count. Its exit code is the application's: 0 once every rank
finished, else the exit code of a rank that failed with no recovery coming.

``SIGUSR1`` (``sbatch --signal=B:USR1@120`` with ``exec raps-run`` in the script) is
forwarded to every rank: the runtime checkpoints at the next ``checkpoint_due()`` and
exits; raps-run then requeues the job, which resumes from those checkpoints.

``SIGTERM`` (Slurm ending the job: a requeue, a cancel, the time limit) kills every srun
raps-run started at once, with the helper each forks, and raps-run exits 143: none of
them may outlive this run. Left to wait out ``KillWait`` (an srun whose step had a task on
a dead node does), an srun cancels its step by number, and after a requeue that number
is the requeued run's. An srun is also killed by the kernel if raps-run dies any other
way (:meth:`raps_slurm.slurm.runner.CommandRunner.spawn`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
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
    LOST_EXIT,
    PREEMPTED_EXIT,
    Incarnation,
    Relaunch,
    by_target,
    cpus_per_rank,
    free_slot,
    hash_seed,
    heap_tunables,
    job_cpus_per_node,
    moves_to_prepare,
    node_slots,
    outcome,
    relaunches,
    restart_mode,
    run_flags,
    split_command,
    step_cpu_options,
)
from raps_slurm.errors import RapsError, SlurmCommandError
from raps_slurm.launcher.control import ControlServer, RankHandle
from raps_slurm.launcher.layout import ask, on_sigterm, wait_layout
from raps_slurm.launcher.step import StepLauncher
from raps_slurm.mpi import shim_env
from raps_slurm.runtime.agent_client import AgentError
from raps_slurm.runtime.checkpoint import CheckpointClient
from raps_slurm.slurm import SlurmClient, commands
from raps_slurm.slurm.runner import CommandRunner, kill_step

POLL_SEC = 0.25
# A supervisor whose step still runs but who has not connected after this long: the
# starts waiting for it fail (the node or its slurmd cannot run it).
CONNECT_SEC = 60.0
# After the job, supervisors exit on raps-run's word; their srun gets this long to end.
STEP_END_SEC = 15.0
SUPERVISOR = [sys.executable, "-m", "raps_slurm.launcher.supervisor"]


def say(text: str) -> None:
    """One line on stderr (the job's error file), prefixed so it is found among the ranks'."""
    print(f"raps-run: {text}", file=sys.stderr, flush=True)


def control_host(env: typing.Mapping[str, str]) -> str:
    """The address supervisors on the job's other nodes reach raps-run at:
    ``RAPS_CONTROL_HOST``, else ``SLURM_LAUNCH_NODE_IPADDR``, else this host's name's
    address."""
    for name in ("RAPS_CONTROL_HOST", "SLURM_LAUNCH_NODE_IPADDR"):
        if env.get(name):
            return env[name]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise RapsError(f"cannot resolve this host's name ({exc}): set RAPS_CONTROL_HOST to "
                        "an address the job's nodes reach this one at") from None


class Launcher:
    """One raps-run: the steps it started, the ranks they run and the plans it followed."""

    def __init__(self, cfg: Config, job: str, run: int, agent: CheckpointClient,
                 slurm: SlurmClient, srun_options: list[str], program: list[str],
                 socket_template: str, ctl: ControlServer, *, mpi4py: bool = False,
                 label: bool = False) -> None:
        self.cfg, self.job, self.run, self.agent, self.slurm = cfg, job, run, agent, slurm
        self.label = label  # --label: each line of a rank's output starts with "RANK: "
        # --mpi4py: `from mpi4py import MPI` in the ranks resolves to raps_slurm.mpi
        self.rank_env = shim_env({"PYTHONPATH": os.environ.get("PYTHONPATH", "")}) if mpi4py \
            else {}
        self.rank_env.update(hash_seed(os.environ, job))
        self.rank_env.update(heap_tunables(os.environ))
        self.per_rank, self.srun_options = cpus_per_rank(srun_options)
        self.program = program
        self.socket_template = socket_template
        self.ctl = ctl
        self.allocated = job_cpus_per_node(os.environ.get("SLURM_JOB_CPUS_PER_NODE", ""))
        self.size = 0
        self.current: dict[int, Incarnation] = {}
        self.procs: dict[tuple[int, int], RankHandle] = {}
        self.slot_of: dict[int, tuple[int, int]] = {}  # rank -> (slot, slots) on its node
        self.steps: list[tuple[list[str], subprocess.Popen[bytes]]] = []  # (nodes, srun)
        self.awaiting: dict[str, tuple[subprocess.Popen[bytes], float]] = {}  # not connected
        self.preempted = False
        self.preempt_asked = False  # set by the SIGUSR1 handler, acted on by the loop
        self.preempt_exit_at: float | None = None  # when the first rank stopped after USR1
        self.from_plan: dict[tuple[int, int], str] = {}  # (rank, epoch) -> plan that started it
        self.plan_state: dict[str, str] = {}  # as the agent last reported
        self.moving: dict[int, int] = {}  # rank -> epoch of its planned move (asked to stop)
        self.not_followed: set[str] = set()  # plans left alone while the job is requeued
        self.gave_up = ""  # why the coordinator stopped requeueing this job, once it did
        self.terminated = False  # Slurm is ending this run (SIGTERM): no srun may outlive it
        # A rank that failed on a node the detector still calls alive gets this long for
        # a verdict and a plan before raps-run gives up on the job.
        self.grace = 3 * cfg.detection.lease_duration_sec + 2 * cfg.coordinator.cycle_interval_sec

    # -- talking to the agent -----------------------------------------------------

    def _ask(self, op: str, **fields: Any) -> dict[str, Any]:
        return ask(self.agent, op, self.job, **fields)

    def layout(self, timeout: float) -> dict[str, Any]:
        """The rank map of this run, waiting for the coordinator to build it."""
        return wait_layout(self.agent, self.job, self.run, timeout)

    # -- steps and ranks -------------------------------------------------------------

    def start_step(self, nodes: list[str], ranks_per_node: int, name: str) -> None:
        """One step with a supervisor on each of ``nodes``, sized for ``ranks_per_node``."""
        argv = commands.srun_supervisors(
            nodes, name, step_cpu_options(self.per_rank, ranks_per_node, self.allocated),
            self.srun_options, SUPERVISOR)
        for n in nodes:
            self.ctl.expect(n)
        proc = self.slurm.runner.spawn(argv, {**os.environ, **self.ctl.env()})
        self.steps.append((nodes, proc))
        if self.terminated:
            kill_step(proc)  # SIGTERM came while it started
        now = time.monotonic()
        for n in nodes:
            self.awaiting[n] = (proc, now)

    def start(self, rank: int, node: str, epoch: int, slot: int, slots: int) -> None:
        """Have ``node``'s supervisor start one rank (now, or once it connected)."""
        env = {"RAPS_JOB": self.job, "RAPS_RANK": str(rank), "RAPS_SIZE": str(self.size),
               "RAPS_EPOCH": str(epoch), "RAPS_AGENT_SOCKET": self.socket_template,
               "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(slot),
               "RAPS_LOCAL_SIZE": str(slots),
               "SLURM_NTASKS": str(self.size), **self.rank_env}
        self.procs[(rank, epoch)] = self.ctl.start(node, rank, epoch, self.program, env, slot,
                                                   slots, self.label)
        self.current[rank] = Incarnation(rank, node, epoch)
        self.slot_of[rank] = (slot, slots)
        say(f"rank {rank} epoch {epoch} started on {node}")

    def _check_steps(self) -> None:
        """Starts waiting for a supervisor whose step ended, or that never connected,
        end: the node could not run it."""
        now = time.monotonic()
        for node, (proc, since) in list(self.awaiting.items()):
            if self.ctl.linked(node):
                del self.awaiting[node]
                continue
            code = proc.poll()
            if code is None and now - since < CONNECT_SEC:
                continue
            del self.awaiting[node]
            failed = self.ctl.give_up(node, code if code else 1)
            if failed:
                why = (f"its step ended with {code}" if code is not None
                       else f"it did not connect within {CONNECT_SEC:g}s")
                say(f"no supervisor on {node} ({why}): ranks "
                    f"{', '.join(str(h.rank) for h in failed)} not started")

    def poll(self) -> None:
        """Note which newest incarnations exited, and how."""
        self._check_steps()
        for (rank, epoch), proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.procs[(rank, epoch)]
            inc = self.current.get(rank)
            if inc is None or inc.epoch != epoch:
                continue  # an older incarnation ending (fenced, or killed for a relaunch)
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
            elif code == LOST_EXIT:
                # Not a failed launch: another spare would find the same broken
                # generations. Its agent told the leader, which requeues or gives up.
                say(f"rank {rank} epoch {epoch} on {inc.node} could not be restored (no "
                    "checkpoint generation whole); waiting for the coordinator to requeue "
                    "the job or give up")
            elif code == FENCED_EXIT:
                say(f"rank {rank} epoch {epoch} stopped as fenced; waiting up to "
                    f"{self.cfg.recovery.recovery_timeout_sec}s for a newer epoch")
            elif proc.agent_lost:
                # Its node's agent is gone: the node failed, not the program. Its DEAD
                # verdict moves the node's ranks to a spare; the plan may wait its turn.
                self.current[rank] = Incarnation(rank, inc.node, epoch, code, time.monotonic(),
                                                 node_failed=True)
                say(f"rank {rank} epoch {epoch} on {inc.node} exited with {code}: it could "
                    f"not reach its node's agent, a failure of {inc.node}; waiting up to "
                    f"{self.cfg.recovery.recovery_timeout_sec}s for its move to a spare")
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
        if reply.get("gave_up"):
            self.gave_up = str(reply["gave_up"])
            return False
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
        for target, group in by_target(todo).items():
            if nodes and target not in nodes:
                for r in group:
                    say(f"plan {r.plan_id}: {target} is not in the job's allocation any "
                        "more; waiting for the coordinator")
                continue
            self._relaunch(target, group)
        return True

    def _relaunch(self, target: str, group: list[Relaunch]) -> None:
        """Carry out the plans that start ``group`` on ``target``: through its supervisor
        if one runs there (a rank restarted in place), else one new step for them all."""
        for r in group:
            old = self.current[r.rank]
            proc = self.procs.get((r.rank, old.epoch))
            if proc is not None and proc.poll() is None:
                proc.kill()  # a rank on a dead node, or hung on this one
        reuse = self.ctl.linked(target) or (
            target in self.awaiting and self.awaiting[target][0].poll() is None)
        if not reuse:
            self.start_step([target], len(group), f"raps-{self.job}-{target}-e"
                            f"{max(r.epoch for r in group)}")
        for i, r in enumerate(group):
            old = self.current[r.rank]
            if not reuse:
                slot, slots = i, len(group)
            elif old.node == target:
                slot, slots = self.slot_of.get(r.rank, (0, 1))  # in place: its own CPUs
            else:
                slots = max([k for rk, (_, k) in self.slot_of.items()
                             if self.current[rk].node == target] or [len(group)])
                slot = free_slot((s for rk, (s, _) in self.slot_of.items()
                                  if self.current[rk].node == target
                                  and self.current[rk].exit_code is None), slots)
            say(f"plan {r.plan_id}: rank {r.rank} moves from {old.node} to {r.node}")
            self.start(r.rank, r.node, r.epoch, slot, slots)
            self.from_plan[(r.rank, r.epoch)] = r.plan_id
            with contextlib.suppress(AgentError):
                self._ask("recovery_event", rank=r.rank, epoch=r.epoch, phase="launched",
                          detail={"node": r.node})

    def preempt(self) -> None:
        """Forward SIGUSR1 to every running rank (through its supervisor)."""
        self.preempted = True
        for proc in list(self.procs.values()):
            proc.send_signal(signal.SIGUSR1)

    def stop_all(self) -> None:
        """Kill every rank still running (the job failed)."""
        for proc in list(self.procs.values()):
            proc.kill()

    def terminate(self) -> None:
        """Slurm ends this run (SIGTERM): kill every srun (see the module docstring)."""
        self.terminated = True
        for _, proc in self.steps:
            kill_step(proc)

    def end_steps(self) -> None:
        """Tell every supervisor to exit and let the steps end (killed after a while)."""
        self.ctl.close()
        deadline = time.monotonic() + STEP_END_SEC
        for _, proc in self.steps:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        for _, proc in self.steps:
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)

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
        ranks = [(int(r), str(n), int(e)) for r, n, e in lay["ranks"]]
        slots = node_slots((r, n) for r, n, _ in ranks)
        working = sorted({n for _, n, _ in ranks})
        most = max((k for _, _, k in slots.values()), default=1)
        say(f"job {self.job} run {self.run}: {self.size} ranks on {len(working)} nodes "
            f"(one step, {most} ranks per node at most), spares "
            f"{','.join(lay.get('spares') or []) or '-'}; control at {self.ctl.address}")
        self.start_step(working, most, f"raps-{self.job}-run{self.run}")
        for rank, node, epoch in ranks:
            self.start(rank, node, epoch, slots[rank][1], slots[rank][2])
        return self._follow()

    def _follow(self) -> int:
        escalated = False
        while True:
            time.sleep(POLL_SEC)
            if self.preempt_asked and not self.preempted:
                say("SIGUSR1: every rank checkpoints now, then the job is requeued")
                self.preempt()
            self.poll()
            try:
                if not self.follow_plans() and not escalated and not self.gave_up:
                    escalated = True
                    say("the coordinator escalated this job to a requeue; waiting for Slurm")
            except AgentError as exc:
                say(f"agent: {exc}")  # keep the ranks running; ask again next round
            if self.gave_up:
                # The coordinator cancels the job shortly; say why first, in the job's
                # output, and end with a failure rather than be killed mid-write.
                say(f"RAPS gave up on job {self.job}: {self.gave_up}; stopping every rank")
                self.stop_all()
                return 1
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
            limit = float(self.cfg.recovery.recovery_timeout_sec)
            o = outcome(self.current, time.monotonic(), self.grace, limit, node_grace=limit)
            if o.done:
                say(f"all {self.size} ranks finished")
                return 0
            if o.failed and not escalated:
                inc = self.current.get(o.rank if o.rank is not None else -1)
                say(f"rank {o.rank} failed with exit code {o.exit_code} and no recovery "
                    + (f"of its node {inc.node}, whose agent it could not reach, came "
                       f"within {limit:g}s" if inc is not None and inc.node_failed
                       else "came")
                    + ": stopping the other ranks")
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


USAGE = """usage: raps-run [--mpi4py] [-l|--label] [--restart-mode ranks|step] [SRUN OPTIONS]
                -- PROGRAM [ARGS]

Starts the ranks of this --raps job on the nodes the coordinator chose, as one job
step with one node supervisor per node, and relaunches a node's ranks on a spare when
it dies. SRUN OPTIONS (e.g. --cpus-per-task, --mem, --gres) go to every supervisor
step; --cpus-per-task is per rank. --mpi4py runs an mpi4py program unchanged: its
`from mpi4py import MPI` resolves to raps_slurm.mpi. -l/--label starts each line of a
rank's output with its rank ("3: "). --restart-mode step runs any MPI program (with
libraps) as one `srun --mpi=pmix` step and, when a node is lost, restarts the whole step
on a spare within the allocation, every rank from the newest common checkpoint. The
config comes from $RAPS_CONFIG, then /etc/raps/raps.yaml."""

MAP_TIMEOUT_SEC = 120.0


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``raps-run``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        sys.exit(0)
    try:
        srun_options, program = split_command(args)
        mode, srun_options = restart_mode(srun_options)
        flags, srun_options = run_flags(srun_options)
        cpus_per_rank(srun_options)
        if mode == "step" and "mpi4py" in flags:
            raise ValueError("--mpi4py runs under the default restart mode (ranks), not step")
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
    agent_path = node_dir(template, here) if "%n" in template else template
    if mode == "step":
        _run_step(cfg, job, int(run_text), agent_path, srun_options, program, template,
                  "label" in flags)
    try:
        ctl = ControlServer(control_host(os.environ))
    except (RapsError, OSError) as exc:
        say(f"cannot open the control channel: {exc}")
        sys.exit(1)
    agent = CheckpointClient(agent_path, job, 0, 1, timeout=30)
    launcher = Launcher(cfg, job, int(run_text), agent, SlurmClient(CommandRunner(timeout=30)),
                        srun_options, program, template, ctl, mpi4py="mpi4py" in flags,
                        label="label" in flags)

    def on_usr1(signum: int, frame: FrameType | None) -> None:
        # only a flag: the main loop may be in the middle of a command on the channel
        launcher.preempt_asked = True

    signal.signal(signal.SIGUSR1, on_usr1)
    on_sigterm(say, "its sruns so that none outlives it", launcher.terminate)
    try:
        code = launcher.run_job(MAP_TIMEOUT_SEC)
    except (RapsError, AgentError, SlurmCommandError) as exc:
        say(str(exc))
        launcher.stop_all()
        code = 1
    finally:
        launcher.end_steps()
        agent.close()
    sys.exit(code)


def _run_step(cfg: Config, job: str, run: int, agent_path: str, srun_options: list[str],
              program: list[str], template: str, label: bool) -> typing.NoReturn:
    """raps-run --restart-mode step (:mod:`raps_slurm.launcher.step`)."""
    agent = CheckpointClient(agent_path, job, 0, 1, timeout=30)
    step_launcher = StepLauncher(cfg, job, run, agent, SlurmClient(CommandRunner(timeout=30)),
                                 srun_options, program, template, label=label)

    on_sigterm(say, "its srun", step_launcher.terminate)
    try:
        code = step_launcher.run_job(MAP_TIMEOUT_SEC)
    except (RapsError, AgentError, SlurmCommandError) as exc:
        say(str(exc))
        code = 1
    finally:
        if step_launcher.proc is not None and step_launcher.proc.poll() is None:
            step_launcher.end_step()
        step_launcher.close()
        agent.close()
    sys.exit(code)


def _usage_error(text: str) -> typing.NoReturn:
    say(text)
    sys.exit(2)
