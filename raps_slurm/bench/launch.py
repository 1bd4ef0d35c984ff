"""``rapsctl bench launch``: raps-run's start of a job against plain ``srun``, side by side
on a private 6-node cluster (``bench.cluster``) brought up for the command.

Both start the same program (``bench/launch_rank.py``) as ``--nodes`` x
``--ranks-per-node`` ranks, each in its own ``sbatch -N<nodes> --no-kill`` job: once as a
``--raps`` job whose batch script execs ``raps-run`` (one step, one node supervisor per
node), once as a plain job whose batch script execs ``srun -N<nodes>
--ntasks-per-node=<ranks>``. The clock starts just before ``sbatch`` (what a user waits
for: Slurm's scheduling and, for a ``--raps`` job, RAPS's PrologSlurmctld and Prolog are
inside it); a rank "runs" when its program's first statement takes the time. The launch
time is the last rank's time minus the submission's. The batch script writes its pid and
the wall-clock time just before its exec, which splits the launch into the start of the
batch script and the launcher's own part. While each job runs, the descendants of the
process the batch script became (raps-run, or srun) are counted every ``SAMPLE_SEC``:
what it holds on the batch host; a sample that cannot be taken is an error, not a zero.
Each repeat runs both jobs (in turn first), the figures are the medians; ``ratio`` is
raps over srun.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from raps_slurm.bench.cluster import private_cluster
from raps_slurm.config import load_file
from raps_slurm.errors import BenchError, RapsError, SlurmCommandError
from raps_slurm.slurm import CommandRunner, commands
from raps_slurm.store import open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until

RANK = Path(__file__).resolve().with_name("launch_rank.py")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
GOAL_RATIO = 1.5  # raps-run may take this much longer than srun to start every rank
GOAL_EXTRA_PROCESSES = 10  # raps-run may hold nodes + this many processes on the batch host
SAMPLE_SEC = 0.05
JOB_SEC = 600.0


def one_line(text: str) -> str:
    """``text`` on one line (a Slurm command's error carries its stderr's lines)."""
    return " / ".join(x.strip() for x in text.splitlines() if x.strip())


class Run(NamedTuple):
    """One job's figures, in seconds from its submission: until the last rank ran
    (``launch_s``), the first (``first_s``) and the batch script's exec (``start_s``);
    ``step_s`` from that exec until a process under it was first seen (raps-run's or
    srun's own start-up)."""

    launch_s: float
    first_s: float
    start_s: float
    step_s: float | None
    processes: int


def launch_times(start: float, stamps: dict[int, float], size: int) -> tuple[float, float]:
    """(last rank's start, first rank's start) minus ``start`` (the submission);
    BenchError naming the ranks that never ran."""
    missing = sorted(set(range(size)) - set(stamps))
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise BenchError(f"{len(missing)} of {size} ranks never ran: {shown}")
    return max(stamps.values()) - start, min(stamps.values()) - start


def sampled_processes(error: str | None, most: int, raps: bool) -> int:
    """The batch host's process count of one job; BenchError if its sampler failed, or
    saw nothing under raps-run (which holds its step's srun while the ranks run)."""
    if error is not None:
        raise BenchError(f"batch-host sample failed: {error}")
    if raps and most == 0:
        raise BenchError("batch-host sample saw no process under raps-run")
    return most


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def summary(nodes: int, ranks_per_node: int, raps: list[Run],
            srun: list[Run]) -> dict[str, Any]:
    """The JSON object of ``bench launch`` from each repeat's runs (not yet the machine's:
    ``python``, ``cpus`` and ``loadavg`` are added by the caller)."""
    raps_s = statistics.median(r.launch_s for r in raps)
    srun_s = statistics.median(r.launch_s for r in srun)
    ratio = raps_s / srun_s if srun_s > 0 else float("inf")
    most = max(r.processes for r in raps)
    bound = nodes + GOAL_EXTRA_PROCESSES
    return {"benchmark": "launch", "nodes": nodes, "ranks_per_node": ranks_per_node,
            "ranks": nodes * ranks_per_node, "repeats": len(raps),
            "raps_launch_s": round(raps_s, 3), "srun_launch_s": round(srun_s, 3),
            "ratio": round(ratio, 2), "batch_host_processes": most,
            "goals": {"ratio_max": GOAL_RATIO, "batch_host_processes_max": bound},
            "goals_met": ratio <= GOAL_RATIO and most <= bound,
            "raps_first_rank_s": _median([r.first_s for r in raps]),
            "srun_first_rank_s": _median([r.first_s for r in srun]),
            # submission -> the batch script's exec: scheduling, and RAPS's prologs
            "raps_batch_start_s": _median([r.start_s for r in raps]),
            "srun_batch_start_s": _median([r.start_s for r in srun]),
            # the batch script's exec -> the last rank: the launcher's own part
            "raps_from_exec_s": _median([r.launch_s - r.start_s for r in raps]),
            "srun_from_exec_s": _median([r.launch_s - r.start_s for r in srun]),
            "raps_step_started_s": _median([r.step_s for r in raps]),
            "srun_batch_host_processes": max(r.processes for r in srun),
            "raps_launch_runs_s": [round(r.launch_s, 3) for r in raps],
            "srun_launch_runs_s": [round(r.launch_s, 3) for r in srun],
            "batch_host_processes_runs": [r.processes for r in raps]}


class Sampler(threading.Thread):
    """The most descendants seen of the process whose pid the batch script wrote;
    ``error`` says why there is no figure (a count of 0 is then not a measurement)."""

    def __init__(self, start_file: Path) -> None:
        super().__init__(daemon=True)
        self.start_file = start_file
        self.most = 0
        self.samples = 0
        self.error: str | None = None
        self.first_seen: float | None = None  # wall clock of the first descendant seen
        self.halt = threading.Event()

    def run(self) -> None:
        pid = 0
        while not pid and not self.halt.wait(0.01):
            with contextlib.suppress(OSError, ValueError, IndexError):
                pid = int(self.start_file.read_text().split()[0])
        if not pid:
            self.error = f"no pid in {self.start_file}: the batch script never ran"
            return
        try:
            proc = psutil.Process(pid)
            while not self.halt.is_set() and proc.status() != psutil.STATUS_ZOMBIE:
                count = len(proc.children(recursive=True))
                if count and self.first_seen is None:
                    self.first_seen = time.time()
                self.most = max(self.most, count)
                self.samples += 1
                self.halt.wait(SAMPLE_SEC)
        except psutil.NoSuchProcess:
            if not self.samples:  # once sampled, it ended between two looks: that is all
                self.error = f"process {pid} ended before it was sampled"
        except psutil.Error as exc:
            self.error = f"cannot sample process {pid}: {exc}"
        if self.samples == 0 and self.error is None:
            self.error = f"process {pid} was never sampled"


class LaunchJob:
    """One job of the benchmark: its batch script, its ranks' time stamps, its end."""

    def __init__(self, cluster: LocalCluster, name: str, nodes: int, ranks_per_node: int,
                 raps: bool) -> None:
        self.cluster, self.name, self.size = cluster, name, nodes * ranks_per_node
        self.run = CommandRunner(timeout=60, env=cluster.env)
        self.dir = cluster.run_dir / "bench-launch" / name
        self.stamps = self.dir / "ranks"
        self.stamps.mkdir(parents=True)
        for d in (self.dir.parent, self.dir, self.stamps):
            d.chmod(0o777)  # the job may run as another user
        self.start_file = self.dir / "start"
        program = f"{sys.executable} {RANK} {self.stamps} {self.size}"
        if raps:
            launcher = f"{Path(sys.executable).parent / 'raps-run'} --"
            sbatch = ["--raps", "--raps-spares=0", f"--raps-ranks-per-node={ranks_per_node}"]
        else:
            # the allocation holds fewer CPUs than ranks, as raps-run's own step does
            launcher = f"srun -N{nodes} --ntasks-per-node={ranks_per_node} --overcommit"
            sbatch = []
        script = self.dir / "job.sh"
        # $EPOCHREALTIME: no fork between the time stamp and the exec
        script.write_text("#!/bin/bash\n"
                          f'echo "$$ $EPOCHREALTIME" > {self.start_file}\n'
                          f"exec {launcher} {program}\n")
        self.out = self.dir / "job.out"
        self.raps = raps
        self.sampler = Sampler(self.start_file)
        self.sampler.start()
        self.submitted = time.time()  # what the user waits from
        self.job = self.run.run(["sbatch", "--parsable", "-o", str(self.out), "-J", name,
                                 f"-N{nodes}", "--no-kill", *sbatch,
                                 str(script)]).strip().split(";")[0]

    def state(self) -> str:
        """The job's state in Slurm; "" while Slurm does not answer (polled again)."""
        try:
            return self.cluster.slurm().job(int(self.job)).state
        except SlurmCommandError:
            return ""

    def finish(self) -> Run:
        """Wait for the job to end; its figures."""
        try:
            state = wait_until(f"job {self.job} ({self.name}) to end", self.state,
                               lambda s: s in FINAL, JOB_SEC, interval=0.2)
        finally:
            self.sampler.halt.set()
            self.sampler.join(5)
        if state != "COMPLETED":
            raise BenchError(f"job {self.job} ({self.name}) ended {state}: "
                             f"{self.tail() or 'no output'}")
        start = float(self.start_file.read_text().split()[1])
        stamps = {int(p.name): float(p.read_text()) for p in self.stamps.iterdir()
                  if p.name.isdigit()}
        try:
            last, first = launch_times(self.submitted, stamps, self.size)
            sampled = sampled_processes(self.sampler.error, self.sampler.most, self.raps)
        except BenchError as exc:
            raise BenchError(f"job {self.job} ({self.name}): {exc}") from None
        seen = self.sampler.first_seen
        return Run(last, first, start - self.submitted,
                   None if seen is None else seen - start, sampled)

    def tail(self) -> str:
        """The job output's last line (what went wrong, usually)."""
        text = self.out.read_text(errors="replace") if self.out.exists() else ""
        lines = [x for x in text.splitlines() if x.strip()]
        return lines[-1] if lines else ""

    def cancel(self) -> None:
        self.sampler.halt.set()
        with contextlib.suppress(SlurmCommandError):
            self.run.run(commands.cancel(int(self.job)))


def measure(cluster: LocalCluster, nodes: int, ranks_per_node: int, repeats: int,
            quiet: bool) -> dict[str, Any]:
    """The repeats on a running cluster with a leading coordinator (the figures only)."""
    raps: list[Run] = []
    srun: list[Run] = []
    for i in range(repeats):
        order = (True, False) if i % 2 == 0 else (False, True)
        for with_raps in order:
            kind = "raps" if with_raps else "srun"
            job = LaunchJob(cluster, f"{kind}-{i + 1}", nodes, ranks_per_node, with_raps)
            try:
                run = job.finish()
            finally:
                job.cancel()
            (raps if with_raps else srun).append(run)
            if not quiet:
                print(f"repeat {i + 1}: {kind} started {job.size} ranks "
                      f"{run.launch_s:.2f}s after sbatch (the first after "
                      f"{run.first_s:.2f}s, the batch script after {run.start_s:.2f}s), "
                      f"{run.processes} processes under it on the batch host", file=sys.stderr)
    return summary(nodes, ranks_per_node, raps, srun)


def run_launch(nodes: int, ranks_per_node: int, repeats: int, port: int,
               quiet: bool) -> dict[str, Any]:
    """Bring up the cluster and a coordinator, run the repeats, take it all down; the
    JSON object of ``bench launch``, with the machine's load before the cluster came up
    (``loadavg``: what else runs here)."""
    load = [round(x, 2) for x in os.getloadavg()]
    try:
        with private_cluster("raps-bench-launch-", port, 1.0) as cluster:
            cfg = load_file(cluster.config_path)
            store, keys = open_store(cfg.store)
            coordinator = cluster.coordinator("bench").start()
            try:
                wait_until("the coordinator to lead", lambda: store.get(keys.leader()),
                           lambda kv: kv is not None, timeout=30)
                result = measure(cluster, nodes, ranks_per_node, repeats, quiet)
            finally:
                coordinator.stop()
                store.close()
    except (AssertionError, OSError, RapsError) as exc:  # one line, not a traceback
        raise BenchError(one_line(f"bench launch: {exc}")) from None
    return {**result, "python": platform.python_version(), "cpus": os.cpu_count(),
            "loadavg": load}
