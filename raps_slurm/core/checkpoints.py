"""Checkpoint decisions: generation records, collection, replication targets, restore order.

Pure: no I/O. The agent applies these decisions to its chunk store and to etcd.

A generation of a rank is recorded at ``reports/jobs/<id>/ckpt/<rank>/<gen>`` once its primary
(the node the rank saved on) holds the manifest and every chunk durably. The record
names the holders; its state is ``committed`` when ``replicas`` copies besides the
primary acknowledged, ``under_replicated`` while fewer did. Both are restorable:
``under_replicated`` only says that losing the primary would lose the generation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Collection as _Coll
from dataclasses import dataclass, replace

from raps_slurm.core.records import Reader, dump
from raps_slurm.model import BackupGroup

STATES = ("committed", "under_replicated")


@dataclass(frozen=True)
class Collection:
    """What one collection removed: generations, a number of chunks, and the generations
    whose manifest could not be read (then no chunk is removed)."""

    dropped: tuple[tuple[int, int], ...]
    chunks: int
    unreadable: tuple[tuple[int, int], ...]


def generations_to_drop(gens: Mapping[int, Sequence[int]], keep: int,
                        pinned: _Coll[tuple[int, int]]) -> set[tuple[int, int]]:
    """(rank, gen) beyond the newest ``keep`` of each rank, except pinned ones."""
    if keep < 1:
        raise ValueError(f"keep {keep}: at least one generation must be kept")
    drop = set()
    for rank, numbers in gens.items():
        for gen in sorted(numbers, reverse=True)[keep:]:
            if (rank, gen) not in pinned:
                drop.add((rank, gen))
    return drop


@dataclass(frozen=True)
class CkptRecord:
    """``reports/jobs/<id>/ckpt/<rank>/<gen>``: one committed generation and where its
    copies are."""

    rank: int
    generation: int
    epoch: int
    manifest_digest: str
    total_size: int
    stored_size: int
    chunks: int
    whole_digest: str
    primary: str
    holders: tuple[str, ...]
    replicas: int            # copies wanted besides the primary
    state: str
    committed_at: float
    cold: bool = False
    bad: tuple[str, ...] = ()  # holders whose copy failed verification

    def to_json(self) -> bytes:
        """The etcd value."""
        return dump({"rank": self.rank, "generation": self.generation, "epoch": self.epoch,
                     "manifest_digest": self.manifest_digest, "total_size": self.total_size,
                     "stored_size": self.stored_size, "chunks": self.chunks,
                     "whole_digest": self.whole_digest, "primary": self.primary,
                     "holders": list(self.holders), "replicas": self.replicas,
                     "state": self.state, "committed_at": self.committed_at,
                     "cold": self.cold, "bad": list(self.bad)})

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> CkptRecord:
        """Decode; RecordError naming the key and field if malformed."""
        r = Reader(key, raw)
        cold = r.data.get("cold", False)
        if not isinstance(cold, bool):
            raise r._bad("cold", "true or false")
        return cls(r.integer("rank", 0, 2**31 - 1), r.integer("generation"),
                   r.integer("epoch", 1), r.text("manifest_digest"), r.integer("total_size"),
                   r.integer("stored_size"), r.integer("chunks"), r.text("whole_digest"),
                   r.text("primary"), r.names("holders"), r.integer("replicas", 0, 8),
                   r.choice("state", STATES), r.num("committed_at"), cold,
                   r.names("bad", empty=True) if "bad" in r.data else ())

    def with_holders(self, holders: Iterable[str]) -> CkptRecord:
        """The record with these holders (primary first) and the state they imply."""
        ordered = ordered_holders(self.primary, holders)
        return replace(self, holders=ordered,
                       state=commit_state(len(ordered) - 1, self.replicas))


def ordered_holders(primary: str, holders: Iterable[str]) -> tuple[str, ...]:
    """Primary first (if it holds a copy), then the others sorted, once each."""
    rest = sorted(set(holders) - {primary})
    return ((primary,) if primary in set(holders) else ()) + tuple(rest)


def commit_state(copies_besides_primary: int, wanted: int) -> str:
    """``committed`` when enough copies acknowledged, else ``under_replicated``."""
    return "committed" if copies_besides_primary >= wanted else "under_replicated"


def replica_targets(group: BackupGroup | None, primary: str, wanted: int) -> list[str]:
    """Nodes that should hold copies besides ``primary``: the group's log backup, then its
    checkpoint mirrors (the group's own primary too when the rank now runs elsewhere),
    at most ``wanted``, or as many backups as the group lists when it lists more (a
    replica boost added a mirror: ``core.boost``)."""
    if group is None or wanted <= 0:
        return []
    out: list[str] = []
    for node in (group.log_backup, *group.ckpt_mirrors, group.primary):
        if node and node != primary and node not in out:
            out.append(node)
    listed = sum(1 for b in (group.log_backup, *group.ckpt_mirrors) if b)
    return out[:max(wanted, listed)]


def needs_copy(record: CkptRecord, targets: Sequence[str], alive: _Coll[str]) -> list[str]:
    """Targets that are alive and do not hold the generation yet."""
    held = set(record.holders)
    return [t for t in targets if t not in held and t in alive]


def of_job_nodes(records: Iterable[CkptRecord], nodes: _Coll[str]
                 ) -> tuple[list[CkptRecord], list[CkptRecord]]:
    """The records a reader may act on, and those it must not. Every agent may write any
    job's records (a holder updates a record another node committed), so one that names a
    node outside the job (``nodes``: every run's) as primary is refused: root on that node
    would have it restored from a manifest of its own. A holder outside the job is dropped
    from a record kept: it would serve only what the forger put there."""
    kept, refused = [], []
    for r in records:
        if r.primary not in nodes:
            refused.append(r)
        elif any(h not in nodes for h in r.holders):
            kept.append(replace(r, holders=tuple(h for h in r.holders if h in nodes)))
        else:
            kept.append(r)
    return kept, refused


def same_commit(a: CkptRecord, b: CkptRecord) -> bool:
    """True when two records describe the same commit: everything but the holders, the
    state and the marks that holders and restores add later."""
    return (a.rank, a.generation, a.epoch, a.manifest_digest, a.total_size, a.stored_size,
            a.chunks, a.whole_digest, a.primary, a.replicas, a.committed_at) == \
        (b.rank, b.generation, b.epoch, b.manifest_digest, b.total_size, b.stored_size,
         b.chunks, b.whole_digest, b.primary, b.replicas, b.committed_at)


def attested(rank: int, records: Iterable[CkptRecord],
             commits: Mapping[tuple[str, int], CkptRecord], node_at: Callable[[int], str | None],
             fallback_holders: Iterable[str] = ()) -> tuple[list[CkptRecord], list[str]]:
    """The generations of ``rank`` a restore may take, and why the others are refused.

    ``records`` are the shared records (``reports/jobs/``), which any agent may write;
    ``commits`` the copy each primary wrote under its own prefix at commit (``(node,
    generation)`` -> record), which only that node's agent may write; ``node_at(epoch)``
    is where the rank ran at an epoch, from its rank entry (the leader's). A generation
    counts only when its commit was written by the node that ran the rank at the
    commit's epoch: root on another node can neither invent one nor point one at its own
    manifest. The shared record gives the holders when it describes the same commit;
    otherwise (deleted, rewritten) the commit stands with its primary and
    ``fallback_holders`` (the rank's backup group) as the places to look. Of two commits
    of one generation (a node numbering after a lost record), the later epoch's counts."""
    shared = {r.generation: r for r in records}
    chosen: dict[int, CkptRecord] = {}
    refused: list[str] = []
    for (node, gen), c in commits.items():
        if (c.primary, c.generation, c.rank) != (node, gen, rank):
            refused.append(f"commit {gen} under {node}: it names rank {c.rank} generation "
                           f"{c.generation} primary {c.primary}")
            continue
        if node_at(c.epoch) != node:
            refused.append(f"generation {gen}: {node} did not run rank {rank} at epoch "
                           f"{c.epoch}")
            continue
        if gen in chosen and chosen[gen].epoch >= c.epoch:
            continue
        s = shared.get(gen)
        if s is not None and same_commit(s, c):
            chosen[gen] = s
        else:
            chosen[gen] = replace(c, holders=ordered_holders(c.primary,
                                                             {c.primary, *fallback_holders}))
    for gen, r in shared.items():
        if gen not in chosen or not same_commit(chosen[gen], r):
            refused.append(f"generation {gen}: no commit of its primary {r.primary} matches "
                           "the record")
    return list(chosen.values()), refused


def restore_order(records: Iterable[CkptRecord]) -> list[CkptRecord]:
    """Generations to try, newest first: by epoch, then number (a later epoch's state is
    newer whatever its number)."""
    return sorted(records, key=lambda r: (r.epoch, r.generation), reverse=True)


def expired_records(records: Iterable[CkptRecord], keep: int, primary: str) -> list[int]:
    """Generations whose records ``primary`` deletes: those it wrote beyond the newest
    ``keep``, except the newest cold one (a cold copy is restored only against its record)
    and the newest ``committed`` one: while newer generations still wait for their copies,
    it is the only one a restore on another node can use."""
    ordered = restore_order(records)
    spared = {next((r.generation for r in ordered if r.cold), None),
              next((r.generation for r in ordered if r.state == "committed"), None)}
    return [r.generation for r in ordered[keep:]
            if r.primary == primary and r.generation not in spared]


def next_generation(existing: Iterable[int]) -> int:
    """One above the newest recorded generation (1 for the first)."""
    return max(existing, default=0) + 1


def source_order(record: CkptRecord, here: str, alive: _Coll[str]) -> list[str]:
    """Holders to pull a generation's chunks from: live ones not marked bad, this node
    excluded, the primary first (it wrote the copy)."""
    return [h for h in record.holders if h != here and h in alive and h not in record.bad]
