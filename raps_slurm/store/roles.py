"""Least-privilege etcd roles, one per RAPS identity (docs/store.md, Roles). Pure data.

Which component writes what (``keys.py`` has the layout):

- ``raps-coordinator`` (the leader): ``leader``, ``jobs/<job>/map|ranks|groups|escalation``,
  node verdicts, ``history/``, ``weights/``, ``plans/``, ``purged/``, rank HUNG verdicts,
  purges; compacts the history. It may write the whole prefix.
- ``raps-hooks`` (PrologSlurmctld/EpilogSlurmctld, SlurmUser): the job record
  ``jobs/<job>`` and its ``secret``; deletes ``jobs/<job>/``, ``reports/jobs/<job>/`` (a
  job id used again) and ``purged/<job>``. Nothing else, not even a read.
- ``raps-agent`` (root on each compute node): its ``nodes/<node>`` registration and
  ``nodes/<node>/health``; under ``reports/``: peers, msgstats, ESCALATE verdicts and
  checkpoint records of ranks, phase reports of plans. It reads ``leader``, ``jobs/``,
  ``plans/``, ``purged/``, ``nodes/`` and ``reports/``.
- ``raps-admin`` (``rapsctl`` of an admin: ``audit/``, ``weight-pins/``, cancelling plans,
  and every read): the whole prefix. Creating these roles takes etcd's ``root``.

What stays shared inside a role (one role serves every node and every job): an agent may
write any node's keys under ``nodes/`` (the leader's verdicts share each node's prefix)
and any job's reports; see docs/store.md, Roles, for what that allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from raps_slurm.store.keys import Keys

Permission = Literal["read", "write", "readwrite"]

COORDINATOR, HOOKS, AGENT, ADMIN = "raps-coordinator", "raps-hooks", "raps-agent", "raps-admin"


@dataclass(frozen=True)
class Grant:
    """A permission on ``key`` alone, or on every key starting with it (``prefix``)."""

    permission: Permission
    key: str
    prefix: bool = True


@dataclass(frozen=True)
class Role:
    """An etcd role and the user of the same name that holds it."""

    name: str
    used_by: str
    grants: tuple[Grant, ...]


def roles(keys: Keys) -> tuple[Role, ...]:
    """The four RAPS roles for the installation under ``keys.prefix``."""
    everything = (Grant("readwrite", keys.prefix),)
    return (
        Role(COORDINATOR, "raps-coordinator", everything),
        Role(HOOKS, "PrologSlurmctld and EpilogSlurmctld (hooks)",
             (Grant("readwrite", keys.jobs_prefix()),
              Grant("readwrite", keys.job_reports_root()),
              Grant("readwrite", keys.purged_prefix()))),
        Role(AGENT, "raps-agent",
             (Grant("read", keys.leader(), prefix=False),
              Grant("read", keys.jobs_prefix()),
              Grant("read", keys.plans_prefix()),
              Grant("read", keys.purged_prefix()),
              Grant("readwrite", keys.nodes_prefix()),
              Grant("readwrite", keys.reports_prefix()))),
        Role(ADMIN, "rapsctl (admins)", everything),
    )


def permits(role: Role, key: str, permission: Literal["read", "write"]) -> bool:
    """What etcd decides for one key under this role (the tests hold the code to it)."""
    return any(permission in g.permission
               and (key.startswith(g.key) if g.prefix else key == g.key)
               for g in role.grants)


def etcdctl_commands(keys: Keys, no_password: bool = False) -> list[str]:
    """The ``etcdctl`` lines that create the roles and their users (run as root)."""
    out = []
    for role in roles(keys):
        out.append(f"# {role.name}: used by {role.used_by}")
        out.append(f"etcdctl role add {role.name}")
        for g in role.grants:
            flag = " --prefix=true" if g.prefix else ""
            out.append(f"etcdctl role grant-permission {role.name}{flag} {g.permission} "
                       f"{g.key}")
        out.append(f"etcdctl user add {role.name}" + (" --no-password" if no_password else ""))
        out.append(f"etcdctl user grant-role {role.name} {role.name}")
    return out
