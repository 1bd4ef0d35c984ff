"""The ``job_key`` op of the agent's local API: a job's key for rank-to-rank traffic.

``job_key {job, rank}``  the job's 32-byte key (hex), served only to the uid that owns
    the job (``SO_PEERCRED`` against the owner recorded at registration) and only for a
    rank that uid registered with this agent; root may ask for any job.

PrologSlurmctld writes the key at registration (``jobs/<id>/secret``, a new one every
run). A job registered without one (by a RAPS version before the key existed) gets one
here, created once with create-if-absent so that every agent hands out the same key;
where the agent's etcd role may not write ``jobs/`` (docs/store.md, Roles) that job's
ranks are refused ``no_key`` instead.
"""

from __future__ import annotations

import logging
import os
import typing
from collections.abc import Callable

from raps_slurm.agent.api_schema import JOB, RANK, Refused
from raps_slurm.agent.local_api import (
    Extension,
    Peer,
    RankTable,
    close_fds,
    registered_epoch,
    require_owner,
)
from raps_slurm.errors import StorePermissionDenied
from raps_slurm.store import Keys, StateStore

log = logging.getLogger("raps.agent")

KEY_BYTES = 32


def parse_key(raw: bytes) -> bytes | None:
    """The key stored as ``raw`` (64 hex digits), None if it is not one."""
    try:
        key = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return key if len(key) == KEY_BYTES else None


class JobKeyOps:
    """The handler."""

    def __init__(self, store: StateStore, keys: Keys, ranks: RankTable,
                 owner_of: Callable[[str], int | None]) -> None:
        self.store, self.keys, self.ranks, self._owner_of = store, keys, ranks, owner_of

    def extensions(self) -> dict[str, Extension]:
        """What :class:`LocalApiServer` serves for the job key."""
        return {"job_key": Extension({"job": JOB, "rank": RANK}, self.job_key)}

    def job_key(self, f: dict[str, object], peer: Peer, fds: list[int]
                ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        require_owner(self._owner_of, peer, job)
        registered_epoch(self.ranks, peer, job, rank)  # a rank of this uid, on this node
        return {"ok": True, "key": self.key(job).hex()}, []

    def key(self, job: str) -> bytes:
        """The job's key, made once if the registration wrote none."""
        name = self.keys.job_secret(job)
        kv = self.store.get(name)
        if kv is None and self._owner_of(job) is not None:
            try:
                if self.store.create(name, os.urandom(KEY_BYTES).hex().encode()):
                    log.info("job %s had no key for its ranks' traffic: made one", job)
            except StorePermissionDenied as exc:
                raise Refused("no_key", f"job {job} was registered without a key for its "
                              "ranks' traffic, and this agent may not make one") from exc
            kv = self.store.get(name)
        key = parse_key(kv.value) if kv is not None else None
        if key is None:
            raise Refused("no_key", f"job {job} has no valid key for its ranks' traffic")
        return key
