"""What ``raps-run`` decides, without doing it: which srun options it takes from the user,
which ranks to (re)start where, and when the job has finished or failed. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from raps_slurm.core import srun_options

# raps-run places every rank itself (one step per rank, one task, one node): these srun
# options (long names; srun's short forms and prefixes too, core/srun_options.py) would
# contradict it. Everything else (--cpus-per-task, --mem, --gres, ...) passes through.
OWN_OPTIONS = ("nodes", "ntasks", "nodelist", "exclude", "ntasks-per-node", "relative",
               "jobid", "kill-on-bad-exit", "exact", "no-kill", "multi-prog", "job-name")

# raps-run's own flags among the srun options: --mpi4py, and -l/--label, which srun would
# apply to the supervisors' tasks (one per node) where the user means the ranks.
RUN_FLAGS = ("mpi4py", "label")

# A rank that was fenced (its epoch superseded) exits with this code (EX_TEMPFAIL).
FENCED_EXIT = 75
# A rank exits with this code after the checkpoint a SIGUSR1 asked for (preemption).
PREEMPTED_EXIT = 85
# A rank exits with this code when its agent found none of its checkpoint generations
# whole (EX_IOERR): no relaunch on another spare can restore it (docs/recovery.md).
LOST_EXIT = 74


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[SRUN OPTIONS] -- PROGRAM ARGS`` -> (options, program); ValueError naming the
    problem: no ``--``, no program, or an option raps-run sets itself."""
    args = list(argv)
    if "--" not in args:
        raise ValueError("usage: raps-run [SRUN OPTIONS] -- PROGRAM [ARGS]: '--' is missing")
    cut = args.index("--")
    options, program = args[:cut], args[cut + 1:]
    if not program:
        raise ValueError("usage: raps-run [SRUN OPTIONS] -- PROGRAM [ARGS]: no program "
                         "after '--'")
    for group in srun_options.parse(options, RUN_FLAGS):
        for opt in group.options:
            if opt.name in OWN_OPTIONS:
                raise ValueError(
                    f"srun option {' '.join(group.words)!r}: raps-run sets --{opt.name} "
                    "itself (one step per rank on the node the coordinator chose); pass "
                    "options such as --cpus-per-task, --mem, --gres")
            if opt.name is None and not group.words[0].startswith("-"):
                raise ValueError(f"{group.words[0]!r}: srun options come before '--' and "
                                 "start with '-'")
    return options, program


def run_flags(options: Sequence[str]) -> tuple[set[str], list[str]]:
    """raps-run's own flags among ``options`` (names in :data:`RUN_FLAGS`) and the
    options left for srun (``-lK`` leaves ``--kill-on-bad-exit``)."""
    groups = srun_options.parse(options, RUN_FLAGS)
    taken = {o.name for g in groups for o in g.options if o.name in RUN_FLAGS}
    return {str(n) for n in taken}, srun_options.unparse(groups, set(RUN_FLAGS))


@dataclass(frozen=True)
class Incarnation:
    """One start of one rank: where, with which epoch, and how it ended (None: running).

    ``node_failed``: it ended unable to reach its node's agent, a failure of the node
    that the node's DEAD verdict and a move to a spare mend, not of the program."""

    rank: int
    node: str
    epoch: int
    exit_code: int | None = None
    exited_at: float | None = None
    node_failed: bool = False


@dataclass(frozen=True)
class Relaunch:
    """Start ``rank`` on ``node`` with ``epoch`` (what a recovery plan says)."""

    rank: int
    node: str
    epoch: int
    plan_id: str


STARTED = ("running", "restored", "done")


def relaunches(current: Mapping[int, Incarnation], plans: Iterable[Mapping[str, object]],
               run: int) -> list[Relaunch]:
    """Ranks whose newest started plan of this run gives an epoch above the one running."""
    best: dict[int, Relaunch] = {}
    for p in plans:
        if p.get("run") != run or p.get("state") not in STARTED:
            continue
        rank, epoch = int(p["rank"]), int(p["epoch"])  # type: ignore[call-overload]
        now = current.get(rank)
        if now is None or epoch <= now.epoch:
            continue
        if rank not in best or epoch > best[rank].epoch:
            best[rank] = Relaunch(rank, str(p["target"]), epoch, str(p["plan_id"]))
    return [best[r] for r in sorted(best)]


def moves_to_prepare(current: Mapping[int, Incarnation], plans: Iterable[Mapping[str, object]],
                     run: int, asked: Iterable[int]) -> list[tuple[int, int]]:
    """(rank, plan epoch) of queued ``planned`` moves whose rank runs the epoch before, is
    alive and was not asked yet: raps-run has it checkpoint and stop (SIGUSR1)."""
    done = set(asked)
    out = []
    for p in plans:
        if p.get("run") != run or p.get("state") != "queued" or not p.get("planned"):
            continue
        rank, epoch = int(p["rank"]), int(p["epoch"])  # type: ignore[call-overload]
        now = current.get(rank)
        if now is None or now.exit_code is not None or now.epoch != epoch - 1 or rank in done:
            continue
        out.append((rank, epoch))
    return sorted(out)


