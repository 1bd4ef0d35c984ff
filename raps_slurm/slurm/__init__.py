"""Slurm adapter: pure argv builders and parsers, one runner, and a small client on top."""

from __future__ import annotations

from collections.abc import Iterable

from raps_slurm.model import JobInfo, NodeInfo, Topology
from raps_slurm.slurm import commands, parsers
from raps_slurm.slurm.runner import CommandRunner

__all__ = ["CommandRunner", "SlurmClient", "commands", "parsers"]


class SlurmClient:
    """What raps-slurm asks of Slurm, each call one command through the runner."""

    def __init__(self, runner: CommandRunner | None = None) -> None:
        self.runner = runner or CommandRunner()

    def nodes(self) -> list[NodeInfo]:
        """Every node with its state, flags, reason, weight and features."""
        return parsers.parse_sinfo_json(self.runner.run(commands.sinfo_nodes()))

    def node(self, name: str) -> NodeInfo:
        """One node, read with ``scontrol -o show node``."""
        found = parsers.parse_scontrol_nodes(self.runner.run(commands.scontrol_show_nodes([name])))
        return found[0]

    def jobs(self, job_ids: Iterable[int] | None = None) -> list[JobInfo]:
        """Jobs known to slurmctld (pending, running, recently finished)."""
        return parsers.parse_squeue_json(self.runner.run(commands.squeue_jobs(job_ids)))

    def job(self, job_id: int) -> JobInfo:
        """One job with its current node list (which shrinks when a --no-kill node dies)."""
        return parsers.parse_scontrol_job(self.runner.run(commands.scontrol_show_job(job_id)))

    def topology(self) -> Topology:
        """The switch tree; leaf switches are racks."""
        return parsers.parse_topology(self.runner.run(commands.scontrol_show_topology()))

    def slurm_user(self) -> tuple[str, int | None]:
        """SlurmUser (name, uid) of the running slurmctld."""
        return parsers.slurm_user(parsers.parse_show_config(
            self.runner.run(commands.scontrol_show_config())))

    def drain(self, nodes: Iterable[str], reason: str) -> None:
        """Drain nodes with a reason (running jobs continue, no new work lands)."""
        self.runner.run(commands.drain(nodes, reason))

    def resume(self, nodes: Iterable[str]) -> None:
        """Return nodes to service."""
        self.runner.run(commands.resume(nodes))

    def set_weight(self, nodes: Iterable[str], weight: int) -> None:
        """Set scheduling weight; lost on reconfigure, so owners must re-apply it."""
        self.runner.run(commands.set_weight(nodes, weight))

    def requeue(self, job_id: int) -> None:
        """Requeue a whole batch job."""
        self.runner.run(commands.requeue(job_id))

    def start_now(self, job_id: int) -> None:
        """Let a pending (requeued) job start at once."""
        self.runner.run(commands.start_now(job_id))

    def update_pending(self, job_id: int, exclude: list[str] | None,
                       num_nodes: int | None) -> None:
        """Exclude nodes from a pending job (None: leave its exclusions; empty: clear
        them) and/or change its node count."""
        self.runner.run(commands.update_pending(job_id, exclude, num_nodes))

    def cancel(self, job_id: int, signal: str | None = None) -> None:
        """Cancel a job or signal it."""
        self.runner.run(commands.cancel(job_id, signal))

    def steps(self, job_id: int) -> dict[str, int]:
        """The job's numbered steps that still run: name -> step number."""
        return parsers.parse_steps(self.runner.run(commands.squeue_steps(job_id)), job_id)
