"""Job registration records, rank maps and their lifecycle: pure, no I/O.

The controller hooks write a :class:`JobRecord` per job run (job id + restart count);
the coordinator leader answers with a :class:`RankMap`, one rank assignment and one
backup group per rank. Everything here is serialised to JSON for etcd, and every
decoder rejects a malformed value with one line naming the key and what is wrong
(a daemon logs it and goes on; nothing is silently accepted).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from ClusterShell.NodeSet import NodeSet, NodeSetParseError

from raps_slurm.core.placement import compute_placement
from raps_slurm.core.records import Reader as _Reader
from raps_slurm.core.records import dump as _dump
from raps_slurm.errors import PlacementError
from raps_slurm.model import BackupGroup, RankPlacement, Topology

# The shim's ranges (spank/raps_spank.c); the hooks check them again because the
# environment is input like any other.
SPEC_RANGES = {"spares": (0, 64), "replicas": (0, 8), "ckpt_interval_sec": (1, 604800),
               "ranks_per_node": (1, 1024)}
_SPEC_ENV = {"spares": "SPANK_RAPS_SPARES", "replicas": "SPANK_RAPS_REPLICAS",
             "ckpt_interval_sec": "SPANK_RAPS_CKPT_INTERVAL",
             "ranks_per_node": "SPANK_RAPS_RANKS_PER_NODE"}
ENABLED_ENV = "SPANK_RAPS_ENABLED"

# Slurm job states after which a job never runs again (a requeued job is PENDING).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})

RunState = Literal["running", "ended"]
Registration = Literal["create", "requeue", "same", "reuse"]


@dataclass(frozen=True)
class JobSpec:
    """What the job asked for with ``--raps-*``; None means "the config default"."""

    spares: int = 0
    replicas: int | None = None
    ckpt_interval_sec: int | None = None
    ranks_per_node: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> JobSpec | None:
        """The spec from ``SPANK_RAPS_*``; None for a job submitted without ``--raps``.

        Raises ValueError naming the variable for a value outside the shim's range.
        """
        if env.get(ENABLED_ENV) != "1":
            return None
        values: dict[str, int] = {}
        for name, var in _SPEC_ENV.items():
            text = env.get(var)
            if text is None or text == "":
                continue
            lo, hi = SPEC_RANGES[name]
            if not _decimal(text) or not lo <= int(text) <= hi:
                raise ValueError(f"{var}: expected an integer {lo}-{hi}, got {text!r}")
            values[name] = int(text)
        return cls(**values)

    def to_dict(self) -> dict[str, int | None]:
        """JSON-friendly form."""
        return {"spares": self.spares, "replicas": self.replicas,
                "ckpt_interval_sec": self.ckpt_interval_sec,
                "ranks_per_node": self.ranks_per_node}


@dataclass(frozen=True)
class JobRecord:
    """One run of a RAPS job as the controller hooks registered it."""

    job_id: str
    restart_count: int
    owner_uid: int
    nodes: tuple[str, ...]
    spec: JobSpec
    state: RunState = "running"
    registered_at: float = 0.0
    ended_at: float | None = None
    user: str = ""
    name: str = ""
    exit_code: int | None = None
    # nodes of the job's earlier runs not in this one: they may still hold its checkpoints
    earlier_nodes: tuple[str, ...] = ()

    def ended(self, now: float, exit_code: int | None) -> JobRecord:
        """This run marked ended (EpilogSlurmctld)."""
        return replace(self, state="ended", ended_at=now, exit_code=exit_code)

    def after(self, earlier: JobRecord) -> JobRecord:
        """This run's record, requeued from ``earlier``: its nodes join ``earlier_nodes``."""
        every = (set(earlier.nodes) | set(earlier.earlier_nodes)) - set(self.nodes)
        return replace(self, earlier_nodes=tuple(sorted(every)))

    @property
    def all_nodes(self) -> frozenset[str]:
        """Every node of every run of the job: where its checkpoints may be held."""
        return frozenset(self.nodes) | frozenset(self.earlier_nodes)

    def to_json(self) -> bytes:
        """The etcd value."""
        return _dump({"job_id": self.job_id, "restart_count": self.restart_count,
                      "owner_uid": self.owner_uid, "nodes": list(self.nodes),
                      "spec": self.spec.to_dict(), "state": self.state,
                      "registered_at": self.registered_at, "ended_at": self.ended_at,
                      "user": self.user, "name": self.name, "exit_code": self.exit_code,
                      "earlier_nodes": list(self.earlier_nodes)})

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> JobRecord:
        """Decode the value at ``key``; RecordError if it is not a job record."""
        d = _Reader(key, raw)
        spec = d.obj("spec")
        sr = _Reader(f"{key} spec", spec)
        return cls(job_id=d.text("job_id"), restart_count=d.integer("restart_count"),
                   owner_uid=d.integer("owner_uid"), nodes=d.names("nodes"),
                   spec=JobSpec(spares=sr.integer("spares", *SPEC_RANGES["spares"]),
                                replicas=sr.opt_integer("replicas", *SPEC_RANGES["replicas"]),
                                ckpt_interval_sec=sr.opt_integer(
                                    "ckpt_interval_sec", *SPEC_RANGES["ckpt_interval_sec"]),
                                ranks_per_node=sr.integer("ranks_per_node",
                                                      *SPEC_RANGES["ranks_per_node"])),
                   state=d.choice("state", ("running", "ended")),  # type: ignore[arg-type]
                   registered_at=d.num("registered_at"), ended_at=d.opt_num("ended_at"),
                   user=d.text("user", empty=True), name=d.text("name", empty=True),
                   exit_code=d.opt_integer("exit_code", -(2**31), 2**31 - 1),
                   earlier_nodes=(d.names("earlier_nodes", empty=True)
                                  if "earlier_nodes" in d.data else ()))


