"""Least-privilege etcd roles, one per RAPS identity (docs/store.md, Roles). Pure data.

Which component writes what (``keys.py`` has the layout):

- ``raps-coordinator`` (the leader): ``leader``, ``jobs/<job>/map|ranks|groups|escalation``,
  node verdicts, ``history/``, ``weights/``, ``plans/``, ``purged/``, rank HUNG verdicts,
  purges; compacts the history. It may write the whole prefix.
- ``raps-hooks`` (PrologSlurmctld/EpilogSlurmctld, SlurmUser): the job record
  ``jobs/<job>``; deletes ``jobs/<job>/``, the job's reports (a job id
  used again) and ``purged/<job>``. Nothing else, not even a read.
- ``raps-agent`` (a role without a user, held by every agent): the checkpoint records of
  ranks (``reports/jobs/``). It reads ``leader``, ``jobs/``, ``plans/``, ``purged/``,
  ``nodes/`` and ``reports/``.
- ``raps-agent-<node>`` (root on that compute node; role and user of that name, the user
  also holds ``raps-agent``): that node's ``nodes/<node>`` registration and
  ``nodes/<node>/health`` (those two keys alone), and what it reports about ranks
  (``reports/ranks/<node>/``: peers, msgstats, ESCALATE verdicts, the generations it
  committed) and plans
  (``reports/phases/<node>/``). Readers take such a report only from a node of the job.
- ``raps-admin`` (``rapsctl`` of an admin: ``audit/``, ``weight-pins/``, cancelling plans,
  and every read): the whole prefix. Creating these roles takes etcd's ``root``.

What stays shared (one role serves every job): an agent may write any job's shared
checkpoint records; a restore trusts only the commits under each primary's own prefix
(docs/store.md, Roles).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from raps_slurm.store.keys import Keys

Permission = Literal["read", "write", "readwrite"]

COORDINATOR, HOOKS, AGENT, ADMIN = "raps-coordinator", "raps-hooks", "raps-agent", "raps-admin"


def agent_user(node: str) -> str:
    """The etcd user (and own role) of the agent of ``node``."""
    return f"{AGENT}-{node}"


@dataclass(frozen=True)
class Grant:
    """A permission on ``key`` alone, or on every key starting with it (``prefix``)."""

    permission: Permission
    key: str
    prefix: bool = True


@dataclass(frozen=True)
class Role:
    """An etcd role and, when ``user``, the user of the same name that holds it and the
    roles named in ``also``."""

    name: str
    used_by: str
    grants: tuple[Grant, ...]
    user: bool = True
    also: tuple[str, ...] = ()


def roles(keys: Keys, nodes: Iterable[str] = ()) -> tuple[Role, ...]:
    """The RAPS roles for the installation under ``keys.prefix``: the four shared ones
    and one per compute node in ``nodes``."""
    everything = (Grant("readwrite", keys.prefix),)
    # The node's two keys alone, not its prefix: the leader's verdicts live under it.
    per_node = tuple(Role(agent_user(n), f"raps-agent on {n}",
                          (Grant("readwrite", keys.node(n), prefix=False),
                           Grant("readwrite", keys.node_health(n), prefix=False),
                           Grant("readwrite", keys.node_rank_reports_prefix(n)),
                           Grant("readwrite", keys.node_plan_events_prefix(n))),
                          also=(AGENT,))
                     for n in nodes)
    return (
        Role(COORDINATOR, "raps-coordinator", everything),
        Role(HOOKS, "PrologSlurmctld and EpilogSlurmctld (hooks)",
             (Grant("readwrite", keys.jobs_prefix()),
              Grant("readwrite", keys.job_reports_root()),
              Grant("readwrite", keys.rank_reports_root()),
              Grant("readwrite", keys.plan_events_prefix()),
              Grant("readwrite", keys.purged_prefix()))),
        Role(AGENT, "every raps-agent (through its raps-agent-<node> user)",
             (Grant("read", keys.leader(), prefix=False),
              Grant("read", keys.jobs_prefix()),
              Grant("read", keys.plans_prefix()),
              Grant("read", keys.purged_prefix()),
              Grant("read", keys.nodes_prefix()),
              Grant("read", keys.reports_prefix()),
              Grant("readwrite", keys.job_reports_root())), user=False),
        Role(ADMIN, "rapsctl (admins)", everything),
        *per_node,
    )


def permits(role: Role, key: str, permission: Literal["read", "write"]) -> bool:
    """What etcd decides for one key under this role (the tests hold the code to it)."""
    return any(permission in g.permission
               and (key.startswith(g.key) if g.prefix else key == g.key)
               for g in role.grants)


def user_permits(table: Iterable[Role], user: str, key: str,
                 permission: Literal["read", "write"]) -> bool:
    """What etcd decides for one key for ``user``: any of the roles it holds permits it."""
    by_name = {r.name: r for r in table}
    own = by_name.get(user)
    if own is None or not own.user:
        return False
    return any(permits(by_name[name], key, permission) for name in (own.name, *own.also))


def etcdctl_commands(keys: Keys, no_password: bool = False, nodes: Iterable[str] = ()
                     ) -> list[str]:
    """The ``etcdctl`` lines that create the roles and their users (run as root)."""
    out = []
    for role in roles(keys, nodes):
        out.append(f"# {role.name}: used by {role.used_by}")
        out.append(f"etcdctl role add {role.name}")
        for g in role.grants:
            flag = " --prefix=true" if g.prefix else ""
            out.append(f"etcdctl role grant-permission {role.name}{flag} {g.permission} "
                       f"{g.key}")
        if not role.user:
            continue
        out.append(f"etcdctl user add {role.name}" + (" --no-password" if no_password else ""))
        for held in (role.name, *role.also):
            out.append(f"etcdctl user grant-role {role.name} {held}")
    return out
