"""The agent's local API and the rank-side client, on real unix sockets in one process.

SO_PEERCRED reports our own uid (root here); the non-root paths act as another uid
through ``peer_uid_override`` and read process owners from a fake ``/proc``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raps_slurm.agent.local_api import (
    MAX_REQUEST,
    LocalApiError,
    LocalApiServer,
    Peer,
    RankInfo,
    RankTable,
    Refused,
    authorize,
    decode_request,
    parse_request,
    process_uid,
)
from raps_slurm.errors import RapsError
from raps_slurm.runtime.agent_client import (
    EXIT_FENCED,
    AgentClient,
    AgentError,
    encode_frame,
    read_reply,
)

ME = os.getpid()
OTHER_PID = 4242          # a process of uid 1001 in the fake /proc
GONE_PID = 4243           # no such process in the fake /proc
OWNERS = {"12": 1001, "13": 1000}

# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture
def short_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, or a short /tmp dir when tmp_path would overflow sun_path (108 bytes)."""
    if len(str(tmp_path)) < 70:
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="raps-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    for pid, uid in ((ME, 1000), (OTHER_PID, 1001)):
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "status").write_text(
            f"Name:\tpython3\nPid:\t{pid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    return root


@pytest.fixture
def validity() -> list[float]:
    return [30.0]  # what valid_for() answers; tests change it


Factory = Callable[..., LocalApiServer]


@pytest.fixture
def make_server(short_dir: Path, proc_root: Path,
                validity: list[float]) -> Iterator[Factory]:
    started: list[LocalApiServer] = []

    def make(**kwargs: Any) -> LocalApiServer:
        args: dict[str, Any] = {"owner_of": OWNERS.get, "valid_for": lambda: validity[0],
                                "proc_root": proc_root}
        args.update(kwargs)
        s = LocalApiServer(short_dir / "run" / "agent.sock", "n1", **args)
        s.start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def server(make_server: Factory) -> LocalApiServer:
    return make_server()


OPENED: list[Conn | AgentClient] = []  # closed after each test


@pytest.fixture(autouse=True)
def _close_opened() -> Iterator[None]:
    yield
    while OPENED:
        OPENED.pop().close()


class Conn:
    """A raw client connection."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        OPENED.append(self)
        self.sock.settimeout(5.0)
        self.sock.connect(str(path))

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        self.sock.sendall(encode_frame(message))
        return read_reply(self.sock)

    def reply(self) -> dict[str, Any]:
        return read_reply(self.sock)

    def is_closed(self) -> bool:
        """True once the server closed its side (reads to EOF)."""
        while True:
            try:
                if not self.sock.recv(65536):
                    return True
            except ConnectionResetError:
                return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def conn(server: LocalApiServer) -> Iterator[Conn]:
    c = Conn(server.path)
    yield c
    c.close()


def reg(job: str = "12", rank: int = 0, epoch: int = 1, pid: int = ME) -> dict[str, Any]:
    return {"op": "register", "job": job, "rank": rank, "epoch": epoch, "pid": pid}


def hb(job: str = "12", rank: int = 0, step: int = 5, items: int = 50,
       blocked_on: int | None = None) -> dict[str, Any]:
    return {"op": "heartbeat", "job": job, "rank": rank, "step": step, "items": items,
            "blocked_on": blocked_on}


def wait_for(probe: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# --- socket setup -------------------------------------------------------------------------


def test_socket_is_world_connectable_in_a_0755_dir_and_removed_on_stop(
        server: LocalApiServer) -> None:
    assert stat.S_IMODE(os.stat(server.path.parent).st_mode) == 0o755
    st_ = os.stat(server.path)
    assert stat.S_ISSOCK(st_.st_mode) and stat.S_IMODE(st_.st_mode) == 0o666
    server.stop()
    assert not server.path.exists()
    server.stop()  # idempotent


def test_stale_socket_is_replaced_but_a_live_one_or_a_file_is_not(
        make_server: Factory, short_dir: Path) -> None:
    path = short_dir / "run" / "agent.sock"
    path.parent.mkdir()
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # a socket file nobody listens on: what a killed agent leaves
    server = make_server()
    assert Conn(path).ask({"op": "hello"})["ok"] is True
    with pytest.raises(LocalApiError, match="another process is serving"):
        make_server()
    server.stop()
    path.write_text("not a socket")
    with pytest.raises(LocalApiError, match="not a socket"):
        make_server()
    assert path.read_text() == "not a socket"
    too_long = LocalApiServer(short_dir / ("x" * 120) / "a.sock", "n1", owner_of=OWNERS.get,
                              valid_for=lambda: 1.0)
    with pytest.raises(LocalApiError, match="cannot serve the local API"):
        too_long.start()  # sun_path holds 108 bytes


def test_stop_closes_open_connections(server: LocalApiServer, conn: Conn) -> None:
    assert conn.ask({"op": "hello"})["ok"]
    server.stop()
    assert conn.is_closed()


# --- ops ----------------------------------------------------------------------------------


def test_hello_reports_node_and_the_kernel_uid(server: LocalApiServer, conn: Conn) -> None:
    assert conn.ask({"op": "hello"}) == {"ok": True, "node": "n1", "uid": os.getuid()}
    server.peer_uid_override = 1000
    assert Conn(server.path).ask({"op": "hello"})["uid"] == 1000


def test_register_heartbeat_unregister(server: LocalApiServer, conn: Conn,
                                       validity: list[float]) -> None:
    t0 = time.monotonic()
    assert conn.ask(reg(rank=3, epoch=2)) == {"ok": True, "valid_for": 30.0}
    [info] = server.ranks.snapshot()
    assert (info.job, info.rank, info.epoch, info.pid, info.uid) == ("12", 3, 2, ME, 0)
    assert (info.step, info.items, info.blocked_on) == (0, 0, None)
    assert server.ranks.pids() == {("12", 3): ME}
    t1 = time.monotonic()
    assert server.ranks.fresh_since(t1) == []
    validity[0] = 12.5
    for step in range(1, 51):  # one connection carries many requests
        assert conn.ask(hb(rank=3, step=step, items=step * 10, blocked_on=1)) == \
            {"ok": True, "valid_for": 12.5, "epoch": 2}
    [info] = server.ranks.fresh_since(t1)
    assert (info.step, info.items, info.blocked_on) == (50, 500, 1)
    assert t0 <= info.registered_at < t1 <= info.last_heartbeat_at
    assert conn.ask(hb(rank=3, blocked_on=None))["ok"]
    assert server.ranks.snapshot()[0].blocked_on is None
    assert conn.ask({"op": "unregister", "job": "12", "rank": 3}) == {"ok": True}
    assert server.ranks.snapshot() == []
    reply = conn.ask(hb(rank=3))
    assert reply == {"ok": False, "kind": "not_registered",
                     "error": "rank 3 of job 12 is not registered"}
    assert conn.ask({"op": "unregister", "job": "12", "rank": 3})["kind"] == "not_registered"
    assert server.errors == {"not_registered": 2} and server.denied == 0


def test_higher_epoch_replaces_lower_is_refused_same_is_accepted(
        server: LocalApiServer, conn: Conn) -> None:
    assert conn.ask(reg(epoch=2))["ok"]
    assert conn.ask(reg(epoch=3))["ok"]
    assert conn.ask(reg(epoch=1)) == {"ok": False, "kind": "epoch",
                                      "error": "epoch 1 is older than the registered 3"}
    assert conn.ask(reg(epoch=3))["ok"]  # a re-register after a reconnect
    assert [r.epoch for r in server.ranks.snapshot()] == [3]
    assert conn.ask(hb())["epoch"] == 3


def test_root_may_register_any_pid_and_job_but_not_a_dead_pid(conn: Conn) -> None:
    assert conn.ask(reg(job="12", pid=OTHER_PID))["ok"]
    assert conn.ask(reg(job="99"))["ok"]  # not registered with raps, but root may
    assert conn.ask(reg(pid=GONE_PID)) == {"ok": False, "kind": "no_process",
                                           "error": f"no process with pid {GONE_PID}"}


# --- authorization ------------------------------------------------------------------------


@pytest.mark.parametrize(("uid", "owner", "allowed"), [
    (0, None, True), (0, 1000, True), (1000, 1000, True),
    (1000, 1001, False), (1000, None, False), (1000, 0, False),
])
def test_authorize(uid: int, owner: int | None, allowed: bool) -> None:
    assert authorize(uid, owner) is allowed


def test_another_users_job_is_denied_counted_and_logged(
        server: LocalApiServer, caplog: pytest.LogCaptureFixture) -> None:
    server.peer_uid_override = 1000
    c = Conn(server.path)
    with caplog.at_level(logging.WARNING, logger="raps.agent"):
        reply = c.ask(reg(job="12"))
    assert reply == {"ok": False, "kind": "permission",
                     "error": "permission denied: job 12 belongs to uid 1001, you are uid 1000"}
    assert server.denied == 1 and server.errors["permission"] == 1
    assert any("uid 1001" in r.getMessage() and "uid 1000" in r.getMessage()
               for r in caplog.records if r.name == "raps.agent")
    assert c.ask(reg(job="77"))["kind"] == "unknown_job"
    assert server.denied == 1 and server.ranks.snapshot() == []
    # Its own job: the pid a user claims is ignored (inside a container it would name
    # another process here); the rank is the connecting process, as SO_PEERCRED says.
    assert c.ask(reg(job="13", pid=OTHER_PID)) == {"ok": True, "valid_for": 30.0}
    (info,) = server.ranks.snapshot()
    assert (info.pid, info.uid) == (ME, 1000)


def test_only_the_registering_uid_or_root_may_heartbeat_or_unregister(
        server: LocalApiServer) -> None:
    server.peer_uid_override = 1000
    user = Conn(server.path)
    assert user.ask(reg(job="13", rank=1))["ok"]
    server.peer_uid_override = 1001
    intruder = Conn(server.path)
    expected = "permission denied: rank 1 of job 13 belongs to uid 1000, you are uid 1001"
    assert intruder.ask(hb(job="13", rank=1))["error"] == expected
    assert intruder.ask({"op": "unregister", "job": "13", "rank": 1})["error"] == expected
    assert server.denied == 2 and len(server.ranks.snapshot()) == 1
    assert user.ask(hb(job="13", rank=1, step=9))["ok"]
    server.peer_uid_override = None
    root = Conn(server.path)
    assert root.ask(hb(job="13", rank=1, step=10))["ok"]
    assert root.ask({"op": "unregister", "job": "13", "rank": 1})["ok"]


def test_process_uid_reads_the_real_uid(tmp_path: Path, proc_root: Path) -> None:
    assert process_uid(ME, proc_root) == 1000
    assert process_uid(OTHER_PID, proc_root) == 1001
    assert process_uid(GONE_PID, proc_root) is None
    assert process_uid(os.getpid()) == os.getuid()  # the real /proc
    (proc_root / "5").mkdir()
    (proc_root / "5" / "status").write_bytes(b"Name:\t\xff\nUid:\tx 1 1 1\n")
    assert process_uid(5, proc_root) is None
    (proc_root / "6").mkdir()
    (proc_root / "6" / "status").write_text("Name:\tno uid line\n")
    assert process_uid(6, proc_root) is None


def test_failing_callables_give_an_internal_error_and_the_connection_stays(
        make_server: Factory, caplog: pytest.LogCaptureFixture) -> None:
    def boom(job: str) -> int | None:
        raise RapsError("etcd is down")

    server = make_server(owner_of=boom, valid_for=lambda: float("nan"))
    c = Conn(server.path)
    assert c.ask(reg())["valid_for"] == 0.0  # never "forever" because of a bad answer
    server.peer_uid_override = 1000
    c = Conn(server.path)
    with caplog.at_level(logging.ERROR, logger="raps.agent"):
        assert c.ask(reg(job="13")) == {"ok": False, "kind": "internal",
                                        "error": "internal error in the agent (see its log)"}
    assert "etcd is down" in caplog.text
    assert c.ask({"op": "hello"})["ok"]


def test_connections_per_uid_are_limited(make_server: Factory) -> None:
    server = make_server(max_connections_per_uid=2)
    server.peer_uid_override = 1000
    a, b = Conn(server.path), Conn(server.path)
    assert a.ask({"op": "hello"})["ok"] and b.ask({"op": "hello"})["ok"]
    c = Conn(server.path)
    assert c.reply() == {"ok": False, "kind": "connections",
                         "error": "too many connections from uid 1000"}
    assert c.is_closed()
    server.peer_uid_override = 1001  # other users are not locked out
    assert Conn(server.path).ask({"op": "hello"})["uid"] == 1001
    a.close()
    server.peer_uid_override = 1000
    wait_for(lambda: sum(1 for u in server._conns.values() if u == 1000) < 2)
    assert Conn(server.path).ask({"op": "hello"})["ok"]


def test_all_users_together_stay_below_the_agent_s_reserve(make_server: Factory) -> None:
    from raps_slurm.agent.fds import FdCaps

    server = make_server()
    assert server.fd_caps.users * 3 < server.fd_caps.limit  # start() sized it
    server.fd_caps = FdCaps(server.fd_caps.limit, 10, 2)
    held = []
    for uid in (1000, 1001):
        server.peer_uid_override = uid
        held.append(Conn(server.path))
        assert held[-1].ask({"op": "hello"})["uid"] == uid
    server.peer_uid_override = 1002
    assert Conn(server.path).reply()["kind"] == "connections"
    server.peer_uid_override = 0  # root (the agent's own tools) is never refused
    assert Conn(server.path).ask({"op": "hello"})["ok"]


# --- schemas ------------------------------------------------------------------------------

ALLOWED = {"register": "op, job, rank, epoch, pid", "heartbeat":
           "op, job, rank, step, items, blocked_on", "unregister": "op, job, rank"}
GOOD = {"register": reg(), "heartbeat": hb(), "unregister": {"op": "unregister", "job": "12",
                                                               "rank": 0}}
BAD_VALUES: dict[str, list[Any]] = {
    "job": [12, "", "12a", "-1", "1" * 21, "١٢", None, ["12"], True],
    "rank": [True, False, -1, 1.0, "1", None, 2**31, {}],
    "epoch": [0, -1, True, 1.5, "1", None, 2**63],
    "pid": [0, -1, True, 4194305, "1", None, 1.0],
    "step": [-1, True, 1.0, None, "3", 2**63],
    "items": [-1, False, 1e3, None, [1]],
    "blocked_on": [-1, True, 1.5, "2", 2**31],
}
SCHEMA_CASES = [(op, field, value) for op, good in GOOD.items() for field in good
                if field != "op" for value in BAD_VALUES[field]]


@pytest.mark.parametrize(("op", "field", "value"), SCHEMA_CASES)
def test_wrong_field_value_names_the_field_and_keeps_the_connection(
        server: LocalApiServer, conn: Conn, op: str, field: str, value: Any) -> None:
    reply = conn.ask({**GOOD[op], field: value})
    assert reply["ok"] is False and reply["kind"] == "schema"
    assert reply["error"].startswith(f"field '{field}': expected ")
    assert " got " in reply["error"]
    assert conn.ask({"op": "hello"})["ok"]  # a schema error does not close the connection
    assert server.ranks.snapshot() == []


@pytest.mark.parametrize(("request_", "error"), [
    ({}, "missing field 'op' (allowed ops: hello, register, heartbeat, unregister)"),
    ({"op": 1}, "field 'op': expected a string, got 1"),
    ({"op": None}, "field 'op': expected a string, got null"),
    ({"op": "x"}, "unknown op 'x' (allowed: hello, register, heartbeat, unregister)"),
    ({"op": "REGISTER"}, "unknown op 'REGISTER' (allowed: hello, register, heartbeat, unregister)"),
    ({"op": "hello", "x": 1}, "unknown field 'x' for op 'hello' (allowed: op)"),
    ({**reg(), "uid": 0}, f"unknown field 'uid' for op 'register' (allowed: {ALLOWED['register']})"),
    ({**hb(), "epoch": 1}, f"unknown field 'epoch' for op 'heartbeat' (allowed: {ALLOWED['heartbeat']})"),
    ({"op": "register", "job": "12", "rank": 0, "epoch": 1},
     f"missing field 'pid' for op 'register' (allowed: {ALLOWED['register']})"),
    ({"op": "heartbeat", "job": "12", "rank": 0, "step": 1, "items": 1},
     f"missing field 'blocked_on' for op 'heartbeat' (allowed: {ALLOWED['heartbeat']})"),
    ({"op": "unregister", "job": "12"},
     f"missing field 'rank' for op 'unregister' (allowed: {ALLOWED['unregister']})"),
])
def test_schema_errors(conn: Conn, request_: dict[str, Any], error: str) -> None:
    reply = conn.ask(request_)
    assert reply["ok"] is False and reply["error"] == error
    assert conn.ask({"op": "hello"})["ok"]


def test_error_messages_quote_client_text_short_and_printable() -> None:
    with pytest.raises(Refused) as info:
        parse_request({"op": "\ud800" + "y" * 1000})
    assert len(str(info.value)) < 150 and "\\ud800" in str(info.value)
    with pytest.raises(Refused) as info:
        parse_request({**reg(), "rank": [[1, 2]]})
    assert str(info.value) == "field 'rank': expected an integer >= 0 and < 2**31, got a list"


# --- framing ------------------------------------------------------------------------------

HEADER = struct.Struct(">I")


def framed(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


FRAMING_CASES = [
    ("oversized", HEADER.pack(MAX_REQUEST + 1) + b"{}", "size",
     f"request length {MAX_REQUEST + 1} outside 1..{MAX_REQUEST}"),
    ("huge", b"\xff\xff\xff\xff", "size", f"request length 4294967295 outside 1..{MAX_REQUEST}"),
    ("empty", HEADER.pack(0), "size", f"request length 0 outside 1..{MAX_REQUEST}"),
    ("truncated", HEADER.pack(100) + b'{"op":', "truncated",
     "connection closed in the middle of a request"),
    ("short header", b"\x00\x00", "truncated", "connection closed in the middle of a request"),
    ("garbage", framed(b"GET / HTTP/1.1\r\n"), "json", "request is not valid JSON"),
    ("array", framed(b'["hello"]'), "not_object", "request must be a JSON object, got list"),
    ("string", framed(b'"hello"'), "not_object", "request must be a JSON object, got str"),
    ("bad utf-8", framed(b'{"op":"\xff"}'), "encoding", "request is not valid UTF-8 (byte 7)"),
    ("duplicate key", framed(b'{"op":"hello","op":"register"}'), "json", "duplicate key 'op'"),
    ("NaN", framed(b'{"op":"heartbeat","step":NaN}'), "json", "NaN is not allowed"),
    ("deep", framed(b"[" * 60000), "json", "request is not valid JSON"),
    ("huge int", framed(b'{"op":' + b"9" * 5000 + b"}"), "json", "request is not valid JSON"),
]


@pytest.mark.parametrize(("data", "kind", "error"),
                         [c[1:] for c in FRAMING_CASES], ids=[c[0] for c in FRAMING_CASES])
def test_framing_errors_get_one_error_and_close(server: LocalApiServer, data: bytes, kind: str,
                                                error: str) -> None:
    c = Conn(server.path)
    c.sock.sendall(data)
    c.sock.shutdown(socket.SHUT_WR)  # so a truncated request ends
    reply = c.reply()
    assert reply["ok"] is False and reply["kind"] == kind
    assert error in reply["error"]
    assert c.is_closed()
    assert server.errors == {kind: 1}
    assert Conn(server.path).ask({"op": "hello"})["ok"]  # still serving


def test_a_good_request_before_garbage_is_answered(server: LocalApiServer) -> None:
    c = Conn(server.path)
    c.sock.sendall(encode_frame({"op": "hello"}) + framed(b"nope"))
    assert c.reply()["ok"] is True
    assert c.reply()["kind"] == "json"
    assert c.is_closed()


def test_idle_and_slow_clients_are_dropped(make_server: Factory) -> None:
    server = make_server(idle_timeout=0.3)
    idle = Conn(server.path)
    assert idle.ask({"op": "hello"})["ok"]
    t0 = time.monotonic()
    assert idle.is_closed()  # no reply: an idle connection is simply closed
    assert 0.25 < time.monotonic() - t0 < 3.0
    slow = Conn(server.path)
    slow.sock.sendall(b"\x00\x00")  # half a header, then nothing
    assert slow.reply() == {"ok": False, "kind": "slow", "error": "request not complete in time"}
    assert slow.is_closed()
    assert server.errors == {"idle": 1, "slow": 1}


def test_decode_request_directly() -> None:
    assert decode_request(b'{"op":"hello"}') == {"op": "hello"}
    with pytest.raises(Refused, match="Infinity is not allowed"):
        decode_request(b'{"x":-Infinity}')


# --- fuzz ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)
requests = st.fixed_dictionaries(
    {"op": st.sampled_from([*GOOD, "hello", "x"]) | st.text(max_size=10)},
    optional={k: json_values | st.integers(-2, 2**64) | st.text("0123456789", max_size=22)
              for k in ("job", "rank", "epoch", "pid", "step", "items", "blocked_on", "uid")})


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request_=requests, uid=st.sampled_from([0, 1000, 1001]))
def test_fuzz_handle_request_never_raises(server: LocalApiServer, request_: dict[str, Any],
                                          uid: int) -> None:
    reply = server.handle_request(request_, Peer(ME, uid, uid))
    assert isinstance(reply["ok"], bool)
    assert reply["ok"] or reply["kind"] != "internal"
    json.dumps(reply, allow_nan=False)


wire = st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=300).map(framed),
    requests.map(lambda r: framed(json.dumps(r).encode())),
    st.lists(requests.map(lambda r: framed(json.dumps(r).encode())), max_size=3)
    .map(b"".join).flatmap(lambda good: st.binary(max_size=50).map(lambda junk: good + junk)),
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=wire)
def test_fuzz_random_bytes_never_kill_the_server(server: LocalApiServer, data: bytes) -> None:
    c = Conn(server.path)
    try:
        c.sock.sendall(data)
        c.sock.shutdown(socket.SHUT_WR)
        assert c.is_closed()
    finally:
        c.close()
    assert server.errors["internal"] == 0
    assert Conn(server.path).ask({"op": "hello"})["ok"]


# --- RankTable ----------------------------------------------------------------------------


def test_rank_table_is_consistent_under_threads() -> None:
    table = RankTable()

    def worker(rank: int) -> None:
        for epoch in range(1, 51):
            table.register(RankInfo("12", rank, epoch, 100 + rank, 0, 0.0, 0.0))
            table.heartbeat("12", rank, 0, epoch, epoch, None, float(epoch))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [(r.rank, r.epoch, r.step) for r in table.snapshot()] == [(r, 50, 50) for r in range(8)]
    assert [r.rank for r in table.fresh_since(49.0)] == list(range(8))
    assert table.fresh_since(50.0) == []
    assert table.remove("12", 3) is not None and table.remove("12", 3) is None
    assert ("12", 3) not in table.pids() and len(table.pids()) == 7


# --- the client ---------------------------------------------------------------------------


class Fenced:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.event.set()


def client_for(server: LocalApiServer, fenced: Fenced, *, rank: int = 0, epoch: int = 1,
               interval: float = 0.05, job: str = "12") -> AgentClient:
    client = AgentClient(server.path, job, rank, epoch, interval=interval, on_fenced=fenced)
    OPENED.append(client)
    return client


def test_client_registers_heartbeats_and_unregisters(server: LocalApiServer,
                                                     validity: list[float]) -> None:
    fenced = Fenced()
    client = client_for(server, fenced, rank=2)
    validity[0] = 1.0
    t0 = time.monotonic()
    assert client.register() == 1.0
    assert t0 + 0.9 < client.valid_until <= time.monotonic() + 1.0
    assert server.ranks.pids() == {("12", 2): ME}
    client.progress(7, 70)
    client.blocked(1)
    client.start()
    wait_for(lambda: server.ranks.snapshot()[0].step == 7)
    info = server.ranks.snapshot()[0]
    assert (info.items, info.blocked_on) == (70, 1)
    time.sleep(1.5)  # longer than valid_for: heartbeats keep it valid
    assert not fenced.reasons and client.valid_until > time.monotonic()
    client.close()
    assert server.ranks.snapshot() == []
    assert not fenced.reasons


def test_a_valid_for_shorter_than_the_interval_is_renewed_in_time(
        server: LocalApiServer, validity: list[float]) -> None:
    fenced = Fenced()
    validity[0] = 0.4
    client = client_for(server, fenced, interval=10.0)
    client.register()
    client.start()
    time.sleep(1.2)
    assert not fenced.reasons
    assert server.ranks.fresh_since(time.monotonic() - 0.4)


def test_client_register_errors_raise_agent_error(server: LocalApiServer, short_dir: Path,
                                                  validity: list[float]) -> None:
    fenced = Fenced()
    assert client_for(server, fenced, epoch=3).register() == 30.0
    with pytest.raises(AgentError, match="epoch 2 is older than the registered 3") as info:
        client_for(server, fenced, epoch=2).register()
    assert info.value.kind == "epoch" and isinstance(info.value, RapsError)
    with pytest.raises(AgentError, match="cannot reach the agent"):
        AgentClient(short_dir / "nothing.sock", "12", 0, 1, interval=0.1).register()
    validity[0] = 0.0
    t0 = time.monotonic()
    with pytest.raises(AgentError, match=r"fenced \(valid_for <= 0\), still after 0.3 s"):
        client_for(server, fenced, rank=1).register(wait=0.3)
    assert time.monotonic() - t0 >= 0.3  # it asked again meanwhile
    with pytest.raises(AgentError, match="register"):
        client_for(server, fenced, rank=1).start()


def test_register_waits_for_a_fenced_node_to_be_valid_again(
        server: LocalApiServer, validity: list[float]) -> None:
    # A node whose heartbeats were late for a moment (a loaded host) says it is fenced
    # until the next acknowledged one; a rank starting meanwhile has sent nothing.
    validity[0] = 0.0
    timer = threading.Timer(0.5, validity.__setitem__, (0, 2.0))
    timer.start()
    t0 = time.monotonic()
    try:
        assert client_for(server, Fenced(), rank=4).register(wait=5.0) == 2.0
    finally:
        timer.cancel()
    assert 0.4 < time.monotonic() - t0 < 4.0
    assert ("12", 4) in server.ranks.pids()


def test_watchdog_fences_when_the_agent_is_gone(server: LocalApiServer,
                                                validity: list[float]) -> None:
    fenced = Fenced()
    validity[0] = 0.5
    client = client_for(server, fenced)
    client.register()
    client.start()
    time.sleep(0.3)
    server.stop()
    stopped = time.monotonic()
    assert fenced.event.wait(3.0)
    assert time.monotonic() - stopped < 0.5 + 0.3  # at the latest when validity ran out
    [reason] = fenced.reasons
    assert "no valid reply from the local agent" in reason and "transport" in reason
    time.sleep(0.2)
    assert len(fenced.reasons) == 1  # once
    client.close()


def test_watchdog_fences_when_the_agent_is_frozen(short_dir: Path,
                                                  validity: list[float]) -> None:
    # A listener that never accepts: connect and send succeed, no reply ever comes.
    path = short_dir / "frozen.sock"
    frozen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    frozen.bind(str(path))
    frozen.listen(8)
    fenced = Fenced()
    client = AgentClient(path, "12", 0, 1, interval=0.1, on_fenced=fenced)
    OPENED.append(client)
    client.valid_until = time.monotonic() + 0.4  # as if a reply had come
    client._registered = True
    client.start()
    assert fenced.event.wait(2.0)
    assert "transport" in fenced.reasons[0]
    frozen.close()


def test_watchdog_fences_when_the_agent_says_so_or_the_rank_was_replaced(
        server: LocalApiServer, validity: list[float]) -> None:
    fenced = Fenced()
    client = client_for(server, fenced)
    client.register()
    client.start()
    validity[0] = 0.0
    assert fenced.event.wait(2.0)
    assert fenced.reasons == ["the agent says this node is fenced (valid_for <= 0)"]

    validity[0] = 30.0
    replaced = Fenced()
    old = client_for(server, replaced, rank=5, epoch=1)
    old.register()
    old.start()
    assert client_for(server, Fenced(), rank=5, epoch=2).register() == 30.0
    assert replaced.event.wait(2.0)
    assert replaced.reasons == ["replaced by epoch 2 (this is epoch 1)"]


def test_client_reconnects_and_reregisters_after_an_agent_restart(
        make_server: Factory, validity: list[float]) -> None:
    server = make_server()
    fenced = Fenced()
    validity[0] = 2.0
    client = client_for(server, fenced, rank=4)
    client.register()
    client.progress(3, 30)
    client.start()
    server.stop()
    time.sleep(0.3)  # a few failed heartbeats: validity must not move
    before = client.valid_until
    time.sleep(0.2)
    assert client.valid_until == before
    restarted = make_server()
    wait_for(lambda: restarted.ranks.get("12", 4) is not None)
    wait_for(lambda: client.valid_until > before)
    assert not fenced.reasons
    wait_for(lambda: restarted.ranks.snapshot()[0].step == 3)
    client.close()
    assert restarted.ranks.snapshot() == []


def test_client_rereg_refused_by_a_newer_epoch_fences_at_once(
        make_server: Factory, validity: list[float]) -> None:
    server = make_server()
    fenced = Fenced()
    validity[0] = 30.0
    client = client_for(server, fenced, rank=6)
    client.register()
    client.start()
    server.stop()
    restarted = make_server()
    assert client_for(restarted, Fenced(), rank=6, epoch=2).register() == 30.0
    assert fenced.event.wait(3.0)  # long before the 30 s validity
    assert fenced.reasons == ["the agent refused: epoch 1 is older than the registered 2"]


@pytest.mark.parametrize(("env", "expected"), [
    ({"RAPS_AGENT_SOCKET": "/s", "RAPS_JOB": "12", "RAPS_RANK": "3"}, ("/s", "12", 3, 1, 10.0)),
    ({"RAPS_AGENT_SOCKET": "/s", "SLURM_JOB_ID": "14", "RAPS_RANK": "0", "RAPS_EPOCH": "4",
      "RAPS_APP_HEARTBEAT_SEC": "2.5"}, ("/s", "14", 0, 4, 2.5)),
    ({"RAPS_AGENT_SOCKET": "/s", "RAPS_JOB": "12", "SLURM_JOB_ID": "14", "RAPS_RANK": "1"},
     ("/s", "12", 1, 1, 10.0)),
])
def test_from_env(env: dict[str, str], expected: tuple[Any, ...]) -> None:
    c = AgentClient.from_env(env)
    assert (c.socket_path, c.job, c.rank, c.epoch, c.interval) == expected


BASE_ENV = {"RAPS_AGENT_SOCKET": "/s", "RAPS_JOB": "12", "RAPS_RANK": "3"}


@pytest.mark.parametrize(("change", "message"), [
    ({"RAPS_AGENT_SOCKET": ""}, "RAPS_AGENT_SOCKET is not set"),
    ({"RAPS_JOB": ""}, "neither RAPS_JOB nor SLURM_JOB_ID is set"),
    ({"RAPS_JOB": "12.0"}, "RAPS_JOB='12.0': expected a decimal job id"),
    ({"RAPS_JOB": "", "SLURM_JOB_ID": "x"}, "SLURM_JOB_ID='x': expected a decimal job id"),
    ({"RAPS_RANK": ""}, "RAPS_RANK is not set"),
    ({"RAPS_RANK": "-1"}, "RAPS_RANK='-1': expected an integer >= 0"),
    ({"RAPS_EPOCH": "0"}, "RAPS_EPOCH='0': expected an integer >= 1"),
    ({"RAPS_EPOCH": "one"}, "RAPS_EPOCH='one': expected an integer >= 1"),
    ({"RAPS_APP_HEARTBEAT_SEC": "0"}, "RAPS_APP_HEARTBEAT_SEC='0': expected a number"),
    ({"RAPS_APP_HEARTBEAT_SEC": "inf"}, "RAPS_APP_HEARTBEAT_SEC='inf': expected a number"),
    ({"RAPS_APP_HEARTBEAT_SEC": "fast"}, "RAPS_APP_HEARTBEAT_SEC='fast': expected a number"),
])
def test_from_env_errors_name_the_variable(change: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace(".", r"\.")):
        AgentClient.from_env({**BASE_ENV, **change})


@pytest.mark.parametrize("kwargs", [
    {"job": "1x"}, {"rank": -1}, {"rank": True}, {"epoch": 0}, {"interval": 0.0},
    {"interval": float("nan")},
])
def test_client_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"job": "12", "rank": 0, "epoch": 1, "interval": 1.0, **kwargs}
    with pytest.raises(ValueError):
        AgentClient("/s", args["job"], args["rank"], args["epoch"], interval=args["interval"])


def test_cli_fake_rank_exits_75_when_the_agent_goes_away(make_server: Factory,
                                                         validity: list[float]) -> None:
    server = make_server(proc_root="/proc")  # the real one: the child registers its own pid
    validity[0] = 1.0
    with subprocess.Popen(
            [sys.executable, "-m", "raps_slurm.runtime.agent_client", "--socket",
             str(server.path), "--job", "12", "--rank", "3", "--interval", "0.2",
             "--blocked-on", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        _check_fake_rank(server, proc)


def _check_fake_rank(server: LocalApiServer, proc: subprocess.Popen[str]) -> None:
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"raps: rank 3 of job 12 registered (pid {proc.pid}, epoch 1")
        wait_for(lambda: server.ranks.snapshot()[0].last_heartbeat_at
                 > server.ranks.snapshot()[0].registered_at)
        info = server.ranks.snapshot()[0]
        assert (info.pid, info.blocked_on) == (proc.pid, 2)
        time.sleep(1.5)
        assert proc.poll() is None  # alive while the agent answers
        server.stop()
        assert proc.wait(timeout=5) == EXIT_FENCED
        assert proc.stderr is not None
        assert proc.stderr.read().startswith("raps: rank 3 of job 12 stops: no valid reply")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_process_start_names_one_process(tmp_path: Path) -> None:
    from raps_slurm.agent.local_api import process_start
    me = process_start(os.getpid())
    assert me is not None and me == process_start(os.getpid())
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text("7 (a (strange) name) S " + " ".join(["1"] * 18)
                                         + " 123456 9 9\n")
    assert process_start(7, tmp_path) == 123456
    assert process_start(8, tmp_path) is None


def test_from_env_puts_the_node_name_into_the_socket_template() -> None:
    env = {"RAPS_AGENT_SOCKET": "/run/raps/%n/agent.sock", "RAPS_JOB": "12", "RAPS_RANK": "3",
           "SLURMD_NODENAME": "n7"}
    assert AgentClient.from_env(env).socket_path == "/run/raps/n7/agent.sock"
    with pytest.raises(ValueError, match="SLURMD_NODENAME"):
        AgentClient.from_env({k: v for k, v in env.items() if k != "SLURMD_NODENAME"})
