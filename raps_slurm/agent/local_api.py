"""The agent's local API: a unix socket that user processes (application ranks) talk to.

This socket is a trust boundary (docs/architecture.md, Trust boundaries): anyone on the
node may connect (mode 0666), and every request is authorized by the caller's uid, which
the kernel reports through ``SO_PEERCRED`` and the caller cannot forge. A user may
register ranks only of jobs that uid owns (the owner recorded in etcd at registration)
and only for processes that uid runs; heartbeats and unregistration come only from the
uid that registered the rank. Root may do anything.

Wire format (see :mod:`raps_slurm.runtime.agent_client`, which ranks import without
pulling in the agent): a 4-byte big-endian length N (1..MAX_REQUEST), then N bytes of
UTF-8 JSON object; replies are framed the same way. A connection carries many requests.
A request that cannot be framed or decoded gets one error reply and the connection is
closed (the stream cannot be trusted to resynchronise); a well-formed request that
breaks its op's schema or is refused gets an error reply and the connection stays.
Error replies are ``{"ok": false, "error": MESSAGE, "kind": KIND}``; ``kind`` lets a
client tell "you were replaced" from "try again".
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import socketserver
import stat
import struct
import threading
import time
import typing
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from raps_slurm.agent import fds
from raps_slurm.agent.api_schema import (
    SCHEMAS,
    Check,
    Refused,
    decode_request,
    parse_request,
)

# re-exported: the op modules and the tests take these from here
from raps_slurm.agent.proc import Peer as Peer
from raps_slurm.agent.proc import peer_credentials as peer_credentials
from raps_slurm.agent.proc import process_start as process_start
from raps_slurm.agent.proc import process_uid as process_uid
from raps_slurm.agent.quota import JobQuotas, check_rank
from raps_slurm.core.jobs import authorize
from raps_slurm.errors import RapsError, StoreUnavailable
from raps_slurm.logquota import LogQuota
from raps_slurm.runtime.agent_client import MAX_REQUEST, encode_frame

log = logging.getLogger("raps.agent")

# Once the first byte of a request arrived, the rest must follow within this time: a
# local client writes a whole frame at once, and a slow trickle must not pin a thread.
FRAME_TIMEOUT = 5.0
_HEADER = struct.Struct(">I")


class LocalApiError(RapsError):
    """The local API socket cannot be set up (path in use, not a socket, ...)."""


@dataclass(frozen=True)
class RankInfo:
    """One registered rank; times are the server clock's (monotonic)."""

    job: str
    rank: int
    epoch: int
    pid: int
    uid: int
    registered_at: float
    last_heartbeat_at: float
    step: int = 0
    items: int = 0
    blocked_on: int | None = None
    start_time: int | None = None  # /proc/<pid>/stat starttime: tells a reused pid apart