def record_from_env(env: Mapping[str, str], now: float) -> JobRecord | None:
    """The record PrologSlurmctld writes, from its environment; None without ``--raps``.

    Raises ValueError naming the variable that is missing or malformed.
    """
    spec = JobSpec.from_env(env)
    if spec is None:
        return None

    def need(var: str) -> str:
        value = env.get(var, "")
        if not value:
            raise ValueError(f"{var} is not set: is this run by Slurm as PrologSlurmctld?")
        return value

    job_id = need("SLURM_JOB_ID")
    if not _decimal(job_id):
        raise ValueError(f"SLURM_JOB_ID: expected a job number, got {job_id!r}")
    uid = need("SLURM_JOB_UID")
    restarts = env.get("SLURM_JOB_RESTART_COUNT", "0") or "0"
    for var, text in (("SLURM_JOB_UID", uid), ("SLURM_JOB_RESTART_COUNT", restarts)):
        if not _decimal(text):
            raise ValueError(f"{var}: expected an integer >= 0, got {text!r}")
    hostlist = need("SLURM_JOB_NODELIST")
    try:
        nodes = tuple(NodeSet(hostlist))
    except NodeSetParseError:
        raise ValueError(f"SLURM_JOB_NODELIST: {hostlist!r} is not a hostlist") from None
    if not nodes:
        raise ValueError(f"SLURM_JOB_NODELIST: {hostlist!r} names no node")
    return JobRecord(job_id, int(restarts), int(uid), nodes, spec, "running", now,
                     user=env.get("SLURM_JOB_USER", ""), name=env.get("SLURM_JOB_NAME", ""))


def registration(existing: JobRecord | None, new: JobRecord) -> Registration:
    """How PrologSlurmctld treats ``new`` given what is stored under the same job id.

    ``create``: nothing stored. ``requeue``: the same job started again (higher
    restart count): re-register and keep its checkpoints. ``same``: this very run
    registered already (a repeated prolog): nothing to do. ``reuse``: stored state
    belongs to an older job that had this id (Slurm's ids wrap or its state was
    reset): wipe it, so the new job inherits nothing.
    """
    if existing is None:
        return "create"
    if existing.owner_uid != new.owner_uid:
        return "reuse"
    if new.restart_count > existing.restart_count:
        return "requeue"
    if (new.restart_count == existing.restart_count and existing.state == "running"
            and existing.nodes == new.nodes):
        return "same"
    return "reuse"


@dataclass(frozen=True)
class RankMap:
    """The coordinator's answer for one job run: where each rank runs, which nodes are spare.

    ``error`` is set instead when no map can be built (e.g. more spares than nodes).
    """

    job_id: str
    restart_count: int
    nodes: tuple[str, ...] = ()  # node of each rank, index = rank
    spares: tuple[str, ...] = ()
    replicas: int = 0
    built_at: float = 0.0
    error: str = ""
    built_by: str = ""

    def to_json(self) -> bytes:
        """The etcd value."""
        return _dump({"job_id": self.job_id, "restart_count": self.restart_count,
                      "nodes": list(self.nodes), "spares": list(self.spares),
                      "replicas": self.replicas, "built_at": self.built_at,
                      "error": self.error, "built_by": self.built_by})

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> RankMap:
        """Decode the value at ``key``; RecordError if it is not a rank map."""
        d = _Reader(key, raw)
        return cls(d.text("job_id"), d.integer("restart_count"), d.names("nodes", empty=True),
                   d.names("spares", empty=True), d.integer("replicas", 0, 8), d.num("built_at"),
                   d.text("error", empty=True), d.text("built_by", empty=True))


