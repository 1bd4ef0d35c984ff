"""A rank's agent connections outlive the agent's idle limit: checkpoints minutes apart."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raps_slurm.runtime.agent_client import AgentError, encode_frame
from raps_slurm.runtime.checkpoint import CheckpointClient
from raps_slurm.testing.cluster import wait_until
from tests.unit.test_ckpt_api import Agent, state


@pytest.fixture
def idle_agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(tmp_path)
    a.api.idle_timeout = 0.3  # the agent's idle limit, shortened: the client must not care
    yield a
    a.close()


def test_a_save_after_the_agent_closed_the_idle_connection_succeeds(idle_agent: Agent) -> None:
    c = idle_agent.client()
    assert c.save(state(1)).generation == 1
    # The agent hangs up on the quiet connection, as it does after a minute in production.
    wait_until("the agent closed the idle connection",
               lambda: idle_agent.api.error_counts().get("idle", 0), lambda n: n >= 1, 10)
    assert c.save(state(2)).generation == 2
    loaded = c.restore()
    assert loaded is not None and loaded.generation == 2


class ScriptedAgent:
    """A unix-socket peer that answers requests by script: per connection, a list of
    actions ('reply' or 'hangup' after reading the request). Records the ops it read."""

    def __init__(self, path: Path, script: list[list[str]]) -> None:
        self.path, self.script = path, script
        self.seen: list[tuple[int, str]] = []  # (connection number, op)
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(str(path))
        self._srv.listen(8)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        for n, actions in enumerate(self.script):
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return  # closed: the test did not need every connection scripted
            with conn:
                for action in actions:
                    head = conn.recv(4)
                    if not head:
                        break
                    body = b""
                    size = int.from_bytes(head, "big")
                    while len(body) < size:
                        body += conn.recv(size - len(body))
                    self.seen.append((n, json.loads(body)["op"]))
                    if action == "hangup":
                        break
                    conn.sendall(encode_frame({"ok": True, "n": n}))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._srv.shutdown(socket.SHUT_RDWR)  # ends a pending accept
        self._srv.close()
        self._thread.join(5)
        assert not self._thread.is_alive()


def test_a_request_broken_before_any_reply_is_sent_again_once_on_a_new_connection(
        tmp_path: Path) -> None:
    peer = ScriptedAgent(tmp_path / "a.sock", [["reply", "hangup"], ["reply"]])
    try:
        c = CheckpointClient(tmp_path / "a.sock", "5", 0, 1, timeout=5)
        assert c.request({"op": "peer_lookup"})[0]["n"] == 0
        reply, _ = c.request({"op": "peer_lookup"})
        assert reply["n"] == 1  # answered on the second connection
        assert peer.seen == [(0, "peer_lookup"), (0, "peer_lookup"), (1, "peer_lookup")]
    finally:
        peer.close()


def test_a_log_segment_the_agent_may_have_read_is_not_sent_twice(tmp_path: Path) -> None:
    peer = ScriptedAgent(tmp_path / "a.sock", [["reply", "hangup"], ["reply"]])
    try:
        c = CheckpointClient(tmp_path / "a.sock", "5", 0, 1, timeout=5)
        c.request({"op": "peer_lookup"})
        with pytest.raises(AgentError, match="closed the connection"):
            c.request({"op": "log_append"})
        assert peer.seen == [(0, "peer_lookup"), (0, "log_append")]
        # the next request opens a new connection
        assert c.request({"op": "peer_lookup"})[0]["n"] == 1
    finally:
        peer.close()


def test_a_first_connection_that_breaks_is_not_retried(tmp_path: Path) -> None:
    peer = ScriptedAgent(tmp_path / "a.sock", [["hangup"], ["reply"]])
    try:
        c = CheckpointClient(tmp_path / "a.sock", "5", 0, 1, timeout=5)
        with pytest.raises(AgentError, match="closed the connection"):
            c.request({"op": "peer_lookup"})
        assert peer.seen == [(0, "peer_lookup")]
    finally:
        peer.close()


def test_a_timed_out_request_is_not_sent_again(tmp_path: Path) -> None:
    """The agent may still be working on it (a commit must not be made twice)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(tmp_path / "a.sock"))
    srv.listen(8)
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(encode_frame({"ok": True}))
        got.append(conn.recv(4096))  # the second request, never answered
        time.sleep(1.5)
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        c = CheckpointClient(tmp_path / "a.sock", "5", 0, 1, timeout=0.5)
        c.request({"op": "peer_lookup"})
        with pytest.raises(AgentError, match="timed out"):
            c.request({"op": "ckpt_commit"})
        srv.settimeout(0.2)
        with pytest.raises(TimeoutError):
            srv.accept()  # no second connection was opened for it
        assert len(got) == 1
    finally:
        t.join(5)
        srv.close()

