"""Replica boost: one more copy for the ranks of a failing rack, dropped when it heals. Pure.

A rank whose primary sits in a rack scoring below ``system.boost_below_score``
(``core.history``) gets up to ``system.boost_extra_replicas`` checkpoint mirrors beyond
its job's replica count, each on a node of the job's pool outside the failing rack:
preferably in a rack the group does not use yet, then in the best-scoring rack, then the
least loaded node, then by name. The agents
see a group with more backups than the replica count and copy the newest generation
there (``core.checkpoints.replica_targets``). When the rack scores
``system.boost_recover_score`` or better again (hysteresis: a score hovering around the
threshold must not add and drop a copy every pass) the extra mirrors go.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from raps_slurm.model import BackupGroup


def boost(groups: Mapping[int, BackupGroup], replicas: int, rack_of: Mapping[str, str],
          rack_scores: Mapping[str, float], pool: Collection[str], dead: Collection[str],
          below: float, recover: float, extra: int) -> dict[int, BackupGroup]:
    """The groups to rewrite, by rank (see the module docstring)."""
    base = max(0, replicas - 1)  # mirrors the replica count asks for (copy 1 is the log)
    loads: dict[str, int] = {}
    for g in groups.values():
        for b in (g.log_backup, *g.ckpt_mirrors):
            if b:
                loads[b] = loads.get(b, 0) + 1
    out: dict[int, BackupGroup] = {}
    for rank, g in sorted(groups.items()):
        score = rack_scores.get(rack_of.get(g.primary, ""), 1.0)
        added = len(g.ckpt_mirrors) - base
        if score < below and added < extra:
            members = {m for m in (g.primary, g.log_backup, *g.ckpt_mirrors) if m}
            used = {rack_of.get(m) for m in members}
            home = rack_of.get(g.primary)
            free = [n for n in pool if n not in members and n not in dead
                    and n in rack_of and rack_of[n] != home]
            if not free:
                continue
            pick = min(free, key=lambda n: (rack_of[n] in used,
                                            -rack_scores.get(rack_of[n], 1.0),
                                            loads.get(n, 0), n))
            loads[pick] = loads.get(pick, 0) + 1
            out[rank] = replace(g, ckpt_mirrors=(*g.ckpt_mirrors, pick))
        elif score >= recover and added > 0:
            out[rank] = replace(g, ckpt_mirrors=g.ckpt_mirrors[:base])
    return out
