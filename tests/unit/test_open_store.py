"""``open_store``: ``%n`` in the credential keys becomes the node, so one config serves
every compute node's agent under its own etcd user (docs/store.md, Roles)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from raps_slurm.config import StoreConfig
from raps_slurm.errors import ConfigError
from raps_slurm.store import EtcdStore, open_store


def test_the_agent_user_and_password_file_name_the_node(tmp_path: Path) -> None:
    (tmp_path / "raps-agent-n7.password").write_text("seven\n")
    (tmp_path / "raps-agent-n8.password").write_text("eight\n")
    cfg = StoreConfig(endpoints=("http://127.0.0.1:1",), user="raps-agent-%n",
                      password_file=str(tmp_path / "raps-agent-%n.password"))
    store, _ = open_store(cfg, "n7")
    assert isinstance(store, EtcdStore)
    with store:
        assert (store._user, store._password) == ("raps-agent-n7", "seven")


def test_without_a_node_it_is_the_host_short_name(tmp_path: Path) -> None:
    host = socket.gethostname().split(".")[0]
    (tmp_path / f"{host}.password").write_text("pw\n")
    store, _ = open_store(StoreConfig(user="u-%n", password_file=str(tmp_path / "%n.password")))
    with store:
        assert isinstance(store, EtcdStore) and store._user == f"u-{host}"


def test_a_missing_password_file_names_the_expanded_path(tmp_path: Path) -> None:
    cfg = StoreConfig(user="raps-agent-%n", password_file=str(tmp_path / "%n.password"))
    with pytest.raises(ConfigError, match=f"cannot read {tmp_path}/n9.password"):
        open_store(cfg, "n9")
