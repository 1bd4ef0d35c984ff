"""Pure argv builders for every Slurm command raps-slurm runs."""

from __future__ import annotations

from collections.abc import Iterable

from ClusterShell.NodeSet import NodeSet

# Slurm keeps node weights in a uint32 and reserves the top values.
MAX_WEIGHT = 4_294_967_280


def fold(nodes: Iterable[str]) -> str:
    """Fold node names into one Slurm hostlist expression, e.g. ``n[1-4,6]``."""
    names = list(nodes)
    if not names:
        raise ValueError("empty node list")
    return str(NodeSet.fromlist(names))


def sinfo_nodes() -> list[str]:
    """All nodes with state, flags, reason, weight and features (JSON)."""
    return ["sinfo", "--json"]


def scontrol_show_nodes(nodes: Iterable[str] | None = None) -> list[str]:
    """``scontrol -o show node [hostlist]``: one line per node."""
    argv = ["scontrol", "-o", "show", "node"]
    return [*argv, fold(nodes)] if nodes is not None else argv


def squeue_jobs(job_ids: Iterable[int] | None = None) -> list[str]:
    """``squeue --json``, optionally limited to some job ids."""
    argv = ["squeue", "--json"]
    ids = [str(int(j)) for j in job_ids] if job_ids is not None else []
    return [*argv, "--jobs", ",".join(ids)] if ids else argv


def scontrol_show_job(job_id: int) -> list[str]:
    """``scontrol -o show job ID``: the job's current node list, restarts, batch host."""
    return ["scontrol", "-o", "show", "job", str(int(job_id))]


def scontrol_show_topology() -> list[str]:
    """The switch tree from topology.conf."""
    return ["scontrol", "show", "topology"]


def scontrol_show_config() -> list[str]:
    """The running slurmctld's configuration (``Key = Value`` lines)."""
    return ["scontrol", "show", "config"]


def drain(nodes: Iterable[str], reason: str) -> list[str]:
    """Drain nodes; Slurm requires a reason."""
    if not reason.strip():
        raise ValueError("a drain needs a non-empty reason")
    return ["scontrol", "update", f"NodeName={fold(nodes)}", "State=DRAIN", f"Reason={reason}"]


def resume(nodes: Iterable[str]) -> list[str]:
    """Return drained or down nodes to service."""
    return ["scontrol", "update", f"NodeName={fold(nodes)}", "State=RESUME"]


def set_weight(nodes: Iterable[str], weight: int) -> list[str]:
    """Set node scheduling weight (lower weights are filled first)."""
    if isinstance(weight, bool) or not 0 <= weight <= MAX_WEIGHT:
        raise ValueError(f"weight must be an integer 0-{MAX_WEIGHT}, got {weight!r}")
    return ["scontrol", "update", f"NodeName={fold(nodes)}", f"Weight={weight}"]


def requeue(job_id: int) -> list[str]:
    """Requeue a whole batch job."""
    return ["scontrol", "requeue", str(int(job_id))]


def start_now(job_id: int) -> list[str]:
    """Let a pending job start at once (a requeued job otherwise waits out its BeginTime)."""
    return ["scontrol", "update", f"JobId={int(job_id)}", "StartTime=now"]


def update_pending(job_id: int, exclude: Iterable[str] | None,
                   num_nodes: int | None) -> list[str]:
    """Reshape a pending (requeued) job: nodes it must not get (None: leave them; empty:
    none any more), and its node count."""
    argv = ["scontrol", "update", f"JobId={int(job_id)}"]
    if exclude is not None:
        nodes = list(exclude)
        argv.append(f"ExcNodeList={fold(nodes) if nodes else ''}")
    if num_nodes is not None:
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")
        argv.append(f"NumNodes={num_nodes}")
    if len(argv) == 3:
        raise ValueError("update_pending: nothing to change")
    return argv


def cancel(job_id: int, signal: str | None = None) -> list[str]:
    """Cancel a job, or send it a signal when ``signal`` is given."""
    argv = ["scancel"]
    if signal:
        argv += [f"--signal={signal}"]
    return [*argv, str(int(job_id))]


def cancel_step(job_id: int, step: int, signal: str = "KILL") -> list[str]:
    """Signal one step of a job (``JOB.STEP``); SIGKILL by default."""
    return ["scancel", f"--signal={signal}", f"{int(job_id)}.{int(step)}"]


def squeue_steps(job_id: int) -> list[str]:
    """The job's steps, one ``ID NAME`` line each (``JOB.STEP``)."""
    return ["squeue", "--steps", f"--jobs={int(job_id)}", "--noheader", "--format=%i %j"]


def srun_mpi_step(size: int, name: str, options: Iterable[str],
                  program: Iterable[str]) -> list[str]:
    """One MPI step of ``size`` tasks placed by ``$SLURM_HOSTFILE`` (task i on the file's
    line i: the rank map's node of rank i), started by Slurm's PMIx plugin unless
    ``options`` name another ``--mpi``; a task that fails ends the step."""
    opts = list(options)
    mpi = [] if any(o == "--mpi" or o.startswith("--mpi=") for o in opts) else ["--mpi=pmix"]
    if size < 1:
        raise ValueError("an MPI step needs at least one task")
    return ["srun", *mpi, f"--ntasks={size}", "--distribution=arbitrary",
            "--kill-on-bad-exit=1", f"--job-name={name}", *opts, *program]


def srun_rank(node: str, name: str, options: Iterable[str], program: Iterable[str]) -> list[str]:
    """One rank as its own step: one task on ``node``, only the CPUs it asks for, and it
    survives the loss of other nodes (``--no-kill``); ``options`` are the user's."""
    return ["srun", "-N1", "-n1", "-w", node, "--exact", "--no-kill", "--kill-on-bad-exit=0",
            f"--job-name={name}", *options, *program]


def srun_supervisors(nodes: Iterable[str], name: str, cpu_options: Iterable[str],
                     options: Iterable[str], program: Iterable[str]) -> list[str]:
    """One step with one task per node (raps-run's node supervisors): it survives the loss
    of any of its nodes (``--no-kill``, ``--kill-on-bad-exit=0``); ``cpu_options`` size
    each task for all of its node's ranks, ``options`` are the user's."""
    names = sorted(set(nodes))
    if not names:
        raise ValueError("a supervisor step needs at least one node")
    return ["srun", f"--nodes={len(names)}", f"--ntasks={len(names)}", "--ntasks-per-node=1",
            f"--nodelist={fold(names)}", "--no-kill", "--kill-on-bad-exit=0",
            f"--job-name={name}", *cpu_options, *options, *program]
