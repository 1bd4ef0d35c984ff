"""``rapsctl bench busy``: false verdicts and hang detection on a saturated machine.

For each setting (``production``: configs/raps.yaml with only the keys the local cluster
needs to run at all taken from configs/test.yaml, ``WIRING``; ``test``: configs/test.yaml
as the tests run it) a private 6-node cluster (scripts/cluster.sh) is brought up and
``examples/heat_ring.py`` runs as a 4-rank ``--raps`` job with 2 spares (``-N6``), three
ways, ``--repeats`` times:

- ``idle_hang``: no load; the last rank spins from step ``--spin-at`` in its first epoch
  (heat_ring's ``--spin-at``: alive, its runtime thread heartbeating, its step frozen, not
  waiting on a peer);
- ``loaded``: no fault, with CPU hogs (``--hogs-per-core`` per usable core) running from
  before the submission until the job ends; the job is given steps enough to last at
  least ``--windows`` of the setting's longest verdict window at its own pace;
- ``loaded_hang``: the spin of ``idle_hang`` under the same hogs.

The hogs start at this process's nice and cgroups (those slurmd hands its tasks); once the
ranks run, each hog is given the nice and the CPU cgroups (cgroup v2, and v1 cpu, cpuacct,
cpuset) of one rank, so that the scheduler weighs them as it weighs the ranks. They are
killed by pid when the run ends, and end on their own if this process dies.

Counted in each run, from the store: HUNG and DEAD verdicts (the failure history the
leader writes for every verdict), the job's recovery plans, the ranks' epochs. The spin's
first HUNG verdict and the first plan of the spinning rank after it are the expected
ones; every other HUNG, every DEAD, every other plan (in place: ``healthy_restarted``,
elsewhere: ``healthy_moved``) is false. An epoch no seen plan explains is counted too.
``hang_detect_s`` runs from the spinning rank's last act, the commit of its checkpoint at
``--spin-at`` (it spins as that call returns), to the verdict's time; both clocks are this
host's. Every run's last ``final`` line is compared with the failure-free result (the
local launcher).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from raps_slurm.bench.cluster import REPO
from raps_slurm.bench.faults import reference
from raps_slurm.config import Config, load_file, to_dict
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.detector import PROGRESS_STRIKES
from raps_slurm.core.history import FailureEvent
from raps_slurm.core.planner import Plan
from raps_slurm.errors import BenchError, RecordError, SlurmCommandError
from raps_slurm.slurm import CommandRunner, commands
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import (
    FINAL,
    HEAT_RING,
    back_in_service,
    job_plans,
    rank_entries,
    rank_pids,
)

SETTINGS = ("production", "test")
RANKS = 4  # issue 44: a 4-node job, one rank a node
SBATCH = ["--raps-spares=2", "-N6", "--open-mode=append"]  # as bench faults: 2 spares
# The keys without which configs/raps.yaml cannot run on the local cluster (every fake
# node is this host), from configs/test.yaml; local_dir and log_dir are then set per run
# dir by scripts/cluster.sh.
WIRING = (("checkpoint", "local_dir"), ("messagelog", "listen_address"),
          ("agent", "transfer_address"), ("coordinator", "metrics_address"),
          ("coordinator", "user_address"), ("hooks", "log_dir"))
# What scripts/cluster.sh writes itself (a second copy in the profile would be a
# duplicate key that overrides it): the store section and these keys.
CLUSTER_WRITES = (("detection", "cluster_key_file"), ("detection", "node_key_file"),
                  ("detection", "transfer_tickets_file"), ("agent", "socket_path"),
                  ("coordinator", "addresses"))
# How long a job may take to be started, and how much slower than its own pace
# (--steps x --step-sec) a run may go on this machine under the hogs, before the run is
# given up: generous bounds for a harness, not figures that are measured.
JOB_START_S, LOAD_SLOWDOWN = 120.0, 10.0
POLL_S = 0.2  # the harness's poll of the store; verdict times come from the records
TAIL_LINES = 8  # of a job that did not complete, its output's last lines are reported
HANG_RATIO_GOAL = 2.0  # issue 44 item 4: a hang found under load within 2 x the idle time
HOG = "import os\nwhile os.getppid() == {parent}:\n    for _ in range(1000000):\n        pass\n"


def production_profile(raps: dict[str, Any], test: dict[str, Any]
                       ) -> tuple[dict[str, Any], dict[str, str]]:
    """configs/raps.yaml's data with ``WIRING`` from configs/test.yaml and without what
    scripts/cluster.sh writes; and where each changed key came from."""
    data = {section: dict(values) for section, values in raps.items()
            if section != "store" and isinstance(values, dict)}
    for section, key in CLUSTER_WRITES:
        data.get(section, {}).pop(key, None)
    sources: dict[str, str] = {}
    for section, key in WIRING:
        data.setdefault(section, {})[key] = test[section][key]
        sources[f"{section}.{key}"] = "configs/test.yaml (local cluster wiring)"
    return data, sources


def key_source(setting: str, section: str, key: str, test: dict[str, Any]) -> str:
    """Where a setting's value of ``section.key`` comes from."""
    if setting == "production":
        if (section, key) in WIRING:
            return "configs/test.yaml (local cluster wiring)"
        if (section, key) in CLUSTER_WRITES or section == "store":
            return "scripts/cluster.sh"
        return "configs/raps.yaml"
    if key in (test.get(section) or {}):
        return "configs/test.yaml"
    if (section, key) in CLUSTER_WRITES or section == "store":
        return "scripts/cluster.sh"
    return "configs/raps.yaml (default; configs/test.yaml leaves it)"


