"""The etcd budget: can the agents' writes for ranks fill etcd? Pure arithmetic.

etcd keeps every written value until its history is compacted, and refuses every write
of every user (NOSPACE) once its database reaches ``--quota-backend-bytes``. What the
agents write on ranks' behalf is bounded per job (``agent.job_etcd_writes_per_sec``,
``agent.job_etcd_write_burst``), per node (``agent.node_etcd_kb_per_sec``,
``agent.node_etcd_burst_kb``) and per value (``agent.max_value_kb``); the leader drops
history older than ``store.compaction_retention_sec``, looking every
``store.compaction_interval_sec``. So the most those writes can hold in etcd at once is

    nodes x (node rate x (retention + interval) + node burst)

with every write counted at its largest value plus :data:`WRITE_OVERHEAD`. That must stay
within ``store.etcd_budget_share`` of the quota; the rest is for the leader, the hooks
and the nodes' own keys. :func:`etcd_budget` does the sum, one term per line.
"""

from __future__ import annotations

from dataclasses import dataclass

from raps_slurm.config import Config

# What one write costs etcd beyond its value: the key (at most ~200 bytes under the
# prefix), its revision in the index and the bolt page overhead, rounded up.
WRITE_OVERHEAD = 512


@dataclass(frozen=True)
class Term:
    """One line of the sum: a name, its value (``unit``: B, B/s or s) and how it is made."""

    name: str
    value: float
    how: str
    unit: str = "B"

    def shown(self) -> str:
        """The value for people: sizes in KiB/MiB/GiB, seconds as they are."""
        if self.unit == "s":
            return f"{self.value:g} s"
        return _size(self.value) + ("/s" if self.unit == "B/s" else "")


@dataclass(frozen=True)
class Budget:
    """The sum and its verdict; ``problems`` names the keys to change (empty: it fits)."""

    terms: tuple[Term, ...]
    worst_bytes: float
    allowed_bytes: float
    problems: tuple[str, ...]

    @property
    def fits(self) -> bool:
        """True when the worst case stays within the allowed share of the quota."""
        return not self.problems

    def lines(self) -> list[str]:
        """The arithmetic, one term per line, then the verdict."""
        out = [f"{t.name:<18} {t.shown():>14}  {t.how}" for t in self.terms]
        if self.fits:
            out.append(f"fits: worst case {_size(self.worst_bytes)} <= allowed "
                       f"{_size(self.allowed_bytes)}")
        else:
            out += [f"refused: {p}" for p in self.problems]
        return out


def _size(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def etcd_budget(cfg: Config) -> Budget:
    """The most the agents' writes for ranks can hold in etcd, against the allowed share."""
    a, s = cfg.agent, cfg.store
    per_write = a.max_value_kb * 1024 + WRITE_OVERHEAD
    job_rate = a.job_etcd_writes_per_sec * per_write
    node_rate = a.node_etcd_kb_per_sec * 1024.0
    node_burst = a.node_etcd_burst_kb * 1024.0
    window = s.compaction_retention_sec + s.compaction_interval_sec
    per_node = node_rate * window + node_burst
    worst = s.cluster_nodes * per_node
    allowed = s.etcd_budget_share * s.space_quota_bytes
    terms = (
        Term("write", per_write, f"agent.max_value_kb={a.max_value_kb} KiB + "
                                 f"{WRITE_OVERHEAD} B of key and index"),
        Term("job on a node", job_rate,
             f"agent.job_etcd_writes_per_sec={a.job_etcd_writes_per_sec:g} x write "
             f"(capped by the node's rate below)", "B/s"),
        Term("node", node_rate, f"agent.node_etcd_kb_per_sec={a.node_etcd_kb_per_sec:g}"
                                " KiB, every job on the node together", "B/s"),
        Term("node burst", node_burst, f"agent.node_etcd_burst_kb={a.node_etcd_burst_kb}"),
        Term("history", window, f"store.compaction_retention_sec="
                                f"{s.compaction_retention_sec:g} + "
                                f"store.compaction_interval_sec="
                                f"{s.compaction_interval_sec:g}", "s"),
        Term("node in history", per_node, "node x history + node burst"),
        Term("cluster in history", worst, f"store.cluster_nodes={s.cluster_nodes} x node "
                                          "in history"),
        Term("allowed", allowed, f"store.etcd_budget_share={s.etcd_budget_share:g} x "
                                 f"store.space_quota_bytes={s.space_quota_bytes}"),
    )
    problems: list[str] = []
    if s.space_quota_bytes <= 0:
        problems.append("store.space_quota_bytes is 0 (unknown): set it to etcd's "
                        "--quota-backend-bytes so that the budget can be checked")
    elif s.compaction_retention_sec <= 0:
        problems.append("store.compaction_retention_sec is 0: etcd's own compaction is "
                        "not bounded here; set a retention in seconds")
    elif worst > allowed:
        problems.append(f"the agents' writes could hold {_size(worst)} in etcd, more than "
                        f"{_size(allowed)}: lower agent.node_etcd_kb_per_sec, "
                        "agent.node_etcd_burst_kb or store.compaction_retention_sec, or "
                        "raise store.space_quota_bytes (and etcd's --quota-backend-bytes) "
                        "or store.etcd_budget_share")
    if per_write > node_burst:
        problems.append(f"agent.max_value_kb={a.max_value_kb} does not fit in "
                        f"agent.node_etcd_burst_kb={a.node_etcd_burst_kb}: no value that "
                        "large could ever be written; raise the burst or lower the value")
    if s.report_resume_share >= s.report_watermark_share:
        problems.append(f"store.report_resume_share={s.report_resume_share:g} must be below "
                        f"store.report_watermark_share={s.report_watermark_share:g}")
    return Budget(terms, worst, allowed, tuple(problems))
