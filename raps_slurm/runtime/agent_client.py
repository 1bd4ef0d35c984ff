"""The rank side of the agent's local API: register, heartbeat, stop when fenced.

A rank registers with its node's agent over the agent's unix socket (the one door a user
process has into RAPS: docs/architecture.md, Trust boundaries), then a daemon thread
heartbeats every ``interval`` with the rank's progress. Every reply carries
``valid_for``: how long the agent's fencing view lets the node's ranks go on. The same
thread is the watchdog: once that validity runs out without a fresh reply (agent frozen
or gone, node cut off from the coordinator) the rank must stop, because a replacement
may already be running elsewhere and two live copies of a rank would corrupt the job.

The wire format lives here, not in ``raps_slurm.agent``, so that a rank imports
nothing heavier than the standard library (the agent package pulls in etcd and Slurm
clients): a 4-byte big-endian length N (1..MAX_REQUEST), then N bytes of UTF-8 JSON
object; replies are framed the same way.

Run as ``python -m raps_slurm.runtime.agent_client`` it is a fake rank for tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raps_slurm.errors import RapsError

MAX_REQUEST = 65536
# EX_TEMPFAIL: the rank did nothing wrong; it stops so that its replacement is the only copy.
EXIT_FENCED = 75
MAX_JOB_ID_LEN = 20
_HEADER = struct.Struct(">I")
# Agent error kinds after which retrying cannot help: this rank was replaced or is not
# this user's to run. Anything else (the agent could not reach etcd, ...) is retried
# until validity runs out.
_FINAL_KINDS = frozenset({"epoch", "permission"})


class AgentError(RapsError):
    """The agent refused a request or could not be reached; ``kind`` is the agent's error kind."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


def encode_frame(message: Mapping[str, Any]) -> bytes:
    """One framed message; ValueError if it is empty or larger than MAX_REQUEST."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if not 1 <= len(body) <= MAX_REQUEST:
        raise ValueError(f"message of {len(body)} bytes: must be 1..{MAX_REQUEST}")
    return _HEADER.pack(len(body)) + body


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; ConnectionError if the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("connection closed by the peer")
        buf += got
    return bytes(buf)


def read_reply(sock: socket.socket) -> dict[str, Any]:
    """One framed reply; ConnectionError if it is malformed (the stream is then unusable)."""
    (n,) = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    if not 1 <= n <= MAX_REQUEST:
        raise ConnectionError(f"reply length {n} outside 1..{MAX_REQUEST}")
    try:
        obj = json.loads(recv_exact(sock, n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConnectionError(f"malformed reply: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        raise ConnectionError("malformed reply: expected an object with a boolean 'ok'")
    return obj


def _valid_for(reply: Mapping[str, Any]) -> float:
    """The reply's ``valid_for``; ConnectionError if missing or not a finite number."""
    value = reply.get("valid_for")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConnectionError(f"malformed reply: valid_for={value!r}")
    return float(value)


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


REGISTER_WAIT = 10.0  # seconds a starting rank waits for a fenced node to be valid again
REGISTER_RETRY = 0.1  # seconds between its registrations meanwhile


