"""Per-node heartbeat keys (issue 21, item 3): the KDF, verification only with the key of the
node a datagram names, acks and probes signed with that node's key, the node key file and
its CLI, and the replay guard's refusals (future incarnation, impossible counter) and
``forget``."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raps_slurm.errors import BadDatagram, ConfigError
from raps_slurm.wire._udp import hmac_state
from raps_slurm.wire.heartbeat import (
    AppReport,
    Heartbeat,
    NodeKeys,
    ReplayGuard,
    agent_keys,
    claimed_node,
    create_node_key,
    decode_from_node,
    encode,
    load_key,
    node_key,
)

CLUSTER = bytes(range(64))
NEW = bytes(range(1, 65))
U64 = (1 << 64) - 1


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    path.chmod(0o600)
    return str(path)


# --- the KDF ----------------------------------------------------------------------------------

def test_node_key_is_a_domain_separated_hmac_of_the_cluster_key() -> None:
    want = hmac.new(CLUSTER, b"raps-node-key\x00n5", hashlib.sha256).digest()
    assert node_key(CLUSTER, "n5") == want and len(want) == 32
    assert node_key(CLUSTER, "n5") != node_key(CLUSTER, "n6")
    assert node_key(CLUSTER, "n5") != node_key(NEW, "n5")
    # no name is a prefix trick of another: the context ends with a NUL no name holds
    assert node_key(CLUSTER, "n1") != node_key(CLUSTER, "n10")
    with pytest.raises(BadDatagram, match="name"):
        node_key(CLUSTER, "../etc")


# --- verification with the named node's key ------------------------------------------------

def test_a_datagram_verifies_only_with_the_key_of_the_node_it_names() -> None:
    keys = NodeKeys(CLUSTER)
    now = time.time()
    hb = Heartbeat("n5", 1, 1, now)
    assert decode_from_node(encode(hb, node_key(CLUSTER, "n5")), keys) == hb
    for wrong in (node_key(CLUSTER, "n6"), CLUSTER, node_key(NEW, "n5")):
        with pytest.raises(BadDatagram, match="signature"):
            decode_from_node(encode(hb, wrong), keys)
    report = AppReport("n5", 1, 1, now)
    assert decode_from_node(encode(report, node_key(CLUSTER, "n5")), keys) == report
    with pytest.raises(BadDatagram, match="signature"):
        decode_from_node(encode(report, node_key(CLUSTER, "n4")), keys)


def test_a_datagram_without_a_readable_name_is_a_bad_signature() -> None:
    good = encode(Heartbeat("n1", 1, 1, 5.0), node_key(CLUSTER, "n1"))
    assert claimed_node(good) == "n1"
    bad_kind = good[:4] + bytes((99,)) + good[5:]
    bad_length = good[:30] + bytes((200,)) + good[31:]  # the name length byte
    for data in (bad_kind, bad_length):
        with pytest.raises(BadDatagram, match="signature"):
            decode_from_node(data, NodeKeys(CLUSTER))
    with pytest.raises(BadDatagram, match="magic"):
        claimed_node(b"XYZ" + good[3:])


def test_node_keys_rollover_and_bounded_cache() -> None:
    keys = NodeKeys(CLUSTER, NEW, max_nodes=3)
    data = encode(Heartbeat("n1", 1, 1, 5.0), node_key(NEW, "n1"))
    signer = hmac_state(node_key(CLUSTER, "n1"))
    assert keys.verified("n1", data) == signer  # signs with the first
    for i in range(10):  # made-up names that never verify are never kept
        assert keys.verified(f"x{i}", data) is None
    assert list(keys._cache) == ["n1"]
    for i in range(5):
        keys.key(f"n{i + 2}")
    assert len(keys._cache) == 3 and "n1" not in keys._cache  # the oldest went first
    assert keys.verified("n1", data) == signer  # derived again


# --- the replay guard ---------------------------------------------------------------------

def test_guard_refuses_a_future_incarnation_and_an_impossible_counter() -> None:
    g = ReplayGuard(max_skew=5.0)
    now = 1_700_000_000.0
    ns = int(now * 1e9)
    assert g.check_fields("n1", U64, U64, now, now) == "future"
    assert g.check_fields("n1", ns + 6 * 10**9, 1, now, now) == "future"
    # an incarnation 10 s old has had time for at most ~15,000 beats, not 10**9
    assert g.check_fields("n1", ns - 10 * 10**9, 10**9, now, now) == "counter"
    assert g.last("n1") is None  # no refusal is remembered
    assert g.check_fields("n1", ns + 4 * 10**9, 1, now, now) is None  # within the skew
    assert g.check_fields("n1", ns - 10 * 10**9, 5000, now, now) == "replay"  # older life


def test_guard_forget_then_accepts_a_smaller_incarnation() -> None:
    g = ReplayGuard(max_skew=5.0)
    now = 1_700_000_000.0
    ns = int(now * 1e9)
    assert g.check_fields("n1", ns, 3, now, now) is None
    assert g.check_fields("n1", ns - 3600 * 10**9, 1, now, now) == "replay"
    g.forget("n1")
    assert g.check_fields("n1", ns - 3600 * 10**9, 1, now, now) is None
    assert g.last("n1") == (ns - 3600 * 10**9, 1)


# --- the node key file and its CLI ---------------------------------------------------------

def test_create_node_key_writes_the_nodes_key_privately(tmp_path: Path) -> None:
    out = tmp_path / "n3.key"
    create_node_key(str(out), CLUSTER, "n3")
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert load_key(str(out), node="n3") == node_key(CLUSTER, "n3")
    with pytest.raises(ConfigError, match="already exists"):
        create_node_key(str(out), CLUSTER, "n3")
    with pytest.raises(ConfigError, match="node key"):
        create_node_key(str(tmp_path / "bad.key"), CLUSTER, "-rf")
    with pytest.raises(ConfigError, match="rapsctl config node-key n9"):
        load_key(str(tmp_path / "missing.key"), node="n9")


def test_rapsctl_config_node_key(tmp_path: Path) -> None:
    cluster = _write(tmp_path / "raps.key", CLUSTER)
    out = tmp_path / "n2.key"
    env = {k: v for k, v in os.environ.items() if k != "RAPS_CONFIG"}
    r = subprocess.run([sys.executable, "-m", "raps_slurm.cli", "config", "node-key", "n2",
                        "--cluster-key", cluster, "--out", str(out)], capture_output=True,
                       text=True, env=env, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == node_key(CLUSTER, "n2")
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    again = subprocess.run([sys.executable, "-m", "raps_slurm.cli", "config", "node-key", "n2",
                            "--cluster-key", cluster, "--out", str(out)], capture_output=True,
                           text=True, env=env, timeout=60, check=False)
    assert again.returncode != 0 and "already exists" in again.stderr
    several = subprocess.run([sys.executable, "-m", "raps_slurm.cli", "config", "node-key",
                              "n3", "n4", "--cluster-key", cluster,
                              "--out", str(tmp_path / "%n.key")], capture_output=True,
                             text=True, env=env, timeout=60, check=False)
    assert several.returncode == 0, several.stderr
    for node in ("n3", "n4"):
        assert (tmp_path / f"{node}.key").read_bytes() == node_key(CLUSTER, node)
    unnamed = subprocess.run([sys.executable, "-m", "raps_slurm.cli", "config", "node-key",
                              "n5", "n6", "--cluster-key", cluster,
                              "--out", str(tmp_path / "one.key")], capture_output=True,
                             text=True, env=env, timeout=60, check=False)
    assert unnamed.returncode != 0 and "%n" in unnamed.stderr


def test_agent_keys(tmp_path: Path) -> None:
    # no node key file: derived from the cluster key (and the rollover's)
    assert agent_keys("n1", "", CLUSTER, None) == (node_key(CLUSTER, "n1"), None)
    assert agent_keys("n1", "", CLUSTER, NEW) == (node_key(CLUSTER, "n1"), node_key(NEW, "n1"))
    path = _write(tmp_path / "n1.key", node_key(CLUSTER, "n1"))
    assert agent_keys("n1", path, CLUSTER, NEW) == (node_key(CLUSTER, "n1"),
                                                    node_key(NEW, "n1"))
    rolled = _write(tmp_path / "n1.new", node_key(NEW, "n1"))  # installed early in a rollover
    assert agent_keys("n1", rolled, CLUSTER, NEW) == (node_key(NEW, "n1"),
                                                      node_key(CLUSTER, "n1"))
    wrong = _write(tmp_path / "n2.key", node_key(CLUSTER, "n2"))
    with pytest.raises(ConfigError, match="not the key of n1"):
        agent_keys("n1", wrong, CLUSTER, None)
