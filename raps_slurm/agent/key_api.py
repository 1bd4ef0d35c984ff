"""The ``rank_keys`` op of the agent's local API: the keys of one rank's traffic with a peer.

``rank_keys {job, rank, peer}``  for rank ``rank`` of ``job`` on this node and rank
    ``peer``: ``node`` and ``epoch``, where the rank map says ``peer`` runs; ``connect``,
    the key this rank proves when it connects to ``peer`` (hex, null when this node holds
    no ticket for that node); ``accept``, the keys ``peer`` may prove when it connects
    here (hex, a second one during a key rollover). Served only to the uid that owns the
    job (``SO_PEERCRED`` against the owner recorded at registration) and only for a rank
    that uid registered with this agent; root may ask for any job.

The keys are :func:`~raps_slurm.checkpoint.peer_keys.rank_key` of the two nodes' pair key
(the one chunk transfer uses) and the run, so only the agents of the two nodes can hand
them out, and ranks of an earlier run of the job cannot talk to this one's. No job holds a
master secret: root on a node obtains only keys of connections that start or end there.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import TypeVar

from raps_slurm.agent.api_schema import JOB, RANK, Refused
from raps_slurm.agent.local_api import (
    Extension,
    Peer,
    RankTable,
    close_fds,
    registered_epoch,
    require_owner,
)
from raps_slurm.checkpoint.peer_keys import PeerKeys, rank_key
from raps_slurm.core.jobs import JobRecord, RankEntry
from raps_slurm.errors import RecordError
from raps_slurm.store import Keys, StateStore

T = TypeVar("T")


def run_name(record: JobRecord) -> str:
    """What names one run of a job in its rank keys."""
    return f"{record.job_id}\0{record.restart_count}\0{record.registered_at!r}"


class RankKeyOps:
    """The handler."""

    def __init__(self, store: StateStore, keys: Keys, ranks: RankTable,
                 owner_of: Callable[[str], int | None], peer_keys: PeerKeys) -> None:
        self.store, self.keys, self.ranks, self._owner_of = store, keys, ranks, owner_of
        self.peer_keys = peer_keys

    def extensions(self) -> dict[str, Extension]:
        """What :class:`LocalApiServer` serves for rank keys."""
        return {"rank_keys": Extension({"job": JOB, "rank": RANK, "peer": RANK},
                                       self.rank_keys)}

    def rank_keys(self, f: dict[str, object], peer: Peer, fds: list[int]
                  ) -> tuple[dict[str, object], list[int]]:
        close_fds(fds)
        job, rank = typing.cast(str, f["job"]), typing.cast(int, f["rank"])
        other = typing.cast(int, f["peer"])
        require_owner(self._owner_of, peer, job)
        registered_epoch(self.ranks, peer, job, rank)  # a rank of this uid, on this node
        run = run_name(self._record(job))
        entry = self._entry(job, other)
        connect = self.peer_keys.connecting(entry.node)
        accept = self.peer_keys.accepting(entry.node)
        return {"ok": True, "node": entry.node, "epoch": entry.epoch,
                "connect": None if connect is None else rank_key(connect, run).hex(),
                "accept": [rank_key(k, run).hex() for k in accept]}, []

    def _record(self, job: str) -> JobRecord:
        return _read(self.store, self.keys.job(job), JobRecord.from_json, "no_job",
                     f"job {job} is not registered")

    def _entry(self, job: str, rank: int) -> RankEntry:
        return _read(self.store, self.keys.job_rank(job, rank), RankEntry.from_json,
                     "no_peer", f"rank {rank} of job {job} is not in the rank map")


def _read(store: StateStore, key: str, parse: Callable[[str, bytes], T], kind: str,
          missing: str) -> T:
    """The record at ``key``; Refused(``kind``) if it is missing or unreadable."""
    kv = store.get(key)
    if kv is None:
        raise Refused(kind, missing)
    try:
        return parse(kv.key, kv.value)
    except RecordError as exc:
        raise Refused(kind, str(exc)) from None
