"""Failure history, fault-domain health scores and Slurm node weights; pure, no I/O.

The coordinator leader records every DEAD and HUNG verdict and every health DRAIN as a
:class:`FailureEvent` (``history/<node>/<id>``), keeps them ``system.history_window_h``
and turns them into scores that decay back: an event weighs 1 (a hung rank 0.25: it says
less about the node) and halves every ``system.score_half_life_h``; a domain's penalty is
the sum over its nodes' events, a node's is its own plus its rack's, and the score is
1 / (1 + penalty): 1 for a clean record, 0.5 after one fresh failure, 0.25 after three
in a rack.

Weights. Slurm fills lower node weights first, so a node with a low score gets its base
weight plus ``system.weight_step`` per tenth of score lost (``weight_levels``, so the
weight moves in a few steps as the score decays, not on every cycle). Weights set with
``scontrol update`` are lost on ``scontrol reconfigure`` and on a slurmctld restart, so
the leader reconciles: it records what it set (``weights/<node>``: the base it found and
the weight it applied) and each pass compares with Slurm. A node showing the applied
weight is ours; one showing the recorded base was reset and gets the weight again; one
showing anything else was changed by an admin: the record is dropped and the node left
alone. A node whose score recovered gets its base back and loses the record.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from raps_slurm.core.records import Reader, dump

KINDS = ("DEAD", "HUNG", "DRAIN")
KIND_WEIGHT = {"DEAD": 1.0, "DRAIN": 1.0, "HUNG": 0.25}
MAX_WEIGHT = 4_294_967_280  # Slurm keeps weights in a uint32 and reserves the top values


@dataclass(frozen=True)
class FailureEvent:
    """``history/<node>/<id>``: one verdict about a node, kept for the history window."""

    kind: str
    node: str
    at: float
    reason: str = ""

    def to_json(self) -> bytes:
        """The etcd value."""
        return dump({"kind": self.kind, "node": self.node, "at": self.at,
                     "reason": self.reason})

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> FailureEvent:
        """Decode; RecordError naming the key and the field if malformed."""
        r = Reader(key, raw)
        return cls(r.choice("kind", KINDS), r.text("node"), r.num("at"),
                   r.text("reason", empty=True))

    def event_id(self) -> str:
        """Key component: sorts by time, unique per node and kind."""
        return f"{self.at:017.6f}-{self.kind}"


@dataclass(frozen=True)
class DomainHealth:
    """A rack's (or power domain's) recent failures and score."""

    domain: str
    nodes: tuple[str, ...]
    failures: dict[str, int]   # kind -> count within the window
    penalty: float
    score: float


def score(penalty: float) -> float:
    """1 / (1 + penalty): 1 healthy, towards 0 as failures pile up."""
    return 1.0 / (1.0 + max(0.0, penalty))


def _decayed(e: FailureEvent, now: float, half_life_s: float) -> float:
    age = max(0.0, now - e.at)
    return float(KIND_WEIGHT.get(e.kind, 1.0) * 0.5 ** (age / half_life_s))


def within(events: Iterable[FailureEvent], now: float, window_s: float) -> list[FailureEvent]:
    """Events of the last ``window_s`` seconds."""
    return [e for e in events if now - e.at <= window_s]


def expired(events: Iterable[FailureEvent], now: float, window_s: float) -> list[FailureEvent]:
    """Events older than the window: to delete."""
    return [e for e in events if now - e.at > window_s]


def domain_health(events: Iterable[FailureEvent], domains: Mapping[str, Collection[str]],
                  now: float, window_s: float, half_life_s: float) -> dict[str, DomainHealth]:
    """Every domain's failures (within the window), decayed penalty and score."""
    by_node: dict[str, list[FailureEvent]] = {}
    for e in within(events, now, window_s):
        by_node.setdefault(e.node, []).append(e)
    out: dict[str, DomainHealth] = {}
    for dom, nodes in sorted(domains.items()):
        counts = dict.fromkeys(KINDS, 0)
        pen = 0.0
        for n in nodes:
            for e in by_node.get(n, ()):
                counts[e.kind] += 1
                pen += _decayed(e, now, half_life_s)
        out[dom] = DomainHealth(dom, tuple(sorted(nodes)), counts, round(pen, 6),
                                round(score(pen), 6))
    return out


