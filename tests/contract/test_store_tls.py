"""The store over TLS with client certificates, as the production example configures it
(configs/production.yaml): a real etcd demanding a client certificate signed by its CA."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raps_slurm.config import parse_config
from raps_slurm.errors import StoreError
from raps_slurm.store import EtcdStore, Guard, Put, open_store
from raps_slurm.testing.etcd import EtcdServer, make_tls

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.etcd
def test_tls_with_a_client_certificate(tmp_path: Path) -> None:
    tls = make_tls(tmp_path / "tls")
    with EtcdServer(tls=tls) as server:
        assert server.url.startswith("https://")
        prod = yaml.safe_load((REPO / "configs" / "production.yaml").read_text())
        prod["store"].update({"endpoints": [server.url], "ca_cert": str(tls.ca),
                              "cert_file": str(tls.client_cert),
                              "key_file": str(tls.client_key), "user": "", "password_file": ""})
        store, keys = open_store(parse_config(prod).store)
        with store:
            key = keys.job("1")
            assert store.create(key, b"v1")
            kv = store.get(key)
            assert kv is not None and kv.value == b"v1"
            assert store.transaction([Guard(key, kv.mod_revision)], [Put(key, b"v2")])
            with store.watch_prefix(keys.jobs_prefix()) as w:
                store.put(key, b"v3")
                ev = w.next(5.0)
                assert ev is not None and ev.value == b"v3"
            lease = store.grant_lease(5)
            store.put(keys.node("n1"), b"{}", lease)
            store.refresh_lease(lease)
        # no client certificate: refused by the server, one clear error
        with pytest.raises(StoreError):
            EtcdStore([server.url], ca_cert=str(tls.ca), timeout=3).get(key)
        # a server certificate from another CA: refused by the client
        other = make_tls(tmp_path / "other")
        with pytest.raises(StoreError):
            EtcdStore([server.url], ca_cert=str(other.ca), cert_file=str(tls.client_cert),
                      key_file=str(tls.client_key), timeout=3).get(key)