@dataclass(frozen=True)
class Outcome:
    """``done``: every rank finished 0; ``failed``: a rank failed and no recovery came
    within the grace period (``rank``, ``exit_code``); otherwise keep going."""

    done: bool = False
    failed: bool = False
    rank: int | None = None
    exit_code: int = 0


def outcome(current: Mapping[int, Incarnation], now: float, grace: float,
            fenced_grace: float | None = None, node_grace: float | None = None) -> Outcome:
    """The job's state from each rank's newest incarnation.

    A rank that stopped itself as fenced (exit 75) while no newer epoch took over lost
    its agent's word under load, not its program: it is waited for ``fenced_grace`` (the
    leader's HUNG verdict and plan come slower than a dead node's). One that could not
    reach its node's agent (``node_failed``) is waited for ``node_grace``: the move
    follows the node's DEAD verdict, which a silent agent is given within the detector's
    miss window, and the plan may wait its turn under the bound on recoveries."""
    if current and all(i.exit_code == 0 for i in current.values()):
        return Outcome(done=True)
    for rank in sorted(current):
        inc = current[rank]
        if inc.exit_code in (None, 0) or inc.exited_at is None:
            continue
        wait = grace
        if inc.exit_code == FENCED_EXIT and fenced_grace is not None:
            wait = fenced_grace
        elif inc.node_failed and node_grace is not None:
            wait = node_grace
        if now - inc.exited_at >= wait:
            return Outcome(failed=True, rank=rank, exit_code=inc.exit_code or 1)
    return Outcome()


# --- node supervisors -------------------------------------------------------------------

def cpus_per_rank(options: Sequence[str]) -> tuple[int, list[str]]:
    """(the user's ``--cpus-per-task``/``-c``, default 1; the other options): raps-run
    asks for it times the node's ranks per supervisor task, so it takes it out of what
    passes to the step. ValueError for a value that is not a positive integer."""
    groups = srun_options.parse(options, RUN_FLAGS)
    cpus = 1
    for opt in (o for g in groups for o in g.options if o.name == "cpus-per-task"):
        value = opt.value or ""
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise ValueError(f"--cpus-per-task={value!r}: expected an integer >= 1")
        cpus = int(value)
    return cpus, srun_options.unparse(groups, {"cpus-per-task"})


def job_cpus_per_node(text: str) -> list[int]:
    """``SLURM_JOB_CPUS_PER_NODE`` (``2(x3),1``) as one count per node; [] if unreadable."""
    out: list[int] = []
    for part in (p for p in text.split(",") if p):
        count, _, rep = part.partition("(x")
        if not count.isdigit() or (rep and not rep.rstrip(")").isdigit()):
            return []
        out += [int(count)] * (int(rep.rstrip(")")) if rep else 1)
    return out


def step_cpu_options(per_rank: int, ranks: int, allocated: Sequence[int]) -> list[str]:
    """CPU options of a supervisor task that runs ``ranks`` ranks of ``per_rank`` CPUs:
    ask for all of them when every node of the job holds that many, else overcommit (the
    step then starts whatever the node holds; the supervisor shares out what it got)."""
    want = per_rank * max(ranks, 1)
    if allocated and min(allocated) >= want:
        return [f"--cpus-per-task={want}"]
    return ["--overcommit"]


def cpu_share(cpus: Sequence[int], slot: int, slots: int) -> list[int]:
    """The CPUs of rank slot ``slot`` of ``slots`` on a node whose supervisor holds
    ``cpus``: an even, contiguous share (the first slots one more when it does not
    divide), or, with fewer CPUs than slots, one CPU shared round-robin."""
    ordered = sorted(cpus)
    n = len(ordered)
    if n == 0 or slots < 1 or slot < 0:
        raise ValueError(f"slot {slot} of {slots} over {n} CPUs")
    if slots > n:
        return [ordered[slot % n]]
    base, extra = divmod(n, slots)
    slot %= slots
    first = slot * base + min(slot, extra)
    return ordered[first:first + base + (1 if slot < extra else 0)]


def node_slots(ranks: Iterable[tuple[int, str]]) -> dict[int, tuple[str, int, int]]:
    """rank -> (node, slot, slots on that node) for ``(rank, node)`` pairs: a node's
    ranks take slots in rank order."""
    by_node: dict[str, list[int]] = {}
    for rank, node in sorted(ranks):
        by_node.setdefault(node, []).append(rank)
    return {r: (node, i, len(rs)) for node, rs in by_node.items() for i, r in enumerate(rs)}


