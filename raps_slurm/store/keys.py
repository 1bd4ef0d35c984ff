"""Every key RAPS writes, built in one place under one prefix (docs/architecture.md,
State in etcd).

Layout under the prefix (default ``/raps/v1/``)::

    leader
    nodes/<node>                  nodes/<node>/health           nodes/<node>/verdict
    nodes/<node>/health-verdict
    jobs/<jobid>                  jobs/<jobid>/map
    jobs/<jobid>/ranks/<rank>     jobs/<jobid>/groups/<rank>
    jobs/<jobid>/escalation       jobs/<jobid>/verdicts/<rank>  (the leader's HUNG)
    plans/<id>                    cancels/<id>                  (an admin's cancel-plan)
    reports/jobs/<jobid>/ckpt/<rank>/<gen>
    reports/ranks/<node>/<jobid>/verdicts/<rank>   (an agent's ESCALATE)
    reports/ranks/<node>/<jobid>/peers/<rank>      reports/ranks/<node>/<jobid>/msgstats/<rank>
    reports/ranks/<node>/<jobid>/steps/<run>       (raps-run --restart-mode step's restarts)
    reports/ranks/<node>/<jobid>/commits/<rank>/<gen>  (generations <node> committed)
    reports/phases/<node>/<id>/<phase>             (launched, restored, running, ...)
    purged/<jobid>                a finished job's keys are gone; agents delete its local data
    weights/<node>                a Slurm Weight the leader set (and the one it found before)
    weight-pins/<node>            an admin's pinned Weight (rapsctl update node): left alone
    audit/<time>-<host>-<pid>     one admin action (rapsctl drain/resume/...): who, what, when

What the node agents write lives under ``nodes/`` and ``reports/`` only, so that etcd
roles can keep an agent's credential away from everything else (``roles.py``,
docs/store.md, Roles): keep it so when adding a key. What one node reports about ranks and
plans lives under that node's own prefixes (``reports/ranks/<node>/``,
``reports/phases/<node>/``), which only its agent's user may write; readers accept it only
from a node of the job.

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
        """The checkpoint records of one job's ranks (every holder of a copy updates them)."""
        return self.job_reports_root() + _component(job_id, "job id") + "/"

    def job_hung_verdict(self, job_id: int | str, rank: int) -> str:
        """The leader's last HUNG verdict about one rank."""
        return self.job_prefix(job_id) + "verdicts/" + _number(rank, "rank")

    def rank_reports_root(self) -> str:
        """Prefix of what every node reports about ranks."""
        return self.reports_prefix() + "ranks/"

    def node_rank_reports_prefix(self, node: str) -> str:
        """Prefix of what one node reports about ranks: only that node's agent writes it."""
        return self.rank_reports_root() + _component(node, "node name") + "/"

    def node_job_reports_prefix(self, node: str, job_id: int | str) -> str:
        """What one node reports about one job's ranks."""
        return self.node_rank_reports_prefix(node) + _component(job_id, "job id") + "/"

    def rank_escalation(self, node: str, job_id: int | str, rank: int) -> str:
        """An agent's ESCALATE verdict about a rank on its node."""
        return self.node_job_reports_prefix(node, job_id) + "verdicts/" + _number(rank, "rank")

    def job_step(self, node: str, job_id: int | str, run: int) -> str:
        """When the job's MPI step last stopped for a restart and last started, in one
        run (``raps-run --restart-mode step``), as the agent of raps-run's node stamped
        them."""
        return self.node_job_reports_prefix(node, job_id) + "steps/" + _number(run, "run")

    def job_paused(self, job_id: int | str) -> str:
        """The leader's pause of the job's reports (etcd above its watermark): agents
        refuse the job's writes for ranks while it is there."""
        return self.job_prefix(job_id) + "paused"

    def job_escalation(self, job_id: int | str) -> str:
        """A whole-job requeue the leader decided for one run of the job, and when Slurm
        took it."""
        return self.job_prefix(job_id) + "escalation"

    def job_peer(self, node: str, job_id: int | str, rank: int) -> str:
        """Where a rank on ``node`` listens for its peers (host, port, epoch), published by
        that node's agent."""
        return self.node_job_reports_prefix(node, job_id) + "peers/" + _number(rank, "rank")


    def job_msgstats(self, node: str, job_id: int | str, rank: int) -> str:
        """One rank's message-log figures (sent, delivered, logged, collected per peer), as
        the agent of its node ``node`` reported them."""
        return self.node_job_reports_prefix(node, job_id) + "msgstats/" + _number(rank, "rank")

    def ckpt_commits_prefix(self, node: str, job_id: int | str, rank: int) -> str:
        """Prefix of the generations of one rank that ``node`` committed as its primary."""
        return self.node_job_reports_prefix(node, job_id) + "commits/" + \
            _number(rank, "rank") + "/"

    def ckpt_commit(self, node: str, job_id: int | str, rank: int, gen: int) -> str:
        """``node``'s own copy of a generation record it committed: only its agent writes
        it, so a restore can tell who committed a generation (the shared record at
        :meth:`ckpt` any agent may rewrite)."""
        return self.ckpt_commits_prefix(node, job_id, rank) + _number(gen, "generation")

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
        """Prefix of what nodes reported about the phases of plans."""
        return self.reports_prefix() + "phases/"

    def node_plan_events_prefix(self, node: str) -> str:
        """Prefix of what one node reported about plans: only that node's agent writes it."""
        return self.plan_events_prefix() + _component(node, "node name") + "/"

    def plan_event(self, node: str, plan_id: str, phase: str) -> str:
        """What ``node`` reported about one phase of a plan."""
        return (self.node_plan_events_prefix(node) + _component(plan_id, "plan id") + "/"
                + _component(phase, "phase"))

    def job_plan_events_prefix(self, node: str, job_id: int | str) -> str:
        """Prefix of what ``node`` reported about the plans of one job (as
        ``job_plans_prefix``)."""
        return self.node_plan_events_prefix(node) + _component(job_id, "job id") + "-"

    def cancels_prefix(self) -> str:
        """Prefix of the plans an admin cancelled (``rapsctl cancel-plan``)."""
        return f"{self._prefix}cancels/"

    def plan_cancel(self, plan_id: str) -> str:
        """An admin's cancel of one plan (who, why, when)."""
        return self.cancels_prefix() + _component(plan_id, "plan id")

    def job_cancels_prefix(self, job_id: int | str) -> str:
        """Prefix of the cancels of every plan of one job (as ``job_plans_prefix``)."""
        return self.cancels_prefix() + _component(job_id, "job id") + "-"

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