PLACEMENTS_KEPT = 16
"""Earlier (epoch, node) placements a rank entry keeps: a checkpoint generation is
restored only when its primary held the rank at the generation's epoch, and only the
leader writes the entry, so this is the record agents cannot forge."""


@dataclass(frozen=True)
class RankEntry:
    """``jobs/<id>/ranks/<rank>``: where a rank runs, its epoch and its spare order, and
    where it ran at its earlier epochs (``placed``: (epoch, node), newest first, at most
    PLACEMENTS_KEPT)."""

    rank: int
    node: str
    epoch: int
    status: str
    spares: tuple[str, ...]
    placed: tuple[tuple[int, str], ...] = ()

    def to_json(self) -> bytes:
        """The etcd value."""
        return _dump({"rank": self.rank, "node": self.node, "epoch": self.epoch,
                      "status": self.status, "spares": list(self.spares),
                      "placed": [[e, n] for e, n in self.placed]})

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> RankEntry:
        """Decode the value at ``key``; RecordError if it is not a rank entry."""
        d = _Reader(key, raw)
        epoch = d.integer("epoch", 1)
        placed = d.data.get("placed", [])
        if (not isinstance(placed, list) or len(placed) > PLACEMENTS_KEPT
                or not all(isinstance(p, list) and len(p) == 2 and type(p[0]) is int
                           and 1 <= p[0] < epoch and isinstance(p[1], str) and p[1]
                           for p in placed)):
            raise d._bad("placed", f"at most {PLACEMENTS_KEPT} [epoch, node] pairs of "
                                   "earlier epochs")
        return cls(d.integer("rank"), d.text("node"), epoch, d.text("status"),
                   d.names("spares", empty=True), tuple((int(e), str(n)) for e, n in placed))

    def node_at(self, epoch: int) -> str | None:
        """The node that ran the rank at ``epoch``; None when not known (before the oldest
        placement kept, or never an epoch of this rank)."""
        if epoch == self.epoch:
            return self.node
        return next((n for e, n in self.placed if e == epoch), None)

    def moved(self, node: str, epoch: int, status: str, spares: tuple[str, ...]
              ) -> RankEntry:
        """The entry at a later ``epoch`` on ``node``, this placement kept in ``placed``."""
        placed = ((self.epoch, self.node), *self.placed)[:PLACEMENTS_KEPT]
        return RankEntry(self.rank, node, epoch, status, spares, placed)


def group_to_json(group: BackupGroup) -> bytes:
    """``jobs/<id>/groups/<rank>``: ``degraded`` is null or the reason, as ``show job`` prints."""
    return _dump(group_dict(group))


def group_dict(group: BackupGroup) -> dict[str, Any]:
    """The public shape of a backup group."""
    return {"primary": group.primary, "log_backup": group.log_backup,
            "ckpt_mirrors": list(group.ckpt_mirrors),
            "degraded": group.reason if group.degraded else None}


def group_from_json(key: str, raw: bytes, rank: int) -> BackupGroup:
    """Decode a backup group; RecordError if malformed."""
    d = _Reader(key, raw)
    log = d.opt_text("log_backup")
    reason = d.opt_text("degraded")
    return BackupGroup(rank, d.text("primary"), log, d.names("ckpt_mirrors", empty=True),
                       degraded=reason is not None, reason=reason or "")


@dataclass(frozen=True)
class MapPlan:
    """What the leader writes for a job run: the map, and per rank its entry and group."""

    rank_map: RankMap
    entries: tuple[RankEntry, ...] = ()
    groups: tuple[BackupGroup, ...] = ()


