"""The coordinator's door for users on nodes without an agent (login nodes): ``rapsctl``
over TCP with a MUNGE credential, as Slurm's own clients reach slurmctld.

Wire format: a 4-byte big-endian length N (1..MAX_REQUEST), then N bytes of a UTF-8 JSON
object ``{"op", "job", "cred"}``; the reply is framed the same way, ``{"ok": true, ...}``
or ``{"ok": false, "error", "kind"}``. One request per connection.

The credential's payload must be :func:`request_digest` of the request without it, so a
credential answers one question only (munged also refuses to decode one twice). munged
vouches for the uid; the rule is the agent's: root, or the job's registered owner
(``core.jobs.authorize``). A refusal is logged with both uids and counted by kind.

Ops (read-only): ``job`` (the job as ``rapsctl show job --json`` prints it) and
``recoveries`` (its recovery plans as ``rapsctl show recoveries --json`` prints them).

Bounds: the whole request must arrive within ``TIMEOUT`` of the connection (a deadline,
not a per-``recv`` timeout: one byte a second does not keep it open), and at most
``MAX_CONNECTIONS`` are served at once, one thread each (:mod:`raps_slurm.wire.gate`: a new
connection evicts the oldest one still sending its request). Refusals are counted like
the others: ``timeout``, ``evicted``, ``busy``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from raps_slurm.coordinator.recovery import plans_in_order, read_plans
from raps_slurm.core.jobs import JobRecord, authorize
from raps_slurm.core.planner import plan_dict
from raps_slurm.errors import RecordError, Refused, StoreError
from raps_slurm.munge import Credential, MungeError
from raps_slurm.registry import UnknownJob, job_view
from raps_slurm.store import Keys, StateStore
from raps_slurm.wire.framing import FrameError, read_frame
from raps_slurm.wire.gate import BoundedServer, Gate

log = logging.getLogger("raps.coordinator")

MAX_REQUEST = 16384  # bytes: a MUNGE credential is about 200, the rest a few dozen
TIMEOUT = 5.0  # seconds for a client to send its whole request
MAX_CONNECTIONS = 32  # connections (and threads) served at once
REPLY_TIMEOUT = 5.0  # seconds for the reply to leave
OPS = ("job", "recoveries")
_LEN = struct.Struct(">I")


def request_digest(op: str, job: str) -> bytes:
    """What the MUNGE credential of a request must carry: binds it to this question."""
    canonical = json.dumps({"job": job, "op": op}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest().encode()


def parse_request(body: bytes) -> tuple[str, str, str]:
    """(op, job, cred) of one request body; Refused naming what is wrong."""
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Refused("json", "request is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise Refused("schema", "request must be a JSON object")
    op, job, cred = obj.get("op"), obj.get("job"), obj.get("cred")
    if op not in OPS:
        raise Refused("unknown_op", f"op must be one of {', '.join(OPS)}")
    if not (isinstance(job, str) and job.isascii() and job.isdigit() and len(job) <= 20):
        raise Refused("schema", "job must be a job id (decimal digits)")
    if not isinstance(cred, str) or not cred.startswith("MUNGE:") or len(cred) > 8192:
        raise Refused("schema", "cred must be a MUNGE credential")
    if set(obj) - {"op", "job", "cred"}:
        raise Refused("schema", "unknown fields: only op, job and cred")
    return str(op), job, cred


class UserDoor:
    """Serves user requests on ``address`` (TCP) from any coordinator, leader or not."""

    def __init__(self, store: StateStore, keys: Keys, address: tuple[str, int],
                 decode: Callable[[str], Credential],
                 on_result: Callable[[str], None] = lambda _: None, *,
                 timeout: float = TIMEOUT, max_connections: int = MAX_CONNECTIONS) -> None:
        self.store, self.keys = store, keys
        self._decode, self._on_result = decode, on_result
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.timeout = timeout
        self.gate = Gate(max_connections, self._count)
        self._server = BoundedServer(address, self.serve, self.gate)
        self.address: tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.2}, name="user-door",
                                        daemon=True)

    def start(self) -> None:
        """Serve in a daemon thread."""
        self._thread.start()
        log.info("user door listening on %s:%d (MUNGE)", *self.address)

    def stop(self) -> None:
        """Stop serving (and release the port, started or not)."""
        if self._thread.is_alive():
            self._server.shutdown()  # waits for serve_forever: only once it runs
        self._server.server_close()

    def _count(self, result: str) -> None:
        with self._lock:
            self.counts[result] += 1
        self._on_result(result)

    def serve(self, conn: socket.socket) -> None:
        """One connection: read the request, answer, close; never raises."""
        try:
            body = _read(conn, self.timeout)
            self.gate.settled(conn)
            reply = self.answer(body)
        except Refused as exc:
            if self.gate.evicted(conn):
                return  # counted by the gate; nobody to answer
            self._count(exc.kind)
            reply = {"ok": False, "error": str(exc), "kind": exc.kind}
        except OSError:
            self._count("io")
            return
        try:
            data = json.dumps(reply, default=str).encode()
            conn.settimeout(REPLY_TIMEOUT)
            conn.sendall(_LEN.pack(len(data)) + data)
        except OSError:
            self._count("io")

    def answer(self, body: bytes) -> dict[str, Any]:
        """The reply to one request body; Refused for anything not served."""
        op, job, cred = parse_request(body)
        try:
            who = self._decode(cred)
        except MungeError as exc:
            raise Refused("credential", f"credential refused: {exc}") from None
        if who.payload != request_digest(op, job):
            raise Refused("credential", "credential was made for another request")
        try:
            kv = self.store.get(self.keys.job(job))
            owner = None if kv is None else JobRecord.from_json(kv.key, kv.value).owner_uid
            if not authorize(who.uid, owner):
                if owner is None:
                    raise Refused("unknown_job", f"job {job} is not registered with raps-slurm")
                log.warning("user door: uid %d asked for job %s of uid %d: refused",
                            who.uid, job, owner)
                raise Refused("permission", f"permission denied: job {job} belongs to uid "
                                            f"{owner}, you are uid {who.uid}")
            result = self._query(op, job)
        except (StoreError, RecordError) as exc:
            raise Refused("unavailable", f"etcd: {exc}") from None
        except UnknownJob as exc:
            raise Refused("unknown_job", str(exc)) from None
        self._count("served")
        return {"ok": True, "uid": who.uid, "result": result}

    def _query(self, op: str, job: str) -> Any:
        if op == "job":
            return job_view(self.store, self.keys, job)
        book = read_plans(self.store, self.keys)
        return [plan_dict(p, book.events.get(p.plan_id, {}))
                for p in plans_in_order(p for p, _ in book.plans.values() if p.job == job)]


_KINDS = {"oversized": "size", "empty": "size", "timeout": "timeout", "closed": "truncated",
          "truncated": "truncated"}


def _read(conn: socket.socket, timeout: float) -> bytes:
    """The request body, all of it within ``timeout`` seconds; Refused by kind."""
    try:
        return read_frame(conn, frame_timeout=timeout, idle_timeout=timeout,
                          max_size=MAX_REQUEST, deadline=time.monotonic() + timeout)
    except FrameError as exc:
        raise Refused(_KINDS.get(exc.kind, "io"), f"request refused: {exc}") from None