def free_slot(used: Iterable[int], slots: int) -> int:
    """The lowest slot below ``slots`` not in ``used`` (the next one round-robin when all
    are taken)."""
    taken = set(used)
    for s in range(max(slots, 1)):
        if s not in taken:
            return s
    return len(taken) % max(slots, 1)


def by_target(todo: Iterable[Relaunch]) -> dict[str, list[Relaunch]]:
    """Relaunches grouped by target node (one supervisor step per node), ranks in order."""
    out: dict[str, list[Relaunch]] = {}
    for r in sorted(todo, key=lambda r: (r.node, r.rank)):
        out.setdefault(r.node, []).append(r)
    return out


def hash_seed(env: Mapping[str, str], job: str) -> dict[str, str]:
    """``PYTHONHASHSEED`` for a rank of ``job``, unless the user set one: the same for every
    incarnation of every rank of the job. Python randomizes the hash of ``str`` per
    process, which orders a ``set`` of strings differently in a relaunched rank: it would
    pickle such a set into other bytes, and its peers would refuse it as not
    deterministic."""
    if "PYTHONHASHSEED" in env:
        return {}
    seed = 0
    for ch in job.encode():
        seed = (seed * 131 + ch) % 4294967295  # PYTHONHASHSEED is 0..4294967295
    return {"PYTHONHASHSEED": str(seed)}


HUGE_HEAP = "glibc.malloc.hugetlb=1"


def heap_tunables(env: Mapping[str, str]) -> dict[str, str]:
    """``GLIBC_TUNABLES`` for a rank: glibc's heap grows in transparent huge pages
    (``glibc.malloc.hugetlb=1``, glibc 2.35 on; older ones ignore it), unless the user's
    tunables say otherwise. A logged small message's copy stays on the heap until a
    checkpoint covers it, so the heap grows by every message sent: in 4 KiB pages, each
    new page was a fault on the message's path (one per 4 KiB message on the project's
    test machine). The user's own ``glibc.malloc.hugetlb`` (``=0`` turns this off) is
    kept as it is."""
    have = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in have:
        return {}
    return {"GLIBC_TUNABLES": f"{have}:{HUGE_HEAP}" if have else HUGE_HEAP}


RESTART_MODES = ("ranks", "step")


def restart_mode(options: Sequence[str]) -> tuple[str, list[str]]:
    """raps-run's ``--restart-mode MODE`` (or ``=MODE``) among ``options`` -> (mode, the
    other options); ``ranks`` when absent. ValueError naming the value and what is allowed."""
    rest: list[str] = []
    mode = "ranks"
    i = 0
    while i < len(options):
        word = options[i]
        i += 1
        if word == "--restart-mode" or word.startswith("--restart-mode="):
            if "=" in word:
                value = word.partition("=")[2]
            elif i < len(options):
                value, i = options[i], i + 1
            else:
                raise ValueError("--restart-mode needs a value: ranks or step")
            if value not in RESTART_MODES:
                raise ValueError(f"--restart-mode {value!r}: expected ranks or step")
            mode = value
        else:
            rest.append(word)
    return mode, rest


def step_hostfile(placement: Mapping[int, tuple[str, int]]) -> str:
    """``$SLURM_HOSTFILE`` of a step whose task i is rank i: one node per line, in rank
    order. ValueError if the ranks are not 0..size-1."""
    if sorted(placement) != list(range(len(placement))):
        raise ValueError(f"ranks {sorted(placement)[:8]}... are not 0..{len(placement) - 1}")
    return "".join(f"{placement[r][0]}\n" for r in range(len(placement)))


def step_epochs(placement: Mapping[int, tuple[str, int]]) -> dict[str, str]:
    """The epochs of one step's tasks, which srun all give the same environment:
    ``RAPS_EPOCH`` the most common, ``RAPS_EPOCHS`` ``RANK=EPOCH`` for the others (ranks a
    plan moved), so that the variable grows with the moves, not with the ranks."""
    counts: dict[int, int] = {}
    for _, epoch in placement.values():
        counts[epoch] = counts.get(epoch, 0) + 1
    base = max(sorted(counts), key=lambda e: counts[e]) if counts else 1
    moved = ",".join(f"{r}={e}" for r, (_, e) in sorted(placement.items()) if e != base)
    return {"RAPS_EPOCH": str(base), "RAPS_EPOCHS": moved}


def step_overcommit(placement: Mapping[int, tuple[str, int]], allocated: Sequence[int]
                    ) -> list[str]:
    """``--overcommit`` when a node runs more ranks than the CPUs every node of the job
    holds (Slurm would refuse the step), else nothing."""
    per_node: dict[str, int] = {}
    for node, _ in placement.values():
        per_node[node] = per_node.get(node, 0) + 1
    most = max(per_node.values(), default=0)
    return [] if allocated and min(allocated) >= most else ["--overcommit"]
