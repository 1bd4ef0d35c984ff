"""Every key RAPS writes, built in one place under one prefix (docs/architecture.md,
State in etcd).

Layout under the prefix (default ``/raps/v1/``)::

    leader
    nodes/<node>                  nodes/<node>/health           nodes/<node>/verdict
    nodes/<node>/health-verdict
    jobs/<jobid>                  jobs/<jobid>/map              jobs/<jobid>/secret
    jobs/<jobid>/ranks/<rank>     jobs/<jobid>/groups/<rank>
    jobs/<jobid>/escalation
    plans/<id>
    reports/jobs/<jobid>/ckpt/<rank>/<gen>   reports/jobs/<jobid>/verdicts/<rank>
    reports/jobs/<jobid>/peers/<rank>        reports/jobs/<jobid>/msgstats/<rank>
    reports/plans/<id>/<phase>    (launched, restored, running, cancelled)
    purged/<jobid>                a finished job's keys are gone; agents delete its local data
    weights/<node>                a Slurm Weight the leader set (and the one it found before)
    weight-pins/<node>            an admin's pinned Weight (rapsctl update node): left alone
    audit/<time>-<host>-<pid>     one admin action (rapsctl drain/resume/...): who, what, when

What the node agents write lives under ``nodes/`` and ``reports/`` only, so that etcd
roles can keep an agent's credential away from everything else (``roles.py``,
docs/store.md, Roles): keep it so when adding a key.

Numbers are written in decimal without padding, so a prefix listing is sorted
as text (``10`` before ``9``): sort numerically after reading.
Prefix methods (``*_prefix``, ``*_root``) end with ``/`` so that listing ``n1`` never also
returns ``n10``: list with them, never with a leaf key (``job_plans_prefix`` and
``job_plan_events_prefix`` end with ``-``: plan ids are ``<job>-<rank>-<epoch>``, so job
12's never match job 123's).
"""

from __future__ import annotations

DEFAULT_PREFIX = "/raps/v1/"


def _component(value: object, what: str) -> str:
    """One path component: non-empty, no '/', no control characters."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{what} must be a str or int, got {type(value).__name__}")
    text = str(value)
    if not text:
        raise ValueError(f"{what} must not be empty")
    if "/" in text:
        raise ValueError(f"{what} must not contain '/': {text!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ValueError(f"{what} must not contain control characters: {text!r}")
    return text


def _number(value: object, what: str) -> str:
    """A rank or generation: an int >= 0 (bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r}")
    return str(value)