def node_scores(events: Iterable[FailureEvent], racks: Mapping[str, Collection[str]],
                now: float, window_s: float, half_life_s: float) -> dict[str, float]:
    """Per node in a rack: the score of its own penalty plus its rack's."""
    evs = within(events, now, window_s)
    racks_h = domain_health(evs, racks, now, window_s, half_life_s)
    own: dict[str, float] = {}
    for e in evs:
        own[e.node] = own.get(e.node, 0.0) + _decayed(e, now, half_life_s)
    out: dict[str, float] = {}
    for h in racks_h.values():
        for n in h.nodes:
            out[n] = round(score(h.penalty + own.get(n, 0.0)), 6)
    return out


def target_weight(base: int, node_score: float, step: int, levels: int) -> int:
    """The weight a node of ``base`` weight should have at ``node_score``."""
    level = min(levels, int((1.0 - node_score) * levels + 1e-9))
    return min(MAX_WEIGHT, base + level * step)


@dataclass(frozen=True)
class WeightRecord:
    """``weights/<node>``: a weight the leader set, and the one it found there before."""

    node: str
    base: int
    applied: int
    at: float

    def to_json(self) -> bytes:
        """The etcd value."""
        return dump({"node": self.node, "base": self.base, "applied": self.applied,
                     "at": self.at})

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> WeightRecord:
        """Decode; RecordError naming the key and the field if malformed."""
        r = Reader(key, raw)
        return cls(r.text("node"), r.integer("base", 0, MAX_WEIGHT),
                   r.integer("applied", 0, MAX_WEIGHT), r.num("at"))


@dataclass(frozen=True)
class WeightAction:
    """One change: set ``weight`` (None: leave Slurm alone), then store or drop the record."""

    node: str
    weight: int | None
    record: WeightRecord | None   # None: delete weights/<node>
    why: str


def reconcile(current: Mapping[str, int], owned: Mapping[str, WeightRecord],
              scores: Mapping[str, float], step: int, levels: int,
              now: float, pinned: Collection[str] = ()) -> list[WeightAction]:
    """What to change so every node Slurm shows (``current``) has the weight its score asks
    for, touching only weights this leader set (see the module docstring). A node an admin
    pinned is never touched; what the leader had recorded for it is dropped."""
    actions: list[WeightAction] = []
    for node in sorted(current):
        cur = current[node]
        rec = owned.get(node)
        if node in pinned:
            if rec is not None:
                actions.append(WeightAction(node, None, None,
                                            f"weight pinned by an admin ({cur}): left alone"))
            continue
        if rec is not None and cur not in (rec.applied, rec.base):
            actions.append(WeightAction(node, None, None,
                                        f"weight {cur} set by someone else: left alone"))
            continue
        base = rec.base if rec is not None else cur
        want = target_weight(base, scores.get(node, 1.0), step, levels)
        if want == base:
            if rec is not None:
                actions.append(WeightAction(node, base if cur != base else None, None,
                                            f"score recovered: weight back to {base}"))
            continue
        if cur != want:
            why = (f"weight {cur} reset (reconfigure or restart): {want}"
                   if rec is not None and cur == rec.base
                   else f"score {scores.get(node, 1.0):.2f}: weight {want} (base {base})")
            actions.append(WeightAction(node, want, WeightRecord(node, base, want, now), why))
        elif rec is None or rec.applied != want:
            actions.append(WeightAction(node, None, WeightRecord(node, base, want, now),
                                        f"weight {want} recorded"))
    return actions