class AgentClient:
    """One rank's session with the local agent (thread-safe)."""

    def __init__(self, socket_path: str | os.PathLike[str], job: str, rank: int, epoch: int,
                 *, interval: float,
                 on_fenced: Callable[[str], None] | None = None) -> None:
        if not (isinstance(job, str) and job.isascii() and job.isdigit()
                and len(job) <= MAX_JOB_ID_LEN):
            raise ValueError(f"job {job!r}: expected a decimal job id")
        if not _is_uint(rank):
            raise ValueError(f"rank {rank!r}: expected an integer >= 0")
        if not _is_uint(epoch) or epoch < 1:
            raise ValueError(f"epoch {epoch!r}: expected an integer >= 1")
        if isinstance(interval, bool) or not math.isfinite(interval) or interval <= 0:
            raise ValueError(f"interval {interval!r}: expected a number of seconds > 0")
        self.socket_path = os.fspath(socket_path)
        self.job, self.rank, self.epoch = job, rank, epoch
        self.interval = float(interval)
        self.on_fenced = on_fenced
        self.valid_until = -math.inf  # monotonic; nothing is valid before a reply says so
        self.fenced_reason: str | None = None
        self.last_error = ""
        self._state = threading.Lock()
        self._step, self._items = 0, 0
        self._blocked_on: int | None = None
        self._io = threading.Lock()  # one request in flight on the connection
        self._sock: socket.socket | None = None
        self._registered = False
        self._need_register = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *,
                 on_fenced: Callable[[str], None] | None = None) -> AgentClient:
        """From RAPS_AGENT_SOCKET (``%n`` = SLURMD_NODENAME), RAPS_JOB (or SLURM_JOB_ID),
        RAPS_RANK, RAPS_EPOCH (1) and RAPS_APP_HEARTBEAT_SEC (10); ValueError naming the
        variable when one is bad."""
        env = os.environ if env is None else env

        def need(name: str) -> str:
            value = env.get(name, "")
            if not value:
                raise ValueError(f"{name} is not set")
            return value

        def integer(name: str, text: str, low: int) -> int:
            if not (text.isascii() and text.isdigit()) or int(text) < low:
                raise ValueError(f"{name}={text!r}: expected an integer >= {low}")
            return int(text)

        path = need("RAPS_AGENT_SOCKET")
        if "%n" in path:
            # One template for every node (several fake nodes share a host): the shim
            # cannot know the node name, the task's environment does.
            path = path.replace("%n", need("SLURMD_NODENAME"))
        job_var = "RAPS_JOB" if env.get("RAPS_JOB") else "SLURM_JOB_ID"
        if not env.get(job_var):
            raise ValueError("neither RAPS_JOB nor SLURM_JOB_ID is set")
        job = env[job_var]
        if not (job.isascii() and job.isdigit() and len(job) <= MAX_JOB_ID_LEN):
            raise ValueError(f"{job_var}={job!r}: expected a decimal job id")
        rank = integer("RAPS_RANK", need("RAPS_RANK"), 0)
        epoch = integer("RAPS_EPOCH", env.get("RAPS_EPOCH") or "1", 1)
        text = env.get("RAPS_APP_HEARTBEAT_SEC") or "10.0"
        try:
            interval = float(text)
        except ValueError:
            interval = math.nan
        if not math.isfinite(interval) or interval <= 0:
            raise ValueError(f"RAPS_APP_HEARTBEAT_SEC={text!r}: expected a number of seconds > 0")
        return cls(path, job, rank, epoch, interval=interval, on_fenced=on_fenced)

    # --- what the application reports ---------------------------------------------------

    def progress(self, step: int, items: int) -> None:
        """Report progress; sent with the next heartbeat."""
        if not (_is_uint(step) and _is_uint(items)):
            raise ValueError(f"step {step!r}, items {items!r}: expected integers >= 0")
        with self._state:
            self._step, self._items = step, items

    def blocked(self, peer: int | None) -> None:
        """Report the rank this one waits on (None: not blocked); sent with the next heartbeat."""
        if peer is not None and not _is_uint(peer):
            raise ValueError(f"peer {peer!r}: expected an integer >= 0 or None")
        with self._state:
            self._blocked_on = peer

    # --- session -------------------------------------------------------------------------

    def register(self, wait: float = REGISTER_WAIT) -> float:
        """Register this rank; returns ``valid_for``. AgentError if refused or unreachable.

        While the agent says the node is fenced, asks again for up to ``wait`` seconds:
        a rank that has not started has sent nothing that a fence must stop, and a node
        whose heartbeats were late for a moment (a loaded host) is valid again at the
        next acknowledged one.
        """
        deadline = time.monotonic() + wait
        while True:
            try:
                reply, sent = self._call(self._register_message(), self.interval)
            except OSError as exc:
                raise AgentError(f"cannot reach the agent at {self.socket_path}: {exc}") from exc
            if not reply["ok"]:
                raise AgentError(str(reply.get("error")), _kind(reply))
            try:
                valid_for = _valid_for(reply)
            except ConnectionError as exc:
                raise AgentError(str(exc)) from None
            if valid_for > 0:
                break
            if time.monotonic() >= deadline:
                raise AgentError(f"the agent says this node is fenced (valid_for <= 0), "
                                 f"still after {wait:g} s", "fenced")
            time.sleep(REGISTER_RETRY)
        self.valid_until = sent + valid_for
        self._registered = True
        return valid_for

    def start(self) -> None:
        """Heartbeat and watch validity in a daemon thread (call after ``register``)."""
        if not self._registered:
            raise AgentError("register() first")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"raps-agent-client-{self.rank}")
            self._thread.start()

    def close(self) -> None:
        """Stop heartbeating and unregister if the agent can still be reached."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.interval + 1.0)
        if self._registered and self.fenced_reason is None:
            # If the agent is gone there is nothing to undo: it forgets ranks on restart.
            with contextlib.suppress(OSError):
                self._call({"op": "unregister", "job": self.job, "rank": self.rank},
                           min(self.interval, 2.0))
        self._registered = False
        with self._io:
            self._drop()

    # --- internals -----------------------------------------------------------------------

    def _register_message(self) -> dict[str, Any]:
        return {"op": "register", "job": self.job, "rank": self.rank, "epoch": self.epoch,
                "pid": os.getpid()}

    def _heartbeat_message(self) -> dict[str, Any]:
        with self._state:
            return {"op": "heartbeat", "job": self.job, "rank": self.rank, "step": self._step,
                    "items": self._items, "blocked_on": self._blocked_on}

    def _call(self, message: Mapping[str, Any], timeout: float) -> tuple[dict[str, Any], float]:
        """Send one request, wait ``timeout`` for its reply; returns (reply, monotonic send time).

        Any transport failure drops the connection: after a timeout a late reply could
        still arrive and would be taken as the answer to the next request.
        """
        with self._io:
            try:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    self._sock = sock
                    sock.settimeout(timeout)
                    sock.connect(self.socket_path)
                self._sock.settimeout(timeout)
                sent = time.monotonic()
                self._sock.sendall(encode_frame(message))
                return read_reply(self._sock), sent
            except OSError:
                self._drop()
                raise

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def _run(self) -> None:
        next_beat = self._next_beat(time.monotonic())
        while True:
            now = time.monotonic()
            if now >= self.valid_until:
                last = f" (last error: {self.last_error})" if self.last_error else ""
                self._fence(f"no valid reply from the local agent in time{last}")
                return
            if now < next_beat:
                if self._stop.wait(min(next_beat, self.valid_until) - now):
                    return
                continue
            if self._stop.is_set():
                return
            # Wait for the reply as long as validity lasts, not one interval: an agent busy
            # restoring a node's ranks (its threads taking turns at the GIL) answers late
            # but answers. Never past validity: the watchdog must not be late because a
            # frozen agent holds the request.
            reason = self._beat(max(0.01, self.valid_until - now))
            if reason is not None:
                self._fence(reason)
                return
            next_beat = self._next_beat(time.monotonic())

    def _next_beat(self, now: float) -> float:
        # Every interval, but at least twice within what is left of validity: a valid_for
        # shorter than the interval, or a failing agent near the deadline, still gets
        # timely attempts to renew.
        return now + max(0.05, min(self.interval, (self.valid_until - now) / 2))

    def _beat(self, timeout: float) -> str | None:
        """One heartbeat (or re-registration); returns a reason to stop, or None."""
        register = self._need_register
        message = self._register_message() if register else self._heartbeat_message()
        try:
            reply, sent = self._call(message, timeout)
            if not reply["ok"]:
                kind = _kind(reply)
                self.last_error = f"{kind}: {reply.get('error')}"
                if kind == "not_registered":
                    self._need_register = True  # someone unregistered us; say we are here
                return f"the agent refused: {reply.get('error')}" if kind in _FINAL_KINDS else None
            valid_for = _valid_for(reply)
        except OSError as exc:
            # A new connection may reach a restarted agent, which has forgotten this rank.
            self._need_register = True
            self.last_error = f"transport: {exc}"
            return None
        epoch = reply.get("epoch", self.epoch)
        if _is_uint(epoch) and epoch > self.epoch:
            return f"replaced by epoch {epoch} (this is epoch {self.epoch})"
        if valid_for <= 0:
            return "the agent says this node is fenced (valid_for <= 0)"
        # From the send time, not the reply time: the agent computed valid_for after we
        # sent, so this errs on the early side.
        self.valid_until = sent + valid_for
        self._need_register = False
        self.last_error = ""
        return None

    def _fence(self, reason: str) -> None:
        if self.fenced_reason is not None:
            return
        self.fenced_reason = reason
        with self._io:
            self._drop()
        if self.on_fenced is not None:
            self.on_fenced(reason)
            return
        print(f"raps: rank {self.rank} of job {self.job} stops: {reason}",
              file=sys.stderr, flush=True)
        os._exit(EXIT_FENCED)  # no cleanup: atexit handlers could still write job state


def _kind(reply: Mapping[str, Any]) -> str | None:
    kind = reply.get("kind")
    return kind if isinstance(kind, str) else None


def main(argv: Sequence[str] | None = None) -> int:
    """A fake rank for integration tests: register, heartbeat, sleep until killed or fenced."""
    parser = argparse.ArgumentParser(
        prog="python -m raps_slurm.runtime.agent_client",
        description="Register a fake rank with the local raps agent and heartbeat forever; "
                    f"exits {EXIT_FENCED} on its own when the agent stops vouching for it.")
    parser.add_argument("--socket", required=True, metavar="PATH", help="agent socket")
    parser.add_argument("--job", required=True, metavar="J", help="Slurm job id")
    parser.add_argument("--rank", required=True, type=int, metavar="R")
    parser.add_argument("--epoch", type=int, default=1, metavar="E")
    parser.add_argument("--interval", type=float, default=10.0, metavar="S",
                        help="heartbeat interval in seconds (default 10)")
    parser.add_argument("--blocked-on", type=int, default=None, metavar="P",
                        help="report being blocked on rank P")
    args = parser.parse_args(argv)
    try:
        client = AgentClient(args.socket, args.job, args.rank, args.epoch,
                             interval=args.interval)
        client.blocked(args.blocked_on)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        valid_for = client.register()
    except AgentError as exc:
        print(f"raps: rank {args.rank} of job {args.job} cannot register: {exc}",
              file=sys.stderr, flush=True)
        return 1
    client.start()
    print(f"raps: rank {args.rank} of job {args.job} registered (pid {os.getpid()}, "
          f"epoch {args.epoch}, valid for {valid_for:.1f} s)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        client.close()
        return 130


if __name__ == "__main__":
    sys.exit(main())