class Keys:
    """Builds and splits the keys of one RAPS installation."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if not isinstance(prefix, str) or not prefix.startswith("/") or not prefix.endswith("/"):
            raise ValueError(f"key prefix must start and end with '/', got {prefix!r}")
        if "//" in prefix:
            raise ValueError(f"key prefix must not contain an empty component: {prefix!r}")
        self._prefix = prefix

    @property
    def prefix(self) -> str:
        """The prefix every key starts with (ends with '/')."""
        return self._prefix

    def __repr__(self) -> str:
        return f"Keys({self._prefix!r})"

    def leader(self) -> str:
        """The coordinator leader key (held under the leader's lease)."""
        return f"{self._prefix}leader"

    def nodes_prefix(self) -> str:
        """Prefix of every node key (registrations and health)."""
        return f"{self._prefix}nodes/"

    def node(self, name: str) -> str:
        """Agent registration of one node (held under the node's lease)."""
        return self.nodes_prefix() + _component(name, "node name")

    def node_health(self, name: str) -> str:
        """Last probe results and health score of one node."""
        return self.node(name) + "/health"

    def node_verdict(self, name: str) -> str:
        """The last failure-detector verdict about one node, with its evidence."""
        return self.node(name) + "/verdict"

    def node_health_verdict(self, name: str) -> str:
        """The health policy's current level, score and reason for one node."""
        return self.node(name) + "/health-verdict"

    def purged_prefix(self) -> str:
        """Prefix of the tombstones of purged jobs."""
        return f"{self._prefix}purged/"

    def purged(self, job_id: int | str) -> str:
        """Tombstone of a purged job: agents delete its node-local checkpoint dirs."""
        return self.purged_prefix() + _component(job_id, "job id")

    def jobs_prefix(self) -> str:
        """Prefix of every job key."""
        return f"{self._prefix}jobs/"

    def job(self, job_id: int | str) -> str:
        """Job record: owner, restart count, spec, rank map."""
        return self.jobs_prefix() + _component(job_id, "job id")

    def job_prefix(self, job_id: int | str) -> str:
        """Everything below one job (ranks, groups, checkpoints), not the job key itself."""
        return self.job(job_id) + "/"

    def job_map(self, job_id: int | str) -> str:
        """The rank map the coordinator leader built for the job's current run."""
        return self.job_prefix(job_id) + "map"

    def job_groups_prefix(self, job_id: int | str) -> str:
        """Prefix of the backup groups of one job."""
        return self.job_prefix(job_id) + "groups/"

    def job_ranks_prefix(self, job_id: int | str) -> str:
        """Prefix of the rank assignments of one job."""
        return self.job_prefix(job_id) + "ranks/"

    def job_rank(self, job_id: int | str, rank: int) -> str:
        """Assignment of one rank: node, step, status, epoch."""
        return self.job_ranks_prefix(job_id) + _number(rank, "rank")

    def job_group(self, job_id: int | str, rank: int) -> str:
        """Backup group of one rank."""
        return self.job_groups_prefix(job_id) + _number(rank, "rank")

    def reports_prefix(self) -> str:
        """Prefix of what agents report (and the leader's rank verdicts): the one subtree
        besides ``nodes/`` the agent role may write."""
        return f"{self._prefix}reports/"

    def job_reports_root(self) -> str:
        """Prefix of the reports of every job."""
        return self.reports_prefix() + "jobs/"

    def job_reports_prefix(self, job_id: int | str) -> str:
        """Everything reported about one job's ranks (verdicts, peers, msgstats, ckpt)."""
        return self.job_reports_root() + _component(job_id, "job id") + "/"

    def job_rank_verdict(self, job_id: int | str, rank: int) -> str:
        """The last verdict about one rank (the leader's HUNG, an agent's ESCALATE)."""
        return self.job_reports_prefix(job_id) + "verdicts/" + _number(rank, "rank")

    def job_escalation(self, job_id: int | str) -> str:
        """A whole-job requeue the leader decided for one run of the job, and when Slurm
        took it."""
        return self.job_prefix(job_id) + "escalation"

    def job_peer(self, job_id: int | str, rank: int) -> str:
        """Where a rank listens for its peers (host, port, epoch), published by its agent."""
        return self.job_reports_prefix(job_id) + "peers/" + _number(rank, "rank")

    def job_secret(self, job_id: int | str) -> str:
        """The job's key for rank-to-rank traffic (hex), made at registration; daemons
        read it, the agent hands it to the owner's ranks only."""
        return self.job_prefix(job_id) + "secret"

    def job_msgstats_prefix(self, job_id: int | str) -> str:
        """Prefix of the ranks' message-log figures."""
        return self.job_reports_prefix(job_id) + "msgstats/"

    def job_msgstats(self, job_id: int | str, rank: int) -> str:
        """One rank's message-log figures (sent, delivered, logged, collected per peer)."""
        return self.job_msgstats_prefix(job_id) + _number(rank, "rank")

    def job_ckpts_prefix(self, job_id: int | str) -> str:
        """Prefix of the checkpoint records of every rank of one job."""
        return self.job_reports_prefix(job_id) + "ckpt/"

    def ckpt_prefix(self, job_id: int | str, rank: int) -> str:
        """Prefix of the checkpoint generations of one rank."""
        return self.job_ckpts_prefix(job_id) + _number(rank, "rank") + "/"

    def ckpt(self, job_id: int | str, rank: int, gen: int) -> str:
        """One checkpoint generation: manifest digest, size, holders, verified."""
        return self.ckpt_prefix(job_id, rank) + _number(gen, "generation")

    def history_prefix(self) -> str:
        """Prefix of every node's failure history."""
        return f"{self._prefix}history/"

    def history_event(self, node: str, event_id: str) -> str:
        """One DEAD/HUNG/DRAIN verdict about ``node`` (``event_id`` sorts by time)."""
        return (self.history_prefix() + _component(node, "node name") + "/"
                + _component(event_id, "event id"))

    def weights_prefix(self) -> str:
        """Prefix of the Slurm node weights the leader set."""
        return f"{self._prefix}weights/"

    def weight(self, node: str) -> str:
        """The weight the leader set on ``node`` and the one it found before."""
        return self.weights_prefix() + _component(node, "node name")

    def weight_pins_prefix(self) -> str:
        """Prefix of the weights an admin pinned (``rapsctl update node``)."""
        return f"{self._prefix}weight-pins/"

    def weight_pin(self, node: str) -> str:
        """An admin's pinned weight of ``node``: the leader leaves that node's weight alone."""
        return self.weight_pins_prefix() + _component(node, "node name")

    def audit_prefix(self) -> str:
        """Prefix of the admin audit records."""
        return f"{self._prefix}audit/"

    def audit(self, ident: str) -> str:
        """One admin action: who, what, when (``ident`` sorts by time)."""
        return self.audit_prefix() + _component(ident, "audit id")

    def plans_prefix(self) -> str:
        """Prefix of every recovery plan."""
        return f"{self._prefix}plans/"

    def plan(self, plan_id: str) -> str:
        """One recovery plan and its state."""
        return self.plans_prefix() + _component(plan_id, "plan id")

    def plan_events_prefix(self) -> str:
        """Prefix of what nodes (and admins) reported about the phases of plans."""
        return self.reports_prefix() + "plans/"

    def plan_event(self, plan_id: str, phase: str) -> str:
        """What a node reported about one phase of a plan."""
        return (self.plan_events_prefix() + _component(plan_id, "plan id") + "/"
                + _component(phase, "phase"))

    def job_plan_events_prefix(self, job_id: int | str) -> str:
        """Prefix of the phase reports of every plan of one job (as ``job_plans_prefix``)."""
        return self.plan_events_prefix() + _component(job_id, "job id") + "-"

    def job_plans_prefix(self, job_id: int | str) -> str:
        """Prefix of every plan of one job (plan ids start with the job id and '-')."""
        return self.plans_prefix() + _component(job_id, "job id") + "-"

    def split(self, key: str) -> tuple[str, ...]:
        """The components of ``key`` after the prefix, e.g. ``("jobs", "12", "ranks", "0")``.

        Raises ValueError for a key outside this prefix (e.g. from another install).
        """
        if not key.startswith(self._prefix) or key == self._prefix:
            raise ValueError(f"key {key!r} is not under prefix {self._prefix!r}")
        return tuple(key[len(self._prefix):].split("/"))