def parameters(setting: str, cfg: Config, test: dict[str, Any]) -> dict[str, Any]:
    """The settings that decide verdicts and waits, as the cluster ran them, with their
    sources."""
    data = to_dict(cfg)
    out: dict[str, Any] = {}
    wanted = [("detection", k) for k in data["detection"] if not k.endswith("_file")]
    wanted += [("messagelog", "recv_timeout_sec"), ("messagelog", "spin_us"),
               ("checkpoint", "interval_sec"), ("recovery", "recovery_timeout_sec"),
               ("coordinator", "cycle_interval_sec"), ("coordinator", "leader_lease_sec")]
    for section, key in wanted:
        out[f"{section}.{key}"] = {"value": data[section][key],
                                   "from": key_source(setting, section, key, test)}
    d = cfg.detection
    out["progress_window_s"] = {
        "value": d.app_progress_timeout_sec or PROGRESS_STRIKES * d.app_heartbeat_interval_sec,
        "from": "detection.app_progress_timeout_sec, or PROGRESS_STRIKES "
                f"({PROGRESS_STRIKES}) x detection.app_heartbeat_interval_sec when 0"}
    return out


def judge(job: str, events: Iterable[FailureEvent], plans: Iterable[Plan],
          epochs: dict[int, int], since: float, until: float,
          hung_rank: int | None = None, hang_from: float | None = None) -> dict[str, Any]:
    """The false verdicts and needless restarts of one run (no node fails in any run).

    ``events``: the failure history (HUNG and DEAD verdicts); those in [since, until]
    count. ``plans``: the job's recovery plans; ``epochs``: the highest epoch seen of each
    rank. With ``hung_rank`` (the rank that hangs from ``hang_from``), its first HUNG
    verdict at or after ``hang_from`` and its first plan after it are expected; every
    other HUNG, every DEAD and every other plan is false."""
    window = sorted((e for e in events if since <= e.at <= until), key=lambda e: e.at)
    true_hung: FailureEvent | None = None
    if hung_rank is not None and hang_from is not None:
        true_hung = next((e for e in window if e.kind == "HUNG"
                          and e.reason == f"{job}.{hung_rank}" and e.at >= hang_from), None)
    mine = sorted((p for p in plans if p.job == job), key=lambda p: (p.created_at, p.epoch))
    expected: Plan | None = None
    if true_hung is not None:
        expected = next((p for p in mine if p.rank == hung_rank
                         and p.created_at >= (hang_from or 0.0)), None)
    others = [p for p in mine if p is not expected]
    top = {r: max((p.epoch for p in mine if p.rank == r), default=1) for r in epochs}
    return {
        "false_hung": len([e for e in window if e.kind == "HUNG" and e is not true_hung]),
        "false_dead": len([e for e in window if e.kind == "DEAD"]),
        "healthy_restarted": len([p for p in others if p.source == p.target]),
        "healthy_moved": len([p for p in others if p.source != p.target]),
        "unexplained_epochs": sum(max(0, e - top[r]) for r, e in epochs.items()),
        "hang_found": true_hung is not None,
        "hang_recovery": None if expected is None else
        ("in place" if expected.source == expected.target else "moved"),
        "verdicts": [{"kind": e.kind, "node": e.node, "about": e.reason,
                      "at_s": round(e.at - since, 2)} for e in window],
        "plans": [{"rank": p.rank, "source": p.source, "target": p.target, "epoch": p.epoch,
                   "state": p.state, "reason": p.reason} for p in mine],
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One setting's figures from its runs, and whether its goals are met: no false
    verdict, no needless restart or move under load, a failure-free result every time,
    and the loaded hang found within twice the idle time."""
    loaded = [r for r in runs if r["kind"] != "idle_hang"]

    def total(key: str, rows: list[dict[str, Any]]) -> int:
        return sum(int(r.get(key) or 0) for r in rows)

    def median(kind: str) -> float | None:
        xs = [r["hang_detect_s"] for r in runs if r["kind"] == kind]
        return None if not xs or None in xs else round(statistics.median(xs), 3)

    out: dict[str, Any] = {k: total(k, loaded) for k in
                           ("false_hung", "false_dead", "healthy_restarted", "healthy_moved",
                            "unexplained_epochs")}
    out["hang_detect_s"], out["hang_detect_idle_s"] = median("loaded_hang"), median("idle_hang")
    idle_rows = [r for r in runs if r["kind"] == "idle_hang"]
    out["idle_false"] = {k: total(k, idle_rows) for k in
                         ("false_hung", "false_dead", "healthy_restarted", "healthy_moved")}
    out["results_ok"] = all(r.get("result") == "same" and r.get("state") == "COMPLETED"
                            and not r.get("restart_count") for r in runs)
    out["errors"] = len([r for r in runs if "error" in r])
    # the load as asked: every hog of every loaded run at a rank's nice and CPU cgroups
    out["hogs_like_ranks"] = all(
        (r.get("hogs_like_ranks") or {}).get("matched") == r["hogs"]
        and (r.get("hogs_like_ranks") or {}).get("same_cgroups") for r in loaded)
    loaded_s, idle_s = out["hang_detect_s"], out["hang_detect_idle_s"]
    out["hang_ratio"] = round(loaded_s / idle_s, 2) if loaded_s and idle_s else None
    out["goals"] = {
        "no_false_verdict": out["false_hung"] == 0 and out["false_dead"] == 0,
        "no_healthy_restart": out["healthy_restarted"] == 0 and out["healthy_moved"] == 0
        and out["unexplained_epochs"] == 0,
        "hang_within_2x_idle": out["hang_ratio"] is not None
        and out["hang_ratio"] <= HANG_RATIO_GOAL,
        "results_ok": out["results_ok"] and out["errors"] == 0,
        "load_as_asked": out["hogs_like_ranks"]}
    out["goals_met"] = all(out["goals"].values())
    return out


def cgroup_dirs(proc_cgroup: str, mountinfo: str) -> list[Path]:
    """The directories of the CPU-deciding cgroups a process is in (``/proc/PID/cgroup``):
    its cgroup v2 one, and its v1 cpu, cpuacct and cpuset ones, where mounted."""
    mounts: list[tuple[set[str] | None, str, str]] = []  # controllers (None: v2), root, dir
    for line in mountinfo.splitlines():
        head, _, tail = line.partition(" - ")
        fields, fs = head.split(), tail.split()  # fs: type, source, super options
        if len(fields) < 5 or len(fs) < 3:
            continue
        if fs[0] == "cgroup2":
            mounts.append((None, fields[3], fields[4]))
        elif fs[0] == "cgroup":
            mounts.append((set(fs[2].split(",")), fields[3], fields[4]))
    out: list[Path] = []
    for line in proc_cgroup.splitlines():
        ident, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        names = set(controllers.split(",")) if controllers else None
        if names is not None and not names & {"cpu", "cpuacct", "cpuset"}:
            continue
        for mounted, root, where in mounts:
            same = (mounted is None) if names is None else (mounted is not None
                                                            and names <= mounted)
            if same and ident.isdigit() and path.startswith(root):
                out.append(Path(where + "/" + path[len(root):].lstrip("/")).resolve())
                break
    return out


class Hogs:
    """CPU hogs, one process each, killed by pid at ``stop``."""

    def __init__(self, count: int) -> None:
        code = HOG.format(parent=os.getpid())
        self.procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                      for _ in range(count)]
        self.like: dict[str, Any] | None = None

    def match(self, ranks: list[int]) -> dict[str, Any]:
        """Give hog i the nice and CPU cgroups of rank process ``ranks[i % len]``."""
        mountinfo = Path("/proc/self/mountinfo").read_text()
        nices: set[int] = set()
        moved, problems = 0, []
        for i, p in enumerate(self.procs):
            rank = ranks[i % len(ranks)]
            try:
                nice = os.getpriority(os.PRIO_PROCESS, rank)
                os.setpriority(os.PRIO_PROCESS, p.pid, nice)
                nices.add(nice)
                for d in cgroup_dirs(Path(f"/proc/{rank}/cgroup").read_text(), mountinfo):
                    (d / "cgroup.procs").write_text(str(p.pid))
                moved += 1
            except OSError as exc:  # the rank ended meanwhile, or a cgroup refused
                problems.append(f"hog {p.pid} like rank pid {rank}: {exc}")
        same = all(self.cgroups(p.pid, mountinfo) == self.cgroups(ranks[i % len(ranks)],
                                                                  mountinfo)
                   for i, p in enumerate(self.procs))
        self.like = {"nice": sorted(nices), "matched": moved, "same_cgroups": same,
                     "problems": problems}
        return self.like

    @staticmethod
    def cgroups(pid: int, mountinfo: str) -> list[Path] | None:
        try:
            return cgroup_dirs(Path(f"/proc/{pid}/cgroup").read_text(), mountinfo)
        except OSError:
            return None

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=30)


class Runner:
    """The runs of one setting on its cluster."""

    def __init__(self, cluster: LocalCluster, store: StateStore, keys: Keys, every: int,
                 step_sec: float, reference: Callable[[int], str],
                 say: Callable[[str], None]) -> None:
        self.cluster, self.store, self.keys, self.say = cluster, store, keys, say
        self.every, self.step_sec, self.reference = every, step_sec, reference
        self.run = CommandRunner(timeout=60, env=cluster.env)
        self.cfg = load_file(cluster.config_path)

    def deadline(self, steps: int, hang: bool) -> float:
        """Seconds a run may take before it is given up (see JOB_START_S)."""
        return JOB_START_S + LOAD_SLOWDOWN * steps * self.step_sec + \
            (2 * verdict_window(self.cfg) + self.cfg.recovery.recovery_timeout_sec
             if hang else 0.0)

    def one(self, kind: str, steps: int, hogs: int, spin_at: int | None) -> dict[str, Any]:
        """One job: submit (hogs first), watch, judge; its record."""
        row: dict[str, Any] = {"kind": kind, "steps": steps, "hogs": hogs}
        args = ["--steps", str(steps), "--every", str(self.every)]
        clean = self.reference(steps)
        limit = self.deadline(steps, spin_at is not None)
        hung = RANKS - 1 if spin_at is not None else None  # heat_ring spins its last rank
        since = time.time()
        load = Hogs(hogs) if hogs else None
        job = ""
        try:
            spin = ["--spin-at", str(spin_at)] if spin_at is not None else []
            job, out = self.cluster.submit_raps_run(
                [sys.executable, str(HEAT_RING), *args, "--step-sec", str(self.step_sec),
                 *spin], SBATCH,
                f"busy-{kind}")
            row["job"] = job
            plans: dict[str, Plan] = {}
            epochs: dict[int, int] = {}
            anchor: float | None = None
            verdict: dict[str, Any] | None = None
            state = "unfinished"
            while time.time() - since < limit:
                for p in job_plans(self.store, self.keys, job):
                    plans[p.plan_id] = p
                for r, e in rank_entries(self.store, self.keys, job).items():
                    epochs[r] = max(e.epoch, epochs.get(r, 0))
                if load is not None and load.like is None and len(epochs) == RANKS:
                    pids = [pid for r in range(RANKS) for pid in rank_pids(job, r, 1)[:1]]
                    if len(pids) == RANKS:
                        row["hogs_like_ranks"] = load.match(pids)
                        row["hogs_like_ranks"]["after_s"] = round(time.time() - since, 1)
                if hung is not None and verdict is None:
                    anchor = self.last_commit(job, hung) or anchor
                    kv = self.store.get(self.keys.job_hung_verdict(job, hung))
                    verdict = None if kv is None else json.loads(kv.value)
                state = self.cluster.slurm().job(int(job)).state
                if state in FINAL:
                    break
                time.sleep(POLL_S)
            until = time.time()
            text = out.read_text(errors="replace") if out.exists() else ""
            finals = [x for x in text.splitlines() if x.startswith("final ")]
            row.update(state=state, restart_count=self.cluster.slurm().job(int(job)).restart_count,
                       result="missing" if not finals else
                       "same" if finals[-1] == clean else "differs",
                       wall_s=round(until - since, 1), epochs=epochs)
            if state != "COMPLETED":  # why, in the job's own last words
                row["last_lines"] = text.splitlines()[-TAIL_LINES:]
            events = self.history()
            row.update(judge(job, events, plans.values(), epochs, since, until, hung, anchor))
            if hung is not None:
                row["hang_detect_s"] = None if verdict is None or anchor is None else \
                    round(float(verdict["at"]) - anchor, 3)
                evidence = (verdict or {}).get("evidence") or {}
                row["hang_evidence"] = {k: evidence.get(k) for k in
                                        ("reason", "stalled_s", "progress_window_s",
                                         "silence_s", "app_window_s") if k in evidence}
        except (BenchError, AssertionError, RecordError, SlurmCommandError, OSError) as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"  # recorded; the other runs go on
        finally:
            if load is not None:
                load.stop()
            if job:
                with contextlib.suppress(SlurmCommandError):
                    self.run.run(commands.cancel(int(job)))
            try:  # a false DEAD verdict drained a node: the next run needs it
                back_in_service(self.cluster, self.store, self.keys, *self.cluster.node_names)
            except AssertionError as exc:
                row["restore_error"] = str(exc)
        self.say(f"  {kind}: job {job} {row.get('state')} result={row.get('result')} "
                 f"false_hung={row.get('false_hung')} false_dead={row.get('false_dead')} "
                 f"restarted={row.get('healthy_restarted')} moved={row.get('healthy_moved')}"
                 f" hang_detect_s={row.get('hang_detect_s')} ({row.get('wall_s')}s)"
                 + (f" error {row['error']}" if "error" in row else ""))
        return row

    def last_commit(self, job: str, rank: int) -> float | None:
        """When the rank's newest first-epoch generation was committed where it saved it:
        its last act before a spin that starts as that checkpoint returns."""
        records = [CkptRecord.from_json(kv.key, kv.value)
                   for kv in self.store.get_prefix(self.keys.ckpt_prefix(job, rank))]
        first = [r for r in records if r.epoch == 1]
        return max(first, key=lambda r: r.generation).committed_at if first else None

    def history(self) -> list[FailureEvent]:
        out = []
        for kv in self.store.get_prefix(self.keys.history_prefix()):
            with contextlib.suppress(RecordError):
                out.append(FailureEvent.from_json(kv.key, kv.value))
        return out


@contextmanager
def setting_cluster(setting: str, port: int) -> Iterator[LocalCluster]:
    """The private 6-node cluster of one setting, in a fresh run dir; always taken down."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"raps-bench-busy-{setting}-"))
    run_dir.chmod(0o755)  # slurmctld runs as SlurmUser
    profile: Path | None = None  # the test setting: configs/test.yaml, cluster.sh's default
    if setting == "production":
        raps = yaml.safe_load((REPO / "configs" / "raps.yaml").read_text())
        test = yaml.safe_load((REPO / "configs" / "test.yaml").read_text())
        data, _ = production_profile(raps, test)
        profile = run_dir / "busy-production.yaml"
        profile.write_text(yaml.safe_dump(data, sort_keys=False))
    cluster = LocalCluster(run_dir, port_base=port, profile=profile)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()
        shutil.rmtree(run_dir, ignore_errors=True)


def code_state() -> dict[str, Any] | None:
    """The commit measured and the files that differed from it (None outside a checkout)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], text=True,
                              capture_output=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"], text=True, capture_output=True,
                               timeout=30, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "modified": [x[3:] for x in dirty]}


def verdict_window(cfg: Config) -> float:
    """The longest a rank or node may go unheard or stand still before a verdict: the
    span in which a false verdict can build up."""
    d = cfg.detection
    return max(d.app_progress_timeout_sec or PROGRESS_STRIKES * d.app_heartbeat_interval_sec,
               d.app_heartbeat_interval_sec * d.app_miss_threshold,
               d.kernel_heartbeat_interval_sec * d.miss_threshold + d.fence_margin_sec)


def measure(setting: str, port: int, opts: dict[str, Any],
            reference: Callable[[int], str], say: Callable[[str], None]) -> dict[str, Any]:
    """One setting: its cluster, a coordinator and its runs; its figures."""
    test = yaml.safe_load((REPO / "configs" / "test.yaml").read_text())
    started = time.monotonic()
    with setting_cluster(setting, port) as cluster:
        coordinator = cluster.coordinator("bench").start()
        cfg = load_file(cluster.config_path)
        store, keys = open_store(cfg.store)
        try:
            d = cfg.detection
            window = d.kernel_heartbeat_interval_sec * d.miss_threshold + d.fence_margin_sec
            wait_until("the coordinator to lead", lambda: store.get(keys.leader()),
                       lambda kv: kv is not None, timeout=60)
            time.sleep(window)  # a new leader gives no verdict within its grace
            runner = Runner(cluster, store, keys, opts["every"], opts["step_sec"], reference,
                            say)
            steps = opts["steps"]
            # the run without a fault lasts at least --windows verdict windows of this
            # setting at the job's own pace (under load it takes longer): a shorter one
            # could not show a false verdict at all
            loaded_steps = max(steps, math.ceil(opts["windows"] * verdict_window(cfg)
                                                / opts["step_sec"]))
            runs: list[dict[str, Any]] = []
            for i in range(opts["repeats"]):
                say(f"{setting}: repeat {i + 1} of {opts['repeats']}")
                runs.append(runner.one("idle_hang", steps, 0, opts["spin_at"]))
                runs.append(runner.one("loaded", loaded_steps, opts["hogs"], None))
                runs.append(runner.one("loaded_hang", steps, opts["hogs"], opts["spin_at"]))
            params = parameters(setting, cfg, test)
            params["verdict_window_s"] = {
                "value": verdict_window(cfg),
                "from": "the longest of the progress window, app_heartbeat_interval_sec x "
                        "app_miss_threshold, and the node miss window with its margin"}
            params["loaded_steps"] = {"value": loaded_steps,
                                      "from": "--steps, or --windows x verdict_window_s / "
                                              "--step-sec if more"}
            return {**summary(runs), "wall_s": round(time.monotonic() - started, 1),
                    "parameters": params, "runs": runs}
        except AssertionError as exc:  # a wait that timed out: one line, not a traceback
            raise BenchError(f"bench busy ({setting}): {exc}") from None
        finally:
            store.close()
            coordinator.stop()


def run_busy(settings: tuple[str, ...], steps: int, step_sec: float, every: int,
             spin_at: int, hogs_per_core: int, repeats: int, windows: float, port: int,
             quiet: bool) -> dict[str, Any]:
    """Every setting in turn (each on its own cluster, one after the other on the same
    ports); the JSON object."""
    def say(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    if spin_at % every or not 0 < spin_at < steps:
        raise BenchError(f"--spin-at {spin_at} must be a multiple of --every {every} below "
                         f"--steps {steps}: the hang's start is the checkpoint at that step")
    cores = len(os.sched_getaffinity(0))
    references: dict[int, str] = {}

    def clean(n: int) -> str:  # the failure-free result of n steps, computed once
        if n not in references:
            with tempfile.TemporaryDirectory(prefix="raps-busy-ref-") as tmp:
                references[n] = reference(Path(tmp), HEAT_RING,
                                          ["--steps", str(n), "--every", str(every)], RANKS)
        return references[n]

    opts = {"steps": steps, "step_sec": step_sec, "every": every, "spin_at": spin_at,
            "repeats": repeats, "windows": windows, "hogs_per_core": hogs_per_core,
            "cores": cores, "hogs": hogs_per_core * cores}
    # SIGTERM (a timeout, an admin) unwinds like an error: hogs killed, clusters down
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        out = _run(settings, opts, port, say, clean)
    finally:
        signal.signal(signal.SIGTERM, previous)
    out["parameters"]["references"] = {
        "value": {str(k): v for k, v in references.items()},
        "from": "the local launcher, no fault, same steps and --every"}
    return out


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _run(settings: tuple[str, ...], opts: dict[str, Any], port: int,
         say: Callable[[str], None], clean: Callable[[int], str]) -> dict[str, Any]:
    started = time.monotonic()
    out: dict[str, Any] = {"benchmark": "busy", "code": code_state(), "settings": {}}
    for setting in settings:
        out["settings"][setting] = measure(setting, port, opts, clean, say)
    out["goals_met"] = all(s["goals_met"] for s in out["settings"].values())
    out["parameters"] = {
        "ranks": {"value": RANKS, "from": "issue 44 item 4 (a 4-node job)"},
        "sbatch": {"value": SBATCH[:2], "from": "as bench faults: 4 working nodes, 2 spares"},
        "cores": {"value": opts["cores"],
                  "from": "os.sched_getaffinity (cores this bench may use)"},
        "hogs_per_core": {"value": opts["hogs_per_core"],
                          "from": "--hogs-per-core (issue 44: 2)"},
        "hogs": {"value": opts["hogs"], "from": "hogs_per_core x cores"},
        "program": {"value": ["examples/heat_ring.py", "--steps", str(opts["steps"]),
                              "--every", str(opts["every"]), "--step-sec",
                              str(opts["step_sec"])],
                    "from": "--steps, --every, --step-sec (the loaded run: loaded_steps)"},
        "windows": {"value": opts["windows"], "from": "--windows (the loaded run's length)"},
        "spin_at": {"value": opts["spin_at"],
                    "from": "--spin-at (the last rank, first epoch)"},
        "repeats": {"value": opts["repeats"], "from": "--repeats"},
        "goal_hang_ratio": {"value": HANG_RATIO_GOAL,
                            "from": "issue 44 item 4 (loaded <= 2 x idle)"},
    }
    out["wall_s"] = round(time.monotonic() - started, 1)
    return out

