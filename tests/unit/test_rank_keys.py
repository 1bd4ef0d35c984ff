"""Rank traffic keys per pair of nodes: what each agent hands out, and the handshake that
checks them against the rank map (docs/messaging.md, Authentication)."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from raps_slurm.agent.api_schema import Refused
from raps_slurm.agent.key_api import RankKeyOps
from raps_slurm.agent.local_api import RankInfo, RankTable
from raps_slurm.agent.proc import Peer
from raps_slurm.checkpoint.peer_keys import PeerKeys, make_tickets
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry
from raps_slurm.runtime.frames import DATA, HELLO, Frame, FrameError, encode
from raps_slurm.runtime.rankauth import ASK_BURST, ASK_EVERY, PROTOCOL, Auth, RankKeys
from raps_slurm.runtime.transport import (
    _HELLO,
    HANDSHAKE_MAX,
    Listener,
    Outgoing,
    unix_name,
)
from raps_slurm.store import Keys, MemoryStore
from raps_slurm.wire import framing

CLUSTER = b"C" * 64
NODES = ["n1", "n2", "n3"]
OWNER = 1000


def agent(store: MemoryStore, node: str, tmp: str) -> tuple[RankKeyOps, RankTable]:
    """The key op of ``node``'s agent as installed: its node key and tickets, no cluster
    key."""
    from raps_slurm.wire.heartbeat import node_key

    path = os.path.join(tmp, f"{node}.tickets")
    with open(path, "wb") as f:
        f.write(make_tickets(CLUSTER, node, NODES))
    os.chmod(path, 0o600)
    keys = PeerKeys.from_files(node, node_key(CLUSTER, node), path)
    table = RankTable()
    return RankKeyOps(store, Keys(), table, lambda job: OWNER, keys), table


def register(table: RankTable, job: str, rank: int, uid: int = OWNER) -> None:
    now = time.monotonic()
    table.register(RankInfo(job, rank, 1, os.getpid(), uid, now, now))


def job(store: MemoryStore, restart: int = 0) -> str:
    """Job 7 with rank r on NODES[r]; rank 2 at epoch 3."""
    k = Keys()
    store.put(k.job("7"), JobRecord("7", restart, OWNER, tuple(NODES), JobSpec(),
                                    registered_at=100.0 + restart).to_json())
    for r, node in enumerate(NODES):
        store.put(k.job_rank("7", r), RankEntry(r, node, 3 if r == 2 else 1, "running",
                                                ()).to_json())
    return "7"


def ask(ops: RankKeyOps, rank: int, peer: int, uid: int = OWNER) -> dict[str, object]:
    reply, _ = ops.rank_keys({"job": "7", "rank": rank, "peer": peer},
                             Peer(os.getpid(), uid, uid), [])
    return reply


def test_the_two_nodes_of_a_pair_agree_and_a_third_gets_another_key(tmp_path: object
                                                                      ) -> None:
    store = MemoryStore()
    job(store)
    ops = {n: agent(store, n, str(tmp_path)) for n in NODES}
    for r, n in enumerate(NODES):
        register(ops[n][1], "7", r)
    a, b = ask(ops["n1"][0], 0, 1), ask(ops["n2"][0], 1, 0)
    assert a["node"] == "n2" and b["node"] == "n1" and a["epoch"] == 1
    assert a["connect"] in b["accept"] and b["connect"] in a["accept"]  # both directions
    assert a["connect"] != b["connect"]  # one key per direction
    # n3 (root there, or the owner's rank 2) asks for keys toward n2: not n1's key to n2
    c = ask(ops["n3"][0], 2, 1)
    assert c["connect"] != a["connect"] and a["connect"] not in c["accept"]
    root = ask(ops["n3"][0], 5, 1, uid=0)  # root, a rank not on n3: still n3's keys
    assert root["connect"] == c["connect"]
    # a rank on the same node: the node's own key, no ticket needed
    register(ops["n1"][1], "7", 1)
    assert ask(ops["n1"][0], 0, 0)["connect"] in ask(ops["n1"][0], 0, 0)["accept"]


def test_keys_change_with_the_run_and_the_map_gives_the_epoch(tmp_path: object) -> None:
    store = MemoryStore()
    job(store)
    ops, table = agent(store, "n1", str(tmp_path))
    register(table, "7", 0)
    first = ask(ops, 0, 2)
    assert first["epoch"] == 3 and first["node"] == "n3"
    job(store, restart=1)  # requeued: ranks of the earlier run cannot talk to this one's
    assert ask(ops, 0, 2)["connect"] != first["connect"]


def test_refusals_name_what_is_wrong(tmp_path: object) -> None:
    store = MemoryStore()
    job(store)
    ops, table = agent(store, "n1", str(tmp_path))
    with pytest.raises(Refused, match="not registered"):
        ask(ops, 0, 1)  # no rank of this uid here
    register(table, "7", 0)
    with pytest.raises(Refused, match="permission"):
        ask(ops, 0, 1, uid=OWNER + 1)
    with pytest.raises(Refused, match="rank 9 of job 7 is not in the rank map"):
        ask(ops, 0, 9)


def hello(address: tuple[str, int], key: bytes, src: int, src_epoch: int) -> bool:
    """A client handshake as rank ``src`` at ``src_epoch`` proving ``key``, then a HELLO
    frame; whether the listener closed the connection."""
    auth = Auth(key, src)
    with socket.create_connection(address, timeout=10) as s:
        nc = os.urandom(16)
        bound = (src, 1, src_epoch, 0)
        framing.send_parts(s, [_HELLO.pack(PROTOCOL, nc, *bound, 0)])
        reader = framing.FrameReader(s, max_size=HANDSHAKE_MAX)
        try:
            ns = bytes(reader.read(idle_timeout=10))[:16]
            framing.send_parts(s, [auth.proof(key, b"c", nc, ns, *bound)])
            mac = framing.FrameMac(auth.proof(key, b"k", nc, ns, *bound), "blake3", b"c")
            framing.send_parts(s, encode(HELLO, src, 1, 0, src_epoch), mac=mac)
            s.settimeout(10)
            return s.recv(1) == b""
        except (OSError, framing.FrameError):
            return True


def test_the_listener_takes_the_epoch_and_keys_of_the_rank_map() -> None:
    good, old, other = os.urandom(32), os.urandom(32), os.urandom(32)
    asked: list[int] = []
    got: list[Frame] = []

    def source(peer: int) -> RankKeys:
        asked.append(peer)
        return RankKeys(good, (good, old), 4)  # the map: rank 0 runs at epoch 4

    def on_frame(frame: Frame, cid: int) -> None:
        got.append(frame)
        lst.drop(cid)  # answered by closing: the client's recv returns

    lst = Listener("127.0.0.1", on_frame, lambda c: None, Auth(source, 1))
    try:
        assert hello(lst.address, good, 0, 99)  # a huge epoch: refused before any proof
        assert hello(lst.address, other, 0, 4)  # a key of another pair of nodes
        assert hello(lst.address, old, 0, 4)  # the rollover's other key: taken
        assert [(f.kind, f.src, f.epoch) for f in got] == [(HELLO, 0, 4)]
        assert lst.auth.refusals() == {"epoch": 1, "authentication": 1}
        assert set(asked) == {0}
    finally:
        lst.close()


def test_a_connection_without_a_ticket_is_not_attempted() -> None:
    auth = Auth(lambda peer: RankKeys(b"", (os.urandom(32),), 1), 0)
    with pytest.raises(FrameError, match="no key to reach rank 1"), socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        Outgoing(s.getsockname()[:2], 1, auth, 1)


def test_ranks_on_one_host_use_a_unix_socket_checked_by_uid() -> None:
    got: list[Frame] = []
    key = os.urandom(32)
    near = Listener("127.0.0.1", lambda f, c: got.append(f), lambda c: None,
                    Auth(key, 1, epoch=1), unix=True)
    far = Listener("127.0.0.1", lambda f, c: got.append(f), lambda c: None,
                   Auth(key, 2, epoch=1))  # no Unix socket: TCP as between hosts
    me = Listener("127.0.0.1", lambda f, c: None, lambda c: None, Auth(key, 0, epoch=1),
                  unix=True)
    try:
        a, b = me.connect(near.address, 1, 1), me.connect(far.address, 1, 2)
        assert a.local and a.sock.family == socket.AF_UNIX
        assert not b.local and b.sock.family == socket.AF_INET
        for o, dst in ((a, 1), (b, 2)):
            o.send(encode(DATA, 0, dst, 1, 1, b"x" * 100_000))
        end = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        assert sorted((f.dst, len(f.payload)) for f in got) == [(1, 100_000), (2, 100_000)]
        # another uid's process on this host: refused before any handshake
        probe = ("import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(chr(0) + sys.argv[1]); "
                 "s.settimeout(10); print(s.recv(1) == b'')")
        out = subprocess.run(["/usr/bin/python3", "-c", probe, unix_name(near.address)[1:]],
                             user=65534, capture_output=True, text=True, timeout=30,
                             check=False)
        assert out.stdout.strip() == "True", out.stderr
        assert near.auth.refusals() == {"uid": 1}
        a.close()
        b.close()
    finally:
        for lst in (near, far, me):
            lst.close()


def test_strangers_hellos_cost_the_agent_a_bounded_number_of_asks() -> None:
    key = os.urandom(32)
    asked: list[int] = []

    def source(peer: int) -> RankKeys:
        asked.append(peer)
        return RankKeys(key, (key,), 1)

    lst = Listener("127.0.0.1", lambda f, c: None, lambda c: None,
                   Auth(source, 1, ranks=3))
    try:
        start = time.monotonic()
        for _ in range(20):  # a wrong epoch each time: each asks for rank 0's keys afresh
            assert hello(lst.address, key, 0, 7)
        took = time.monotonic() - start
        assert hello(lst.address, key, 9, 1)  # no rank 9 in a job of 3: nothing asked
        # the first ask and what the bucket allows (a burst, then one per ASK_EVERY); the
        # rest answered from what was kept
        bound = 1 + ASK_BURST + took / ASK_EVERY
        assert set(asked) == {0} and 2 <= len(asked) <= bound, (asked, took)
        assert lst.auth.refusals() == {"epoch": 20, "handshake": 1}
    finally:
        lst.close()
