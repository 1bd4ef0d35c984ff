"""State store: the StateStore contract, its backends, the key layout and the factory."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

from raps_slurm.config import StoreConfig, node_dir
from raps_slurm.errors import ConfigError
from raps_slurm.store.base import (
    MAX_TXN_OPS,
    Delete,
    Guard,
    KeyValue,
    Lease,
    Put,
    StateStore,
    StoreStatus,
    TxnOp,
    Watch,
    WatchEvent,
)
from raps_slurm.store.etcd import EtcdStore
from raps_slurm.store.keys import Keys
from raps_slurm.store.memory import MemoryStore

__all__ = ["MAX_TXN_OPS", "Delete", "EtcdStore", "Guard", "KeyValue", "Keys", "Lease",
           "MemoryStore", "Put", "StateStore", "StoreStatus", "TxnOp", "Watch", "WatchEvent",
           "open_store"]


def open_store(cfg: StoreConfig, node: str | None = None) -> tuple[StateStore, Keys]:
    """The etcd store and key builder a RAPS daemon or hook uses, from ``store.*`` config.

    ``%n`` in ``store.user``, ``password_file``, ``cert_file`` and ``key_file`` becomes
    ``node`` (the agent's ``--node``), by default this host's short name: each compute
    node's agent is its own etcd user (docs/store.md, Roles)."""
    node = node or socket.gethostname().split(".")[0]
    cfg = dataclasses.replace(
        cfg, user=node_dir(cfg.user, node), password_file=node_dir(cfg.password_file, node),
        cert_file=node_dir(cfg.cert_file, node), key_file=node_dir(cfg.key_file, node))
    password: str | None = None
    if cfg.password_file:
        try:
            password = Path(cfg.password_file).read_text().strip()
        except OSError as exc:
            raise ConfigError([f"store.password_file: cannot read {cfg.password_file}: "
                               f"{exc.strerror or exc}"]) from None
    store = EtcdStore(cfg.endpoints, timeout=cfg.timeout_sec, ca_cert=cfg.ca_cert or None,
                      cert_file=cfg.cert_file or None, key_file=cfg.key_file or None,
                      user=cfg.user or None, password=password)
    return store, Keys(cfg.prefix)