class RankTable:
    """Registered ranks by (job, rank); thread-safe, checks and changes are atomic."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankInfo] = {}

    def register(self, info: RankInfo) -> RankInfo | None:
        """Add or replace (same or higher epoch); returns the replaced entry.

        The same epoch is accepted so that a rank can re-register after its connection
        dropped or the agent restarted; only a lower one means a stale copy.
        """
        key = (info.job, info.rank)
        with self._lock:
            old = self._ranks.get(key)
            if old is not None and info.epoch < old.epoch:
                raise Refused("epoch", f"epoch {info.epoch} is older than the registered "
                                       f"{old.epoch}")
            self._ranks[key] = info
            return old

    def heartbeat(self, job: str, rank: int, uid: int, step: int, items: int,
                  blocked_on: int | None, now: float) -> RankInfo:
        """Record progress for a rank that ``uid`` registered; returns the new entry."""
        with self._lock:
            old = self._owned(job, rank, uid)
            new = replace(old, last_heartbeat_at=now, step=step, items=items,
                          blocked_on=blocked_on)
            self._ranks[(job, rank)] = new
            return new

    def unregister(self, job: str, rank: int, uid: int) -> RankInfo:
        """Remove a rank that ``uid`` registered; returns the removed entry."""
        with self._lock:
            info = self._owned(job, rank, uid)
            del self._ranks[(job, rank)]
            return info

    def _owned(self, job: str, rank: int, uid: int) -> RankInfo:
        info = self._ranks.get((job, rank))
        if info is None:
            raise Refused("not_registered", f"rank {rank} of job {job} is not registered")
        if uid != 0 and info.uid != uid:
            raise Refused("permission", f"permission denied: rank {rank} of job {job} "
                                        f"belongs to uid {info.uid}, you are uid {uid}")
        return info

    def get(self, job: str, rank: int) -> RankInfo | None:
        """One entry, or None."""
        with self._lock:
            return self._ranks.get((job, rank))

    def remove(self, job: str, rank: int) -> RankInfo | None:
        """Forget a rank without any check (the agent's own use); returns it if it was there."""
        with self._lock:
            return self._ranks.pop((job, rank), None)

    def snapshot(self) -> list[RankInfo]:
        """Every entry, by job then rank."""
        with self._lock:
            return sorted(self._ranks.values(), key=lambda r: (len(r.job), r.job, r.rank))

    def fresh_since(self, t: float) -> list[RankInfo]:
        """Entries heartbeated (or registered) after server-clock time ``t``."""
        return [r for r in self.snapshot() if r.last_heartbeat_at > t]

    def pids(self) -> dict[tuple[str, int], int]:
        """(job, rank) -> registered pid."""
        with self._lock:
            return {key: info.pid for key, info in self._ranks.items()}


def registered_epoch(ranks: RankTable, peer: Peer, job: str, rank: int) -> int | None:
    """The registered epoch of a rank ``peer`` may act for (root: any rank, maybe None).

    Refused when the rank is not registered here (for a user) or another uid registered it.
    """
    info = ranks.get(job, rank)
    if info is None:
        if peer.uid == 0:
            return None
        raise Refused("not_registered", f"rank {rank} of job {job} is not registered "
                                        "with this agent")
    if peer.uid != 0 and info.uid != peer.uid:
        raise Refused("permission", f"permission denied: rank {rank} of job {job} "
                                    f"belongs to uid {info.uid}, you are uid {peer.uid}")
    return info.epoch


def require_owner(owner_of: Callable[[str], int | None], peer: Peer, job: str) -> None:
    """Refused unless ``peer`` is root or the uid that owns ``job`` (as registered)."""
    if peer.uid == 0:
        return
    owner = owner_of(job)
    if owner != peer.uid:
        raise Refused("permission", f"permission denied: job {job} belongs to uid "
                                    f"{owner}, you are uid {peer.uid}")


# --- the server ---------------------------------------------------------------------------

MAX_FDS = 2  # descriptors one request may carry (SCM_RIGHTS); extras are closed unread
Handler = Callable[[dict[str, object], "Peer", list[int]], "tuple[dict[str, object], list[int]]"]


@dataclass(frozen=True)
class Extension:
    """An op served by another part of the agent: its schema and its handler.

    The handler gets the checked fields, the peer and the descriptors that came with the
    request (it owns them: it must close them), and returns the reply and descriptors to
    send back (closed by the server once sent).
    """

    schema: Mapping[str, Check]
    handle: Handler


class _Closed(Exception):
    """The client closed the connection (or went idle) between requests."""


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True  # a stuck client must never keep the agent from exiting
    block_on_close = False
    request_queue_size = 128
    api: LocalApiServer


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.server.api.serve_connection(typing.cast(socket.socket, self.request))


class LocalApiServer:
    """Serves the local API on the unix socket ``path`` (see the module docstring).

    ``owner_of(job)``: the job's owner uid from the store, None if not registered (called
    per non-root register; may raise, which the caller sees as an internal error).
    ``valid_for()``: seconds the node's ranks may go on (the agent's fencing view).
    ``size_of(job)``: how many ranks the job has (None: unknown, not checked); a user may
    register only ranks below it. ``quotas``: the per-job quotas the ops share
    (:mod:`raps_slurm.agent.quota`); a registration is charged as an etcd write.
    """

    def __init__(self, path: str | os.PathLike[str], node: str, *,
                 owner_of: Callable[[str], int | None],
                 valid_for: Callable[[], float],
                 idle_timeout: float = 60.0,
                 max_connections_per_uid: int = 1024,
                 proc_root: str | os.PathLike[str] = "/proc",
                 clock: Callable[[], float] = time.monotonic,
                 table: RankTable | None = None,
                 extensions: Mapping[str, Extension] | None = None,
                 size_of: Callable[[str], int | None] | None = None,
                 quotas: JobQuotas | None = None) -> None:
        if not (math.isfinite(idle_timeout) and idle_timeout > 0):
            raise ValueError(f"idle_timeout {idle_timeout!r}: expected seconds > 0")
        self.path = Path(path)
        self.node = node
        self.ranks = table if table is not None else RankTable()
        self.idle_timeout = idle_timeout
        self.max_connections_per_uid = max_connections_per_uid
        self.fd_caps = fds.FdCaps(0, max_connections_per_uid, 1 << 30)  # set by start()
        self.peer_uid_override: int | None = None  # tests only: act as this uid
        self.denied = 0
        self.errors: Counter[str] = Counter()  # kind -> count
        self._quota = LogQuota(log)
        self._owner_of, self._valid_for = owner_of, valid_for
        self._size_of = size_of
        self.quotas = quotas if quotas is not None else JobQuotas()
        self._extensions = dict(extensions or {})
        self._schemas = {**SCHEMAS, **{op: e.schema for op, e in self._extensions.items()}}
        self._proc_root, self._clock = proc_root, clock
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, int] = {}  # open connection -> peer uid
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._inode: int | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Create the socket and serve in daemon threads; LocalApiError if it cannot."""
        self.fd_caps = fds.caps(fds.raise_limit(), 1 + MAX_FDS, self.max_connections_per_uid)
        try:
            server = self._bind()
        except OSError as exc:
            raise LocalApiError(f"cannot serve the local API on {self.path}: {exc}") from exc
        self._server = server
        # The poll interval bounds how long stop() waits for the accept loop to notice.
        self._thread = threading.Thread(target=server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, name="local-api",
                                        daemon=True)
        self._thread.start()
        log.info("local API listening on %s", self.path)

    def _bind(self) -> _Server:
        parent = self.path.parent
        if not parent.exists():
            parent.mkdir(parents=True, exist_ok=True)
            parent.chmod(0o755)  # mkdir's mode is cut by the umask
        self._clear_stale()
        server = _Server(str(self.path), _Handler, bind_and_activate=False)
        server.api = self
        try:
            server.server_bind()
            # Anyone may connect; each request is authorized by the caller's uid.
            os.chmod(self.path, 0o666)
            server.server_activate()
            self._inode = os.stat(self.path).st_ino
        except BaseException:
            server.server_close()
            raise
        return server

    def _clear_stale(self) -> None:
        """Remove a socket file nobody listens on; refuse to touch anything else."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise LocalApiError(f"{self.path} exists and is not a socket; not removing it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            self.path.unlink(missing_ok=True)  # stale: left by an agent that died
            return
        except OSError as exc:
            raise LocalApiError(f"cannot tell whether {self.path} is in use: {exc}") from exc
        finally:
            probe.close()
        raise LocalApiError(f"another process is serving on {self.path}")

    def stop(self) -> None:
        """Stop accepting, close every open connection, remove the socket file."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes the handler thread blocked in recv
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            if os.lstat(self.path).st_ino == self._inode:  # not a successor's socket
                self.path.unlink()
        except FileNotFoundError:
            pass

    # --- connections ---------------------------------------------------------------------

    def serve_connection(self, conn: socket.socket) -> None:
        """Serve one connection until it closes; never raises."""
        try:
            peer = peer_credentials(conn)
        except OSError as exc:
            self._count("peercred")
            log.warning("local API: cannot read SO_PEERCRED: %s", exc)
            conn.close()
            return
        if self.peer_uid_override is not None:
            peer = replace(peer, uid=self.peer_uid_override)
        try:
            if not self._admit(conn, peer.uid):
                self._count("connections")
                log.warning("local API: refused a connection from pid %d uid %d: "
                            "%d connections open (%d for all users)", peer.pid, peer.uid,
                            self.fd_caps.per_uid, self.fd_caps.users)
                self._try_send(conn, _error(Refused(
                    "connections", f"too many connections from uid {peer.uid}")))
                return
            self._serve(conn, peer)
        except Exception:
            self._count("internal")
            log.exception("local API: connection from pid %d uid %d failed", peer.pid, peer.uid)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _admit(self, conn: socket.socket, uid: int) -> bool:
        # Per uid, so that one user opening thousands of connections cannot lock the
        # other users' ranks out; all users together below the agent's own descriptors.
        with self._lock:
            if uid != 0 and (sum(u == uid for u in self._conns.values()) >= self.fd_caps.per_uid
                             or sum(u != 0 for u in self._conns.values())
                             >= self.fd_caps.users):
                return False
            self._conns[conn] = uid
            return True

    def _serve(self, conn: socket.socket, peer: Peer) -> None:
        while True:
            fds: list[int] = []
            try:
                body, fds = self._read_frame(conn)
                request = decode_request(body)
            except _Closed:
                return
            except Refused as exc:
                close_fds(fds)
                self._count(exc.kind)
                self._quota.log(exc.kind, logging.INFO,
                                "local API: closing connection from pid %d uid %d: %s",
                                peer.pid, peer.uid, exc)
                self._try_send(conn, _error(exc))
                return
            except OSError:
                close_fds(fds)
                self._count("io")
                return
            reply, out_fds = self.handle_request_fds(request, peer, fds)
            try:
                _send_frame(conn, encode_frame(reply), out_fds)
            except OSError:
                self._count("io")  # the client went away or stopped reading
                return
            finally:
                close_fds(out_fds)

    def _read_frame(self, conn: socket.socket) -> tuple[bytes, list[int]]:
        conn.settimeout(self.idle_timeout)
        try:
            first, fds, flags, _ = socket.recv_fds(conn, _HEADER.size, MAX_FDS)
        except TimeoutError:
            self._count("idle")
            raise _Closed from None
        if flags & socket.MSG_CTRUNC:
            close_fds(fds)
            raise Refused("fds", f"a request may carry at most {MAX_FDS} descriptors")
        if not first:
            close_fds(fds)
            raise _Closed
        try:
            deadline = time.monotonic() + min(FRAME_TIMEOUT, self.idle_timeout)
            header = first + self._recv_by(conn, _HEADER.size - len(first), deadline)
            (n,) = _HEADER.unpack(header)
            if not 1 <= n <= MAX_REQUEST:
                raise Refused("size", f"request length {n} outside 1..{MAX_REQUEST}")
            return self._recv_by(conn, n, deadline), fds
        except BaseException:
            close_fds(fds)
            raise

    @staticmethod
    def _recv_by(conn: socket.socket, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                got = conn.recv(n - len(buf))
            except TimeoutError:
                raise Refused("slow", "request not complete in time") from None
            if not got:
                raise Refused("truncated", "connection closed in the middle of a request")
            buf += got
        return bytes(buf)

    def _try_send(self, conn: socket.socket, reply: Mapping[str, object]) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(encode_frame(reply))
        except OSError:
            pass  # best effort: the connection is being closed anyway

    def error_counts(self) -> dict[str, int]:
        """A copy of ``errors`` (kind -> requests), safe while requests are served."""
        with self._lock:
            return dict(self.errors)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1
            if kind == "permission":
                self.denied += 1

    # --- requests ------------------------------------------------------------------------

    def handle_request(self, request: Mapping[str, object], peer: Peer) -> dict[str, object]:
        """The reply to one decoded request from ``peer`` (no descriptors); never raises."""
        reply, out = self.handle_request_fds(request, peer, [])
        close_fds(out)
        return reply

    def handle_request_fds(self, request: Mapping[str, object], peer: Peer, fds: list[int]
                           ) -> tuple[dict[str, object], list[int]]:
        """The reply to one request and the descriptors to send with it; never raises.

        ``fds`` came with the request: an extension op takes them over, any other op
        closes them.
        """
        try:
            op, fields = parse_request(request, self._schemas)
            ext = self._extensions.get(op)
            if ext is not None:
                taken, fds = fds, []
                return ext.handle(fields, peer, taken)
            if op == "hello":
                return {"ok": True, "node": self.node, "uid": peer.uid}, []
            if op == "register":
                return self._register(fields, peer), []
            if op == "heartbeat":
                return self._heartbeat(fields, peer), []
            return self._unregister(fields, peer), []
        except Refused as exc:
            self._count(exc.kind)
            if exc.kind == "permission":
                log.warning("local API: denied %s from pid %d: %s", request.get("op"),
                            peer.pid, exc)
            return _error(exc), []
        except StoreUnavailable as exc:
            # etcd away or without quorum: the caller asks again later (raps-run does
            # every poll; a rank keeps computing).
            self._count("unavailable")
            return {"ok": False, "error": f"etcd unavailable: {exc}", "kind": "unavailable"}, []
        except Exception:
            self._count("internal")
            log.exception("local API: request from pid %d uid %d failed", peer.pid, peer.uid)
            return {"ok": False, "error": "internal error in the agent (see its log)",
                    "kind": "internal"}, []
        finally:
            close_fds(fds)

    def _register(self, fields: dict[str, object], peer: Peer) -> dict[str, object]:
        job, rank = typing.cast(str, fields["job"]), typing.cast(int, fields["rank"])
        epoch, pid = typing.cast(int, fields["epoch"]), typing.cast(int, fields["pid"])
        uid = peer.uid
        if uid != 0:
            # A user's rank is the connecting process as the kernel sees it: a pid claimed
            # from inside a container's pid namespace would name another process here.
            pid = peer.pid
        if uid != 0:  # root may act for any job; spare the store the lookup
            owner = self._owner_of(job)
            if not authorize(uid, owner):
                if owner is None:
                    raise Refused("unknown_job", f"job {job} is not registered with raps-slurm")
                raise Refused("permission", f"permission denied: job {job} belongs to uid "
                                            f"{owner}, you are uid {uid}")
            # A rank the job does not have would be reported, looked up and kept for
            # ever: one user could grow the agent's table and etcd traffic at will.
            if self._size_of is not None:
                check_rank(job, rank, self._size_of(job))
            self.quotas.write("register", job, uid)
        pid_uid = process_uid(pid, self._proc_root)
        if pid_uid is None:
            raise Refused("no_process", f"no process with pid {pid}")
        if uid != 0 and pid_uid != uid:
            raise Refused("permission", f"permission denied: pid {pid} belongs to uid "
                                        f"{pid_uid}, you are uid {uid}")
        now = self._clock()
        old = self.ranks.register(RankInfo(job, rank, epoch, pid, uid, now, now,
                                           start_time=process_start(pid, self._proc_root)))
        if old is None or (old.epoch, old.pid) != (epoch, pid):
            log.info("local API: rank %d of job %s registered: pid %d uid %d epoch %d%s",
                     rank, job, pid, uid, epoch,
                     f" (replaces pid {old.pid} epoch {old.epoch})" if old else "")
        return {"ok": True, "valid_for": self._validity()}

    def _heartbeat(self, fields: dict[str, object], peer: Peer) -> dict[str, object]:
        info = self.ranks.heartbeat(
            typing.cast(str, fields["job"]), typing.cast(int, fields["rank"]), peer.uid,
            typing.cast(int, fields["step"]), typing.cast(int, fields["items"]),
            typing.cast("int | None", fields["blocked_on"]), self._clock())
        return {"ok": True, "valid_for": self._validity(), "epoch": info.epoch}

    def _unregister(self, fields: dict[str, object], peer: Peer) -> dict[str, object]:
        info = self.ranks.unregister(typing.cast(str, fields["job"]),
                                     typing.cast(int, fields["rank"]), peer.uid)
        log.info("local API: rank %d of job %s unregistered (pid %d)", info.rank, info.job,
                 info.pid)
        return {"ok": True}

    def _validity(self) -> float:
        value = float(self._valid_for())
        # A non-finite answer is a bug in the caller; never promise forever because of it.
        return max(0.0, value) if math.isfinite(value) else 0.0


def close_fds(fds: list[int]) -> None:
    """Close descriptors that came with a request (or were to go with a reply)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _send_frame(conn: socket.socket, frame: bytes, fds: list[int]) -> None:
    if not fds:
        conn.sendall(frame)
        return
    sent = socket.send_fds(conn, [frame], fds)  # the descriptors ride on the first byte
    if sent < len(frame):
        conn.sendall(frame[sent:])


def _error(exc: Refused) -> dict[str, object]:
    return {"ok": False, "error": str(exc), "kind": exc.kind}
