"""The agent's file descriptors: how many its local API may give to users.

The unit sets ``LimitNOFILE`` (slurm/systemd/raps-agent.service); the agent raises its
soft limit to the hard one at start, keeps :func:`reserved` descriptors for its own work
(etcd, chunk transfer, checkpoint and log files, its heartbeat socket) and divides the
rest among the users' connections: each may hold ``1 + MAX_FDS`` (its socket and the
descriptors a request carries), and one uid at most a quarter of them. So no user, and
no set of users, can leave the agent without descriptors.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

log = logging.getLogger("raps.agent")

MIN_RESERVED = 256  # descriptors never given to users, at the smallest limit
RESERVED_SHARE = 4  # ... and a quarter of a larger one
UID_SHARE = 4  # one uid may hold a quarter of the users' connections
WANTED = 65536  # what the unit asks for: less is said at start


@dataclass(frozen=True)
class FdCaps:
    """Users' connections the local API admits: per uid and all uids together."""

    limit: int
    per_uid: int
    users: int


def reserved(limit: int) -> int:
    """Descriptors kept for the agent's own work under a limit of ``limit``."""
    return max(MIN_RESERVED, limit // RESERVED_SHARE)


def caps(limit: int, per_connection: int, configured_per_uid: int) -> FdCaps:
    """The caps under a descriptor limit of ``limit``, ``per_connection`` descriptors a
    connection may hold, and the per-uid cap the server was given (the lower wins)."""
    users = max(1, (limit - reserved(limit)) // per_connection)
    return FdCaps(limit, max(1, min(configured_per_uid, users // UID_SHARE)), users)


def raise_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = WANTED if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, target,
                        exc)
    if soft < WANTED:
        log.warning("descriptor limit %d, below the %d the unit sets (LimitNOFILE): users' "
                    "connections to the local API are capped lower", soft, WANTED)
    return soft
