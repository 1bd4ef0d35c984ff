"""What the tests read about a ``heat_ring`` job on the local cluster: its failure-free
result, its rank map, checkpoints and plans in etcd, its end in Slurm."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry, RankMap, group_to_json
from raps_slurm.core.planner import Plan
from raps_slurm.errors import SlurmCommandError
from raps_slurm.model import BackupGroup
from raps_slurm.registry import UnknownJob, job_view
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, KeyValue, StateStore
from raps_slurm.testing.cluster import LocalCluster, wait_until

REPO = Path(__file__).resolve().parents[2]
HEAT_RING = REPO / "examples" / "heat_ring.py"
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
# a result line, bare or with srun's --label prefix (the rank, right-aligned, and ": ")
_RESULT = re.compile(r"(?:\s*\d+: )?final ")


# (ranks, unpaced args) -> the failure-free line: the arithmetic depends on nothing else,
# and most tests of a file share their job's shape
_REFERENCES: dict[tuple[int, tuple[str, ...]], str] = {}


def heat_reference(tmp: Path, ranks: int, args: Sequence[str]) -> str:
    """The ``final ...`` line of a failure-free run (the local launcher, same arithmetic).
    Without ``--step-sec``: the pace only, the result does not depend on it, and a slow
    job's reference need not take as long as the job. Run once per process for each
    ranks and arguments (a run takes seconds; the line is the same every time)."""
    key = (ranks, tuple(unpaced(args)))
    if key in _REFERENCES:
        return _REFERENCES[key]
    proc = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", "-n", str(ranks),
                           "--dir", str(tmp / "ref"), "--", sys.executable, str(HEAT_RING),
                           *key[1]], capture_output=True, text=True, timeout=300,
                          check=False)
    if proc.returncode != 0:
        raise AssertionError(f"reference run failed: {proc.stderr[-2000:]}")
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("final ")]
    _REFERENCES[key] = line
    return line


def unpaced(args: Sequence[str]) -> list[str]:
    """``args`` without heat_ring's ``--step-sec SEC`` (or ``--step-sec=SEC``)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--step-sec":
            skip = True
        elif not a.startswith("--step-sec="):
            out.append(a)
    return out

def agent_job(store: StateStore, keys: Keys, nodes: Sequence[str], *, spare: str = "n5",
              backup: str = "n4", owner: int | None = None, user: str = "") -> str:
    """A new job id and what registration writes for it, for tests that start its ranks by
    hand on ``nodes`` (one each, epoch 1): the rank map, each rank's entry and backup
    group, and the job record naming ``owner`` (root without one:
    a user's ranks are served only for a job that names its owner) and every node here
    (a restore takes only records that name nodes of the job)."""
    job = str(500000 + uuid.uuid4().int % 100000)
    every = tuple(dict.fromkeys((*nodes, spare, backup)))
    store.put(keys.job(job), JobRecord(job, 0, 0 if owner is None else owner, every,
                                       JobSpec(spares=1), user=user).to_json())
    store.put(keys.job_map(job), RankMap(job, 0, tuple(nodes), (spare,), 1, 0.0).to_json())
    for r, node in enumerate(nodes):
        store.put(keys.job_rank(job, r), RankEntry(r, node, 1, "running", (spare,)).to_json())
        store.put(keys.job_group(job, r), group_to_json(BackupGroup(r, node, backup, ())))
    return job


def job_view_now(store: StateStore, keys: Keys, job: str) -> dict[str, Any] | None:
    """The job as ``rapsctl show job --json`` shows it (``registry.job_view``, read here
    rather than through a ``rapsctl`` process), or None while it is not registered."""
    try:
        return job_view(store, keys, job)
    except UnknownJob:
        return None


def wait_mapped(store: StateStore, keys: Keys, job: str, run: int = 0,
                timeout: float = 60) -> dict[str, Any]:
    """Wait until run ``run`` of the job is mapped; the job as ``rapsctl show job`` shows it."""
    view = wait_until(f"job {job} run {run} mapped", lambda: job_view_now(store, keys, job),
                      lambda d: d is not None and d["state"] == "mapped"
                      and d["restart_count"] == run, timeout, interval=0.1)
    assert view is not None
    return view

def rank_entries(store: StateStore, keys: Keys, job: str) -> dict[int, RankEntry]:
    """The job's rank map in etcd: rank -> entry (node, epoch)."""
    return {e.rank: e for e in (RankEntry.from_json(kv.key, kv.value)
                                for kv in store.get_prefix(keys.job_ranks_prefix(job)))}


