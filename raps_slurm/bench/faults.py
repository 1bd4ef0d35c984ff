"""``rapsctl bench faults``: a seeded fault campaign on a private 6-node cluster
(``bench.cluster``: 3 racks of 2 nodes), brought up once for the campaign.

Each run submits one ``--raps`` job (4 ranks, ``--raps-spares=2 -N6``): alternately
``examples/heat_ring.py`` and ``examples/random_program.py`` (a communication pattern drawn
from a per-run seed). A ``random.Random(seed)`` draws the faults: one combination of
``primary`` (a working node), ``primary+backup`` (a working node and the node holding its
ranks' log backup), ``rack`` (both nodes of a rack) or ``rack+primary`` (a rack and one
more working node); each node is crashed (cgroup kill) or frozen (cgroup freeze, thawed
after a drawn hold, which may or may not outlast detection), at a drawn time after the
first checkpoint of the ranks on the victim nodes is committed on their whole groups.
On a namespace-mode cluster (``--net ns``) a node may also be partitioned: its link cut
while everything on it runs on, healed after a drawn hold (``kinds``: the kinds drawn).
The batch host is never a victim: losing it escalates to a requeue by design.

Three nodes lost on this 6-node cluster leave a job of 4 working nodes and 2 spares
without a spare for one of them: it is requeued, and the requeued run excludes the nodes
that were dead then. Once they are repaired it still cannot start (Slurm's
``BadConstraints``: three nodes left for four): after ``HELD_S`` the harness lifts the
exclusion as an admin would, and records it (``requeue_held``, ``totals.requeues_held``):
a run the harness had to rescue misses the campaign's goal.

Each run is judged against the program's failure-free result (the local launcher):

- ``recovered``: the job COMPLETED with the failure-free ``final`` line and no requeue;
- ``requeued``: Slurm's restart count rose (``requeue_reasons``: the leader's escalation
  reasons, in order, and why it gave up if it did); ``spares_left``: spares of the first
  run not under a DEAD verdict during the run and not taken by a move, so a requeue with
  ``spares_left > 0`` did not lack a spare;
- ``wrong_result``: the job COMPLETED with a ``final`` line other than the failure-free one;
- ``lost_data``: the result is missing: the job ended in another state, completed
  without a ``final`` line, or had not ended by the run's deadline (then cancelled).
  ``result`` says whether a ``final`` line was printed and matched all the same, and
  ``last_word`` is raps-run's last line for a job that did not complete;
- ``healthy_restarted``, ``healthy_moved``: plans that restarted a rank in place, or moved
  it, off a node no fault touched (a false verdict on a healthy rank).

Only the output's last ``final`` line counts (a requeued run appends its own). The
decision is ``judge_run``, a function of what the run left, without I/O.

After each run the crashed nodes are restarted, frozen ones thawed, and every node is back
in service (resumed in Slurm, registered, not held dead) before the next run. A run whose
harness fails is recorded with its ``error`` and the campaign goes on.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raps_slurm.bench.cluster import REPO, private_cluster
from raps_slurm.config import load_file
from raps_slurm.core.planner import Plan
from raps_slurm.errors import BenchError, RapsError, SlurmCommandError
from raps_slurm.registry import job_view
from raps_slurm.slurm import CommandRunner, commands
from raps_slurm.store import Keys, StateStore, open_store
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import (
    FINAL,
    back_in_service,
    committed,
    job_plans,
    last_final,
    node_dead,
)

RANKS = 4
SBATCH = ["--raps-spares=2", "-N6", "--open-mode=append"]
STEP_SEC = ["--step-sec", "0.05"]  # the pace only: the result does not depend on it
PROGRAMS = {"heat_ring": REPO / "examples" / "heat_ring.py",
            "random_program": REPO / "examples" / "random_program.py"}
COMBOS = ("primary", "primary+backup", "rack", "rack+primary")
KINDS_LO = ("crash", "freeze")
KINDS_NS = ("crash", "freeze", "partition")
RUN_DEADLINE_S = 300.0
HELD_S = 10.0  # a requeued run still pending this long after its nodes are back is held


@dataclass
class Fault:
    """One node's fault: ``kind`` crash, freeze or partition, ``at_s`` after the victims'
    first commit; a freeze is thawed, a partition healed, ``hold_s`` later."""

    node: str
    role: str
    kind: str
    at_s: float
    hold_s: float | None = None


def program_args(name: str, run_seed: int) -> list[str]:
    """The program's arguments (without the pace), short enough for a run well under a
    minute: 120 steps, a checkpoint about every 20."""
    if name == "heat_ring":
        return ["--steps", "120", "--every", "20"]
    return ["--seed", str(run_seed), "--rounds", "120", "--every", "20"]


def reference(tmp: Path, program: Path, args: list[str], ranks: int = RANKS) -> str:
    """The ``final ...`` line of a failure-free run under the local launcher."""
    proc = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", "-n", str(ranks),
                           "--dir", str(tmp), "--", sys.executable, str(program), *args],
                          capture_output=True, text=True, timeout=600, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("final ")]
    if proc.returncode != 0 or len(lines) != 1:
        raise BenchError(f"failure-free run of {program.name} {' '.join(args)} failed: "
                         f"{proc.stderr.strip().splitlines()[-1:]}")
    return lines[0]


def draw_kind(rng: random.Random, kinds: tuple[str, ...]) -> str:
    """One fault's kind: crash 65 % and freeze 35 % of the time (the draw of every
    campaign before partitions, so that a seed gives the same campaign), or with
    partitions crash 50 %, freeze 25 %, partition 25 %; one kind alone: that one."""
    u = rng.random()
    if len(kinds) == 1:
        return kinds[0]
    if kinds == KINDS_LO:
        return "crash" if u < 0.65 else "freeze"
    if kinds == KINDS_NS:
        return "crash" if u < 0.5 else "freeze" if u < 0.75 else "partition"
    raise BenchError(f"fault kinds {kinds}: one kind, {KINDS_LO} or {KINDS_NS}")


def draw_faults(rng: random.Random, view: dict[str, Any], host: str,
                racks: dict[str, tuple[str, ...]], kinds: tuple[str, ...] = KINDS_LO
                ) -> tuple[str, list[Fault]]:
    """The combination and its faults for one mapped job (never the batch host)."""
    working = sorted({r["node"] for r in view["ranks"]} - {host})
    backup = {r["node"]: r["group"]["log_backup"] for r in view["ranks"]}
    with_backup = [n for n in working if backup.get(n) and backup[n] != host]
    clear = [sorted(m) for m in racks.values() if host not in m]
    combo = rng.choice(COMBOS)
    if combo == "primary+backup" and not with_backup:
        combo = "primary"
    if combo.startswith("rack") and not clear:
        combo = "primary"
    roles: list[tuple[str, str]]
    if combo == "primary":
        roles = [(rng.choice(working), "primary")]
    elif combo == "primary+backup":
        node = rng.choice(with_backup)
        roles = [(node, "primary"), (backup[node], "backup")]
    else:
        rack = rng.choice(clear)
        roles = [(n, "rack") for n in rack]
        others = [n for n in working if n not in rack]
        if combo == "rack+primary" and others:
            roles.append((rng.choice(others), "primary"))
        elif combo == "rack+primary":
            combo = "rack"
    faults: list[Fault] = []
    for node, role in roles:
        kind = draw_kind(rng, kinds)
        faults.append(Fault(node, role, kind, round(rng.uniform(0.0, 3.0), 2),
                            round(rng.uniform(1.0, 10.0), 2) if kind != "crash" else None))
    return combo, sorted(faults, key=lambda f: f.at_s)


def judge_run(text: str, clean: str, state: str, restarts: int, plans: list[Plan],
              spares: list[str], dead: set[str], victims: set[str]) -> dict[str, Any]:
    """One run's record from what it left: its output ``text``, Slurm's final ``state``
    and restart count, the job's recovery ``plans``, the first run's ``spares``, the
    nodes seen under a DEAD verdict and the nodes faulted (``victims``). Only the last
    ``final`` line counts: a requeued run appends its own after the first run's."""
    final = last_final(text)
    completed = state == "COMPLETED" and final is not None
    taken = {p.target for p in plans if p.run == 0 and p.target != p.source}
    said = [x for x in text.splitlines() if x.startswith("raps-run: ")]
    return {
        "state": state, "restart_count": restarts,
        "result": "missing" if final is None else "same" if final == clean else "differs",
        # why a job that did not recover ended as it did, in raps-run's words
        "last_word": said[-1] if said and not completed else None,
        "recovered": completed and final == clean and restarts == 0,
        "requeued": restarts > 0,
        "wrong_result": completed and final != clean,
        "lost_data": not completed,
        "spares": spares,
        "spares_left": len([s for s in spares if s not in dead and s not in taken]),
        "dead_seen": sorted(dead),
        "moves": len([p for p in plans if p.target != p.source]),
        "plans_failed": len([p for p in plans if p.state == "failed"]),
        # a rank restarted in place, or moved, off a node no fault touched: a false verdict
        "healthy_restarted": len([p for p in plans
                                  if p.target == p.source and p.source not in victims]),
        "healthy_moved": len([p for p in plans
                              if p.target != p.source and p.source not in victims]),
    }