def choose_spares(topology: Topology, nodes: Collection[str], count: int
                  ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split a job's nodes into (working, spares) with the spares spread over racks.

    Each spare is taken from the rack with the most nodes still working (ties: rack
    name), its last node by name, so racks keep similar numbers of working nodes and
    a rack failure costs few spares. Raises PlacementError if no node would be left to run
    ranks, or a node is in no rack.
    """
    ordered = sorted(set(nodes), key=_natural)
    if count >= len(ordered):
        raise PlacementError(f"{len(ordered)} node{'s' if len(ordered) != 1 else ''} "
                             f"allocated and {count} spares asked: at least one node must "
                             "run ranks (allocate more nodes or lower --raps-spares)")
    by_rack: dict[str, list[str]] = {}
    for n in ordered:
        rack = topology.rack_of(n)
        if rack is None:
            raise PlacementError(f"node {n!r} is not in any rack of the topology")
        by_rack.setdefault(rack, []).append(n)
    spares: list[str] = []
    for _ in range(count):
        rack = max(sorted(by_rack), key=lambda r: len(by_rack[r]))
        spares.append(by_rack[rack].pop())
    working = tuple(n for n in ordered if n not in spares)
    return working, tuple(sorted(spares, key=_natural))


def node_fitness(nodes: Collection[str], *, dead: Collection[str],
                 registered: Collection[str] | None, suspect: Collection[str],
                 draining: Mapping[str, tuple[str, float]], since: float
                 ) -> tuple[dict[str, str], dict[str, str]]:
    """(unfit, doubtful): which of ``nodes``, none of them ``dead``, may not run ranks, and
    which run ranks only when the others are too few; each node with why.

    Unfit: no live agent registration (``registered``; None when not read yet: nobody is
    unfit for it), since a rank there cannot reach its agent; or drained for health
    (``draining``: node -> (reason, when)) at or after ``since``, the run's registration,
    since its ranks would be moved off at once. An older health verdict does not count:
    Slurm allocated the node after RAPS drained it, so an admin resumed it (the verdict
    stays in etcd until the node's level changes again). Doubtful: a SUSPECT verdict
    (``suspect``), which becomes DEAD or clears within seconds, and which a loaded
    machine can give a healthy node: a job with too few good nodes runs there rather
    than not at all.
    """
    gone = set(dead)
    unfit: dict[str, str] = {}
    doubtful: dict[str, str] = {}
    for n in nodes:
        if n in gone:
            continue
        if registered is not None and n not in registered:
            unfit[n] = "no live agent"
        elif n in draining and draining[n][1] >= since:
            unfit[n] = f"draining ({draining[n][0]})"
        elif n in suspect:
            doubtful[n] = "SUSPECT"
    return unfit, doubtful


def build_map(record: JobRecord, topology: Topology, *, default_replicas: int, now: float,
              previous_epochs: Mapping[int, int] | None = None,
              previous_placed: Mapping[int, tuple[tuple[int, str], ...]] | None = None,
              prefer_original_rack: bool = False,
              unhealthy: Collection[str] = frozenset(),
              dead: Collection[str] = frozenset(),
              unfit: Mapping[str, str] | None = None,
              doubtful: Mapping[str, str] | None = None) -> MapPlan:
    """The rank map, rank entries and backup groups of one job run.

    The node is the unit: ranks go ``ranks_per_node`` at a time to the working nodes in
    name order, and all ranks of a node share that node's backup group (one log backup,
    one mirror set). Only nodes whose agent is alive and healthy run ranks
    (:func:`node_fitness`). Nodes under a DEAD verdict (``dead``) get nothing, neither
    ranks nor spare duty: the run uses one spare fewer for each (a requeued job that lost
    nodes still starts). ``unfit`` nodes (node -> why) get no ranks and become spares
    that hold no backup and come last in every spare order: recovery takes one only once
    it is healthy again. ``doubtful`` ones are spares too, unless the good nodes are too
    few for the ranks. A run is not mapped only when too few nodes are left for its ranks.
    The rank count is the prior run's when ``previous_epochs`` holds one entry for each of
    its ranks 0..N-1, so a run on fewer nodes restores the same ranks; otherwise it is
    (nodes - spares) x ranks_per_node. Each rank's epoch is
    one more than in ``previous_epochs``, so a copy of an earlier run is fenced; its
    ``placed`` is ``previous_placed`` (the earlier run's placements, its last one first). A
    job that cannot be mapped gets a map with ``error``.
    """
    spec = record.spec
    replicas = default_replicas if spec.replicas is None else spec.replicas
    prev = previous_epochs or {}
    earlier = previous_placed or {}
    per_node = spec.ranks_per_node
    gone = set(dead)
    lost = sorted(set(record.nodes) & gone, key=_natural)
    usable = [n for n in dict.fromkeys(record.nodes) if n not in gone]
    bad = {n: why for n, why in (unfit or {}).items() if n in usable}
    maybe = {n: why for n, why in (doubtful or {}).items() if n in usable and n not in bad}
    good = [n for n in usable if n not in bad and n not in maybe]
    try:
        if prev and sorted(prev) == list(range(len(prev))):
            size = len(prev)
        else:
            if spec.spares >= len(set(record.nodes)):
                choose_spares(topology, record.nodes, spec.spares)  # raises the usual error
            size = (len(set(record.nodes)) - spec.spares) * per_node
        needed = -(-size // per_node)
        if needed > len(good) + len(maybe):
            why = ([f"{','.join(lost)} under a DEAD verdict"] if lost else []) + \
                [f"{n}: {bad[n]}" for n in sorted(bad, key=_natural)]
            raise PlacementError(
                f"{size} ranks at {per_node} per node need {needed} nodes, but only "
                f"{len(good) + len(maybe)} of the {len(record.nodes)} allocated are usable"
                + (f" ({'; '.join(why)})" if why else ""))
        # Doubtful nodes fill in only what the good ones lack.
        fill = good + sorted(maybe, key=_natural)[:max(0, needed - len(good))]
        working, spares = choose_spares(topology, fill, len(fill) - needed)
        idle = tuple(sorted((n for n in usable if n not in fill), key=_natural))
        spares = tuple(sorted((*spares, *idle), key=_natural))
        rank_nodes = {i * per_node + k: n for i, n in enumerate(working)
                      for k in range(per_node) if i * per_node + k < size}
        by_node: dict[int, RankPlacement] = compute_placement(
            topology, dict(enumerate(working)), spares, replicas=replicas,
            prefer_original_rack=prefer_original_rack,
            unhealthy={*unhealthy, *maybe}, no_backups=[n for n in idle if n in bad])
    except PlacementError as exc:
        return MapPlan(RankMap(record.job_id, record.restart_count, built_at=now,
                               replicas=replicas, error=str(exc)))
    index = {n: i for i, n in enumerate(working)}
    placed = {r: by_node[index[n]] for r, n in rank_nodes.items()}
    entries = tuple(RankEntry(r, rank_nodes[r], prev.get(r, 0) + 1, "assigned",
                              placed[r].spares, earlier.get(r, ())[:PLACEMENTS_KEPT])
                    for r in sorted(rank_nodes))
    rank_map = RankMap(record.job_id, record.restart_count,
                       tuple(rank_nodes[r] for r in sorted(rank_nodes)), spares, replicas, now)
    groups = tuple(replace(placed[r].group, rank=r) for r in sorted(rank_nodes))
    return MapPlan(rank_map, entries, groups)


def purge_due(record: JobRecord, slurm_state: str | None, final_since: float | None,
              now: float, grace: float) -> bool:
    """True when a job's keys and data may go: finished for good, grace period over.

    ``slurm_state`` is the job's state in Slurm, None when Slurm no longer knows the
    job (purged after MinJobAge, which happens only after it finished).
    ``final_since`` is when the coordinator first saw it finished. The grace period
    counts from the later of that and the epilog's ``ended_at``: a job requeued long
    ago and cancelled while pending still gets its whole grace period.
    """
    if slurm_state is not None and slurm_state not in FINAL_STATES:
        return False  # pending again after a requeue, or still running
    marks = [t for t in (record.ended_at, final_since) if t is not None]
    return bool(marks) and now - max(marks) >= grace


def sweep(local_jobs: Mapping[str, float], tombstones: Mapping[str, float],
          registered: Collection[str]) -> list[str]:
    """Job ids whose node-local data may be deleted now (the agent's sweep).

    ``local_jobs``: job id -> creation time of its local dir; ``tombstones``: job id ->
    when the coordinator purged it. Only a purged job's dir goes, and only one created
    before the purge with no job of that id registered since: a new job that reuses the
    id (its prolog may run before its registration) keeps its fresh dir.
    """
    return sorted((j for j, created in local_jobs.items()
                   if j in tombstones and j not in registered and created <= tombstones[j]),
                  key=_natural)


def _decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes '²' and '٣', which int() rejects or reads."""
    return text.isascii() and text.isdigit()


def _natural(name: str) -> tuple[str, int, str]:
    """n2 before n10."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return head, int(tail) if tail else -1, name


def authorize(uid: int, owner: int | None) -> bool:
    """May ``uid`` act for a job whose registered owner is ``owner`` (None: not registered)?
    Root may; otherwise only the owner (the agent's socket and the coordinator's user door
    apply the same rule)."""
    return uid == 0 or (owner is not None and owner == uid)