def committed(store: StateStore, keys: Keys, job: str, rank: int) -> list[int]:
    """Generations of a rank copied to its whole group."""
    records = (CkptRecord.from_json(kv.key, kv.value)
               for kv in store.get_prefix(keys.ckpt_prefix(job, rank)))
    return sorted(r.generation for r in records if r.state == "committed")


def job_plans(store: StateStore, keys: Keys, job: str) -> list[Plan]:
    """The job's recovery plans (not their event sub-keys)."""
    prefix = keys.plans_prefix()
    return [Plan.from_json(kv.key, kv.value) for kv in store.get_prefix(keys.job_plans_prefix(job))
            if "/" not in kv.key[len(prefix):]]


def rank_report(store: StateStore, keys: Keys, job: str, kind: str,
                rank: int) -> KeyValue | None:
    """The newest report of ``kind`` (``peers``, ``msgstats``, ``verdicts``) about a rank,
    from whichever node wrote it (``reports/ranks/<node>/``)."""
    found = [kv for kv in store.get_prefix(keys.rank_reports_root())
             if keys.split(kv.key)[3:] == (job, kind, str(rank))]
    return max(found, key=lambda kv: kv.mod_revision, default=None)


def phase_report(store: StateStore, keys: Keys, plan_id: str, phase: str) -> KeyValue | None:
    """A node's report of ``phase`` of a plan (``reports/phases/<node>/``), the first."""
    found = [kv for kv in store.get_prefix(keys.plan_events_prefix())
             if keys.split(kv.key)[3:] == (plan_id, phase)]
    return min(found, key=lambda kv: kv.mod_revision, default=None)


def ended_seeing(cluster: LocalCluster, store: StateStore, keys: Keys, jobs: list[str],
                 timeout: float) -> tuple[dict[str, dict[str, Plan]], dict[str, bytes]]:
    """Wait for every job to end; per job, every plan seen meanwhile as last seen, and
    its escalation record if one was seen (a finished job's keys are purged seconds after
    its end: reading them after ``finish`` races the purge)."""
    plans: dict[str, dict[str, Plan]] = {j: {} for j in jobs}
    escalations: dict[str, bytes] = {}

    def states() -> list[str]:
        for j in jobs:
            plans[j].update((p.plan_id, p) for p in job_plans(store, keys, j))
            kv = store.get(keys.job_escalation(j))
            if kv is not None:
                escalations[j] = kv.value
        return [job_state(cluster, j) for j in jobs]

    wait_until(f"jobs {jobs} to end", states, lambda st: all(x in FINAL for x in st),
               timeout, interval=0.2)
    return plans, escalations


def job_state(cluster: LocalCluster, job: str) -> str:
    """The job's state in Slurm."""
    return cluster.slurm().job(int(job)).state


def last_final(text: str, word: str = "final") -> str | None:
    """The job output's last result line, ``final ...`` (or ``WORD ...``: a program that
    prints its result under another word), labelled or not; None without one: a
    requeued run appends to the same output, and only its last result is the job's."""
    pattern = _RESULT if word == "final" else re.compile(rf"(?:\s*\d+: )?{re.escape(word)} ")
    return next((x for x in reversed(text.splitlines()) if pattern.match(x)), None)


def finish(cluster: LocalCluster, job: str, out: Path, clean: str, timeout: float = 150) -> str:
    """Wait for the job to end; assert it completed and that its last result line (one
    starting with ``clean``'s first word) is the failure-free result ``clean``."""
    wait_until(f"job {job} to end", lambda: job_state(cluster, job), lambda s: s in FINAL,
               timeout)
    text = out.read_text()
    problem = result_problem(job_state(cluster, job), text, clean)
    assert problem is None, f"{problem}: {text[-4000:]}"
    return text


def result_problem(state: str, text: str, clean: str) -> str | None:
    """What is wrong with a job that ended in ``state`` with output ``text``, judged
    against the failure-free line ``clean`` (None: it completed with that result)."""
    if state != "COMPLETED":
        return f"the job ended {state}"
    # the result's own first word (final, tasks, ...), after any --label prefix
    word = re.sub(r"^\s*\d+: ", "", clean).split(" ", 1)[0]
    last = last_final(text, word)
    if last != clean:
        return f"its last {word} line is {last!r}, not {clean!r}"
    return None


