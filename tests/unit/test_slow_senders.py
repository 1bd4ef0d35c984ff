"""Slow senders against the transfer port and the user door.

Hundreds of connections that send nothing or one byte now and then: a legitimate peer
is still served at once, the slow ones are cut at their deadline however they trickle,
every one of them is counted, and the server's threads stay under its cap.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from pathlib import Path

import blake3
import pytest

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.transfer import TransferClient, TransferError, TransferServer
from raps_slurm.coordinator.userdoor import UserDoor, request_digest
from raps_slurm.core.jobs import JobRecord, JobSpec
from raps_slurm.munge import Credential, MungeError
from raps_slurm.store import Keys, MemoryStore

KEY = b"k" * 32
SLOW = 300
CAP = 32
# Long enough that a request served at once (under 1.1 s seen at load 10 on 2 cores) and
# one that waited for a slot freed at the deadline stay apart.
DEADLINE = 3.0
RAW = b"chunk"
DIGEST = blake3.blake3(RAW).hexdigest()
# A length prefix that asks for 4096 bytes, then spaces: never complete at one byte a tick.
TRICKLE = struct.pack(">I", 4096) + b" " * 4096


def serving_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


class Slow:
    """``n`` connections to ``address``: every other one trickles a byte each 0.3 s, the
    rest send nothing. Records when the server cut each one."""

    def __init__(self, address: tuple[str, int], n: int) -> None:
        self.socks: list[socket.socket] = []
        self.opened: dict[socket.socket, float] = {}
        self.cut: dict[socket.socket, float] = {}
        self.max_threads = 0
        self._stop = threading.Event()
        for _ in range(n):
            s = socket.create_connection(address, timeout=5)
            self.opened[s] = time.monotonic()
            self.socks.append(s)
        self._sent = dict.fromkeys(self.socks, 0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            self.max_threads = max(self.max_threads, serving_threads())
            live = [s for s in self.socks if s not in self.cut]
            if not live:
                return
            # poll(2), not select(2): descriptors past 1023 (after other tests) work
            ready = set(wait(live, 0.05))
            for s in live:
                if s in ready:  # readable: the server closed it (or reset it)
                    self.cut[s] = time.monotonic()
            if time.monotonic() - last >= 0.3:
                last = time.monotonic()
                for i, s in enumerate(live):
                    if i % 2 == 0 and s not in self.cut:
                        try:
                            s.send(TRICKLE[self._sent[s]:self._sent[s] + 1])
                            self._sent[s] += 1
                        except OSError:
                            self.cut[s] = time.monotonic()

    def wait_all_cut(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert len(self.cut) == len(self.socks), f"{len(self.cut)} of {len(self.socks)} cut"

    def lifetimes(self) -> list[float]:
        return sorted(self.cut[s] - self.opened[s] for s in self.socks)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            s.close()


def timed(fn: Callable[[], object]) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


@pytest.fixture
def transfer(tmp_path: Path) -> Iterator[TransferServer]:
    store = ChunkStore(tmp_path / "store")
    store.put_many("1", [(DIGEST, len(RAW), b"\x00" + RAW)])
    server = TransferServer(store, KEY, "srv", ("127.0.0.1", 0), max_connections=CAP,
                            handshake_timeout=DEADLINE, request_timeout=DEADLINE,
                            min_rate=1e9)
    server.start()
    yield server
    server.stop()


def fetch(address: tuple[str, int]) -> None:
    with TransferClient(KEY, "peer", address) as c:
        got = list(c.fetch("1", [DIGEST], {DIGEST: len(RAW)}))
    assert [(d, bytes(s)) for d, _, s in got] == [(DIGEST, b"\x00" + RAW)]


def under_slow_senders(name: str, address: tuple[str, int], legit: Callable[[], object],
                       counts: Callable[[], dict[str, int]]) -> dict[str, int]:
    """Open SLOW slow connections, time ``legit`` meanwhile, wait until every slow one is
    cut; check (a) to (d) of the module docstring and return the counts."""
    t0 = time.monotonic()
    slow = Slow(address, SLOW)
    try:
        opened = time.monotonic() - t0
        served = timed(legit)  # (a) served while they hang on
        slow.wait_all_cut(DEADLINE + 10)
        life = slow.lifetimes()
    finally:
        slow.close()
    got = counts()
    print(f"\n{name}: {SLOW} slow connections opened in {opened:.2f}s; legitimate request "
          f"{served * 1000:.0f} ms; cut after {life[0]:.2f}..{life[-1]:.2f}s; "
          f"refused {got}; serving threads at most {slow.max_threads} (cap {CAP})")
    assert served < DEADLINE / 2, f"served in {served:.2f}s: it waited for a slot"
    # (b) the last ones admitted were cut at the deadline, trickling or not
    assert DEADLINE - 0.2 <= life[-1] <= DEADLINE + 1.5
    # (c) every slow connection is counted: evicted for a newer one, or cut at its deadline
    assert got.get("evicted", 0) + got.get("timeout", 0) == SLOW, got
    assert got.get("timeout", 0) >= CAP - 1
    # (d) one thread per admitted connection, never more than the cap
    assert slow.max_threads <= CAP
    legit()
    return got


def test_transfer_port_under_300_slow_senders(transfer: TransferServer) -> None:
    under_slow_senders("transfer", transfer.address, lambda: fetch(transfer.address),
                       transfer.rejections)


def test_an_authenticated_slow_request_is_cut_at_its_deadline(
        transfer: TransferServer) -> None:
    clients = [TransferClient(KEY, f"p{i}", transfer.address) for i in range(4)]
    try:
        frame = struct.pack(">I", 1000)
        t0 = time.monotonic()
        for c in clients:
            c._chan.sock.sendall(frame[:2])
        ends = []
        for c in clients:
            sock = c._chan.sock
            sock.settimeout(DEADLINE + 3)
            while True:  # a byte every 0.2 s until the server hangs up
                r = wait([sock], 0.2)
                if r:
                    break
                with contextlib.suppress(OSError):
                    sock.send(b"x")
            ends.append(time.monotonic() - t0)
    finally:
        for c in clients:
            c.close()
    print(f"\nauthenticated slow requests cut after {min(ends):.2f}..{max(ends):.2f}s")
    assert all(DEADLINE - 0.2 <= e <= DEADLINE + 1.5 for e in ends), ends
    deadline = time.monotonic() + 5
    while transfer.rejections().get("timeout", 0) < 4:
        assert time.monotonic() < deadline, transfer.rejections()
        time.sleep(0.05)


def test_a_full_house_of_authenticated_peers_refuses_more(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "store")
    store.put_many("1", [(DIGEST, len(RAW), b"\x00" + RAW)])
    server = TransferServer(store, KEY, "srv", ("127.0.0.1", 0), max_connections=2)
    server.start()
    try:
        held = [TransferClient(KEY, f"p{i}", server.address) for i in range(2)]
        for c in held:  # a request answered: the server has settled the connection
            assert [bytes(s) for _, _, s in c.fetch("1", [DIGEST], {DIGEST: len(RAW)})] \
                == [b"\x00" + RAW]
        with pytest.raises(TransferError):
            TransferClient(KEY, "late", server.address, handshake_timeout=2.0)
        assert server.rejections().get("busy") == 1
        for c in held:
            c.close()
        deadline = time.monotonic() + 5
        while server.gate.in_use():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        fetch(server.address)
    finally:
        server.stop()


ALICE = 1000


@pytest.fixture
def door() -> Iterator[tuple[UserDoor, dict[str, Credential]]]:
    store, keys = MemoryStore(), Keys()
    store.put(keys.job("7"), JobRecord("7", 0, ALICE, ("n1",), JobSpec()).to_json())
    creds: dict[str, Credential] = {}

    def decode(cred: str) -> Credential:
        if cred not in creds:
            raise MungeError("munge decode: Invalid credential", 8)
        return creds.pop(cred)

    d = UserDoor(store, keys, ("127.0.0.1", 0), decode, timeout=DEADLINE,
                 max_connections=CAP)
    d.start()
    yield d, creds
    d.stop()
    store.close()


def ask(d: UserDoor, creds: dict[str, Credential]) -> None:
    cred = f"MUNGE:{len(creds)}"
    creds[cred] = Credential(request_digest("job", "7"), ALICE, ALICE)
    raw = json.dumps({"op": "job", "job": "7", "cred": cred}).encode()
    with socket.create_connection(d.address, timeout=5) as conn:
        conn.sendall(struct.pack(">I", len(raw)) + raw)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    reply = json.loads(data[4:])
    assert reply["ok"] is True, reply


def test_user_door_under_300_slow_senders(door: tuple[UserDoor, dict[str, Credential]]
                                          ) -> None:
    d, creds = door
    got = under_slow_senders("user door", d.address, lambda: ask(d, creds),
                             lambda: dict(d.counts))
    assert got["served"] == 1
