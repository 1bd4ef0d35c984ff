"""Frozen domain types shared by core/, the adapters and the daemons."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class NodeState(enum.Enum):
    """Base node state as Slurm reports it (flags such as DRAIN are kept apart)."""

    IDLE = "IDLE"
    ALLOCATED = "ALLOCATED"
    MIXED = "MIXED"
    DOWN = "DOWN"
    FUTURE = "FUTURE"
    UNKNOWN = "UNKNOWN"
    ERROR = "ERROR"


@dataclass(frozen=True)
class NodeInfo:
    """One Slurm node: base state, flags (DRAIN, NOT_RESPONDING, ...), reason, weight."""

    name: str
    state: NodeState
    flags: frozenset[str] = frozenset()
    reason: str = ""
    weight: int = 1
    features: frozenset[str] = frozenset()
    cpus: int = 1

    @property
    def drained(self) -> bool:
        """True when the node is DRAINING or DRAINED (both carry the DRAIN flag)."""
        return "DRAIN" in self.flags

    @property
    def state_text(self) -> str:
        """State as one word, e.g. ``IDLE+DRAIN``, the way ``scontrol`` prints it."""
        return "+".join([self.state.value, *sorted(self.flags)])


@dataclass(frozen=True)
class JobInfo:
    """One Slurm job as squeue/scontrol report it; ``nodes`` is its current node list."""

    job_id: int
    name: str
    user_id: int
    state: str
    nodes: tuple[str, ...]
    restart_count: int = 0
    start_time: int = 0
    batch_host: str = ""


@dataclass(frozen=True)
class Switch:
    """A switch from topology.conf; a switch with nodes and no child switch is a rack."""

    name: str
    level: int
    nodes: frozenset[str]
    switches: tuple[str, ...] = ()


@dataclass(frozen=True)
class Topology:
    """Switch tree plus optional power domains; racks are the leaf switches."""

    switches: Mapping[str, Switch]
    power_domains: Mapping[str, str] = field(default_factory=dict)

    def racks(self) -> dict[str, tuple[str, ...]]:
        """Leaf switch name -> its nodes, sorted."""
        return {
            s.name: tuple(sorted(s.nodes))
            for s in self.switches.values()
            if not s.switches and s.nodes
        }

    def rack_of(self, node: str) -> str | None:
        """The leaf switch holding ``node``, or None if the node is in no rack."""
        for name, nodes in self.racks().items():
            if node in nodes:
                return name
        return None

    def distance(self, a: str, b: str) -> int:
        """Switch hops between two nodes: 0 same node, 1 same rack, n via a level-(n-1) switch.

        Nodes without a common switch are as far as the tree allows plus one.
        """
        if a == b:
            return 0
        common = [s for s in self.switches.values() if a in s.nodes and b in s.nodes]
        if not common:
            top = max((s.level for s in self.switches.values()), default=0)
            return top + 2
        return min(s.level for s in common) + 1


@dataclass(frozen=True)
class BackupGroup:
    """Where one rank's data lives: primary (runs it), log backup, checkpoint mirrors.

    The replica count N (copies besides the primary) gives one log backup (copy 1) and
    N-1 checkpoint mirrors; a pool too small for that leaves ``log_backup`` None or
    ``ckpt_mirrors`` shorter, with ``degraded`` set and a one-line ``reason``.
    """

    rank: int
    primary: str
    log_backup: str | None
    ckpt_mirrors: tuple[str, ...] = ()
    degraded: bool = False
    reason: str = ""

    @property
    def members(self) -> tuple[str, ...]:
        """The nodes of the group: primary, log backup if any, then the mirrors in order."""
        log = (self.log_backup,) if self.log_backup else ()
        return (self.primary, *log, *self.ckpt_mirrors)


@dataclass(frozen=True)
class RankPlacement:
    """The placement of one rank: its backup group and its ordered spare list."""

    group: BackupGroup
    spares: tuple[str, ...]