def processes() -> Iterator[tuple[int, set[bytes], bytes]]:
    """Every process this host lets us read: (pid, its environment's entries, cmdline)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = set((d / "environ").read_bytes().split(b"\0"))
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        yield int(d.name), env, cmd


def rank_pids(job: str, rank: int, epoch: int) -> list[int]:
    """Processes of one incarnation of a rank, found by the environment raps-run gave it."""
    want = {f"RAPS_JOB={job}".encode(), f"RAPS_RANK={rank}".encode(),
            f"RAPS_EPOCH={epoch}".encode()}
    return [pid for pid, env, cmd in processes()
            if want <= env and b"heat_ring.py" in cmd and not cmd.startswith(b"srun")]


def sruns_of_run(cluster: LocalCluster, job: str, run: int) -> list[int]:
    """srun processes of one run of ``job`` on this cluster still alive (found by the
    environment the batch step gave them: a first run has no SLURM_RESTART_COUNT)."""
    want = {f"SLURM_CONF={cluster.env['SLURM_CONF']}".encode(), f"SLURM_JOB_ID={job}".encode()}
    return [pid for pid, env, cmd in processes()
            if cmd.startswith(b"srun\0") and want <= env
            and next((e.split(b"=", 1)[1] for e in env if e.startswith(b"SLURM_RESTART_COUNT=")),
                     b"0") == str(run).encode()]


def node_dead(store: StateStore, keys: Keys, node: str) -> bool:
    """A DEAD verdict newer than the node's registration (what the leader holds dead)."""
    v, reg = store.get(keys.node_verdict(node)), store.get(keys.node(node))
    return v is not None and b'"DEAD"' in v.value and (
        reg is None or (reg.create_revision or 0) < v.mod_revision)


def back_in_service(cluster: LocalCluster, store: StateStore, keys: Keys, *nodes: str) -> None:
    """Nodes resumed in Slurm (a DEAD verdict drained them), their agents registered again
    and no longer held dead: a later test may pick them as spares."""
    for n in nodes:
        _wait_in_service(cluster, store, keys, n)


@contextmanager
def crashed(cluster: LocalCluster, store: tuple[StateStore, Keys], *nodes: str
            ) -> Iterator[None]:
    """Nodes crashed at once; restarted and back in service when the block ends."""
    for n in nodes:
        cluster.crash(n)
    try:
        yield
    finally:
        for n in nodes:
            cluster.restart(n)
        back_in_service(cluster, *store, *nodes)


def _wait_in_service(cluster: LocalCluster, store: StateStore, keys: Keys, node: str) -> None:
    run = CommandRunner(timeout=60, env=cluster.env)

    def state() -> tuple[str, str]:
        """The node's Slurm state and reason, resumed when drained or down (RESUME refuses
        other states). At every poll, not once: in CI a node stayed drained for 60 s after
        the test ended, with its DEAD verdict's reason. The cause was not found (the
        leader's drain, from a worker thread, landed 14 ms after the verdict when looked
        at); a drain that lands after a RESUME is resumed as well."""
        info = cluster.slurm().node(node)
        if any(x in info.state_text for x in ("DOWN", "DRAIN", "FAIL")):
            with contextlib.suppress(SlurmCommandError):  # a node between states: next poll
                run.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        return info.state_text, info.reason

    state()  # resumed while its agent registers
    wait_until(f"{node}'s agent registered", lambda: store.get(keys.node(node)), bool, 30)
    wait_until(f"{node} back in Slurm", state,
               lambda st: not any(x in st[0] for x in ("DOWN", "DRAIN", "NOT_RESPONDING")),
               60)
    wait_until(f"{node} no longer dead", lambda: node_dead(store, keys, node),
               lambda d: not d, 30)


def system_user(name: str) -> int:
    """The uid of a system user made for tests that need another user (created once,
    kept: useradd is slow, and the name says what it is for)."""
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", name], check=True, capture_output=True)
        return pwd.getpwnam(name).pw_uid


def damage_chunks(chunks: ChunkStore, job: str, digests: Iterable[str] | None = None) -> int:
    """Flip one byte in the middle of each stored chunk of ``job`` in ``digests`` (every
    chunk of the job if None), in place; how many were damaged."""
    hit = 0
    for digest in sorted(chunks.chunks(job) if digests is None else set(digests)):
        loc = chunks.location(job, digest)
        if loc is None:
            continue
        with open(chunks.pack_path(job, loc), "r+b") as f:
            f.seek(loc.offset + loc.stored_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        hit += 1
    return hit