class Campaign:
    """The cluster, its store and the references, shared by the runs of one campaign."""

    def __init__(self, cluster: LocalCluster, store: StateStore, keys: Keys, seed: int,
                 say: Any, ranks: int = RANKS, sbatch: tuple[str, ...] = tuple(SBATCH),
                 kinds: tuple[str, ...] = KINDS_LO) -> None:
        self.cluster, self.store, self.keys, self.say = cluster, store, keys, say
        self.ranks, self.sbatch, self.kinds = ranks, list(sbatch), kinds
        self.rng = random.Random(seed)
        self.run = CommandRunner(timeout=60, env=cluster.env)
        self.references: dict[tuple[str, ...], str] = {}
        self.racks = cluster.slurm().topology().racks()

    def reference(self, name: str, args: list[str]) -> str:
        key = (name, *args)
        if key not in self.references:
            tmp = self.cluster.run_dir / "faults-ref" / f"{len(self.references)}"
            self.references[key] = reference(tmp, PROGRAMS[name], args, self.ranks)
        return self.references[key]

    def view(self, job: str) -> dict[str, Any] | None:
        with contextlib.suppress(RapsError):
            return job_view(self.store, self.keys, job)
        return None

    def where(self, job: str) -> str:
        """Where Slurm has the job (a job never registered is Slurm's side, or the
        hooks'; registered and not mapped, the leader's), and the nodes' states."""
        try:
            info = self.cluster.slurm().job(int(job))
            nodes = {n.name: " ".join([n.state.value, *sorted(n.flags), n.reason]).strip()
                     for n in self.cluster.slurm().nodes()}
        except (RapsError, SlurmCommandError) as exc:
            return f"Slurm: {exc}"
        return f"Slurm: job {info.state} on {list(info.nodes)}; nodes {nodes}"

    def one(self, index: int) -> dict[str, Any]:
        """One run: submit, fault, judge, restore; its record."""
        name = ("heat_ring", "random_program")[index % 2]
        run_seed = self.rng.randrange(1 << 30)
        args = program_args(name, run_seed)
        started = time.monotonic()
        row: dict[str, Any] = {"run": index, "program": name, "args": args}
        clean = self.reference(name, args)
        job, out = self.cluster.submit_raps_run(
            [sys.executable, str(PROGRAMS[name]), *args, *STEP_SEC], self.sbatch,
            f"faults-{index}")
        row["job"] = job
        faults: list[Fault] = []
        applied: list[Fault] = []  # those injected and not yet repaired
        try:
            view = wait_until(f"job {job} mapped", lambda: self.view(job),
                              lambda v: v is not None and v["state"] == "mapped"
                              and len(v["ranks"]) == self.ranks, 120,
                              explain=lambda: self.where(job))
            assert view is not None
            host = wait_until("the batch host",
                              lambda: self.cluster.slurm().job(int(job)).batch_host, bool, 30)
            combo, faults = draw_faults(self.rng, view, host, self.racks, self.kinds)
            row.update(combo=combo, faults=[asdict(f) for f in faults])
            dead = self.inject(job, view, faults, applied, started)
            reasons: list[str] = []
            state, held = self.wait_end(job, faults, applied, dead, reasons, started)
            self.note_reason(job, reasons)
            row.update(self.judge(job, out, clean, view, state, dead, faults),
                       requeue_reasons=reasons, requeue_held=held)
        except Exception as exc:  # one failed run must not end the campaign
            row["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(SlurmCommandError):
                self.run.run(commands.cancel(int(job)))
            try:
                self.restore(applied)
            except Exception as exc:  # the next run finds out whether it matters
                row["restore_error"] = f"{type(exc).__name__}: {exc}"
        row["wall_s"] = round(time.monotonic() - started, 1)
        return row

    def inject(self, job: str, view: dict[str, Any], faults: list[Fault],
               applied: list[Fault], started: float) -> set[str]:
        """Wait for the victims' first commit, then run the faults' schedule (each fault
        joins ``applied`` once injected); the victims seen under a DEAD verdict
        meanwhile."""
        nodes = {f.node for f in faults}
        ranks = [r["rank"] for r in view["ranks"] if r["node"] in nodes] or \
            [r["rank"] for r in view["ranks"]]
        wait_until(f"job {job}: ranks {ranks} committed",
                   lambda: [r for r in ranks if not committed(self.store, self.keys, job, r)],
                   lambda left: not left, 180, interval=0.1)
        t0 = time.monotonic()
        events = sorted([(f.at_s, "fault", f) for f in faults]
                        + [(f.at_s + f.hold_s, "end", f) for f in faults if f.hold_s],
                        key=lambda e: e[:2])
        dead: set[str] = set()
        for at, what, f in events:
            while time.monotonic() - t0 < at:
                self.note_dead(faults, dead)
                time.sleep(0.05)
            if what == "end":
                (self.cluster.thaw if f.kind == "freeze" else self.cluster.heal)(f.node)
            else:
                applied.append(f)
                if f.kind == "partition":
                    self.cluster.partition(f.node)
                else:
                    (self.cluster.crash if f.kind == "crash" else self.cluster.freeze)(f.node)
        self.say(f"  job {job}: {', '.join(f'{f.kind} {f.node} ({f.role})' for f in faults)}"
                 f" {time.monotonic() - started:.0f}s into the run")
        return dead

    def note_dead(self, faults: list[Fault], dead: set[str]) -> None:
        for f in faults:
            if f.node not in dead and node_dead(self.store, self.keys, f.node):
                dead.add(f.node)

    def wait_end(self, job: str, faults: list[Fault], unrepaired: list[Fault],
                 dead: set[str], reasons: list[str],
                 started: float) -> tuple[str, str | None]:
        """The job's final state (``unfinished`` at the deadline) and what held its
        requeued run (None when nothing did); each requeue's reason joins ``reasons``. Once
        the job is requeued its lost nodes are repaired; if the requeued run then still
        cannot start (Slurm's BadConstraints: it excludes nodes that were dead when it was
        requeued, and the rest cannot hold it), the harness lifts the exclusion as an
        admin would, and says so."""
        held: str | None = None
        since: float | None = None
        while time.monotonic() - started < RUN_DEADLINE_S:
            self.note_dead(faults, dead)
            info = self.cluster.slurm().job(int(job))
            if info.restart_count > 0:
                self.note_reason(job, reasons)
            if info.state in FINAL:
                return info.state, held
            if info.restart_count > 0 and unrepaired:
                self.restore(unrepaired)
            if info.restart_count > 0 and info.state == "PENDING" and not unrepaired \
                    and held is None:
                reason = self.run.run(["squeue", "-h", "-j", job, "-o", "%r"]).strip()
                since = since or time.monotonic()
                if reason == "BadConstraints" and time.monotonic() - since > HELD_S:
                    line = self.run.run(commands.scontrol_show_job(int(job)))
                    excluded = next((w.split("=", 1)[1] for w in line.split()
                                     if w.startswith("ExcNodeList=")), "")
                    held = f"{reason} with every node back in service, ExcNodeList={excluded}"
                    self.run.run(["scontrol", "update", f"JobId={job}", "ExcNodeList="])
                    self.say(f"  job {job}: requeued run held ({held}): exclusion lifted")
            time.sleep(0.3)
        return "unfinished", held

    def note_reason(self, job: str, reasons: list[str]) -> None:
        # the escalation record keeps the last requeue's reason only: read it as it changes
        kv = self.store.get(self.keys.job_escalation(job))
        if kv is not None:
            d = json.loads(kv.value)
            for why in (d.get("reason"), d.get("gave_up")):
                if why and why not in reasons:
                    reasons.append(why)

    def judge(self, job: str, out: Path, clean: str, view: dict[str, Any], state: str,
              dead: set[str], faults: list[Fault]) -> dict[str, Any]:
        """Read what the run left (its output, restarts and plans) and judge it."""
        text = out.read_text(errors="replace") if out.exists() else ""
        restarts = self.cluster.slurm().job(int(job)).restart_count
        return judge_run(text, clean, state, restarts, job_plans(self.store, self.keys, job),
                         view["spares"], dead, {f.node for f in faults})

    def restore(self, faults: list[Fault]) -> None:
        """Thaw frozen victims, heal partitioned ones, restart crashed ones (each once:
        ``faults`` is emptied),
        and wait until every node is back in service (a HUNG or DEAD verdict elsewhere
        may have drained one too)."""
        while faults:
            f = faults.pop()
            if f.kind == "freeze":
                self.cluster.thaw(f.node)
            elif f.kind == "partition":
                self.cluster.heal(f.node)
            else:
                self.cluster.restart(f.node)
        back_in_service(self.cluster, self.store, self.keys, *self.cluster.node_names)


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The campaign's counts and whether its goals are met (no wrong result, no lost data,
    no requeue while a spare remained, no healthy rank restarted or moved, no requeued run
    the harness had to rescue, no run the harness could not judge)."""
    def count(field: str) -> int:
        return sum(1 for r in rows if r.get(field))

    t = {"runs": len(rows), "recovered": count("recovered"), "requeued": count("requeued"),
         "wrong_results": count("wrong_result"), "lost_data": count("lost_data"),
         "requeued_with_spare_left": sum(1 for r in rows
                                         if r.get("requeued") and r.get("spares_left", 0) > 0),
         "requeues_held": count("requeue_held"), "errors": count("error"),
         "healthy_restarted": sum(int(r.get("healthy_restarted", 0)) for r in rows),
         "healthy_moved": sum(int(r.get("healthy_moved", 0)) for r in rows),
         "crashes": sum(1 for r in rows for f in r.get("faults", []) if f["kind"] == "crash"),
         "freezes": sum(1 for r in rows for f in r.get("faults", []) if f["kind"] == "freeze"),
         "partitions": sum(1 for r in rows for f in r.get("faults", [])
                           if f["kind"] == "partition")}
    t["goals_met"] = (t["wrong_results"] == 0 and t["lost_data"] == 0
                      and t["requeued_with_spare_left"] == 0 and t["errors"] == 0
                      and t["healthy_restarted"] == 0 and t["healthy_moved"] == 0
                      and t["requeues_held"] == 0)
    return t


def campaign(cluster: LocalCluster, runs: int, seed: int, say: Any, *, ranks: int = RANKS,
             sbatch: tuple[str, ...] = tuple(SBATCH),
             kinds: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``runs`` runs on a running cluster with a leading coordinator; the JSON object.
    ``kinds``: the fault kinds drawn (default: with partitions on a namespace-mode
    cluster, without on loopback)."""
    if kinds is None:
        kinds = KINDS_NS if cluster.net == "ns" else KINDS_LO
    if "partition" in kinds and cluster.net != "ns":
        raise BenchError("partitions need a namespace-mode cluster (--net ns)")
    cfg = load_file(cluster.config_path)
    store, keys = open_store(cfg.store)
    rows: list[dict[str, Any]] = []
    try:
        c = Campaign(cluster, store, keys, seed, say, ranks, sbatch, kinds)
        for i in range(runs):
            row = c.one(i)
            rows.append(row)
            say(f"run {i}: {row['program']} {row.get('combo')} -> "
                + ("error " + row["error"] if "error" in row else
                   f"{row['state']} recovered={row['recovered']} "
                   f"requeued={row['requeued']} lost={row['lost_data']}")
                + f" ({row['wall_s']}s)")
    finally:
        store.close()
    return {"benchmark": "faults", "seed": seed, "ranks": ranks, "sbatch": list(sbatch[:2]),
            "net": cluster.net, "kinds": list(kinds), "runs": rows, "totals": totals(rows)}


def run_faults(runs: int, seed: int, port: int, quiet: bool, net: str = "lo"
               ) -> dict[str, Any]:
    """Bring up the cluster (``net``: loopback, or namespace mode with partitions among
    the faults) and a coordinator, run the campaign, take it all down."""
    def say(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    with private_cluster("raps-bench-faults-", port, 1.0, net=net) as cluster:
        coordinator = cluster.coordinator("bench").start()
        try:
            cfg = load_file(cluster.config_path)
            store, keys = open_store(cfg.store)
            try:
                wait_until("the coordinator to lead", lambda: store.get(keys.leader()),
                           lambda kv: kv is not None, timeout=60)
            except AssertionError as exc:
                raise BenchError(f"bench faults: {exc}") from None
            finally:
                store.close()
            return campaign(cluster, runs, seed, say)
        finally:
            coordinator.stop()
