"""How a user's ``rapsctl`` (not root) asks about a job: the coordinators' user door over
TCP with a MUNGE credential (``coordinator.addresses``, tried in order). Root reads etcd
directly; users never do (docs/architecture.md, Trust boundaries)."""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

from raps_slurm import munge
from raps_slurm.config import Config, parse_address
from raps_slurm.coordinator.userdoor import MAX_REQUEST, request_digest
from raps_slurm.errors import RapsError

_LEN = struct.Struct(">I")
MAX_REPLY = 64 << 20


def as_user() -> bool:
    """True when this rapsctl must go through the user door (the caller is not root)."""
    return os.geteuid() != 0


def ask(cfg: Config, op: str, job: str, timeout: float = 10.0) -> Any:
    """The door's answer to ``op`` about ``job``; RapsError with the door's refusal, or
    naming every address tried when none answered."""
    tried: list[str] = []
    for addr in cfg.coordinator.addresses:
        target = parse_address(addr)
        if target is None:
            continue
        # a fresh credential per attempt: munged lets each be decoded once
        cred = munge.encode(request_digest(op, job))
        body = json.dumps({"op": op, "job": job, "cred": cred}).encode()
        if len(body) > MAX_REQUEST:
            raise RapsError(f"{op}: request too large ({len(body)} bytes)")
        try:
            with socket.create_connection(target, timeout=timeout) as conn:
                conn.sendall(_LEN.pack(len(body)) + body)
                reply = json.loads(_read(conn))
        except (OSError, ValueError) as exc:
            tried.append(f"{addr}: {exc}")
            continue
        if not isinstance(reply, dict):
            tried.append(f"{addr}: malformed reply")
            continue
        if reply.get("ok") is not True:
            raise RapsError(str(reply.get("error", "refused")))
        return reply.get("result")
    raise RapsError("no coordinator answered at coordinator.addresses ("
                    + "; ".join(tried or ["none configured"]) + ")")


def _read(conn: socket.socket) -> bytes:
    head = _exact(conn, _LEN.size)
    (n,) = _LEN.unpack(head)
    if not 1 <= n <= MAX_REPLY:
        raise ValueError(f"reply length {n} outside 1..{MAX_REPLY}")
    return _exact(conn, n)


def _exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ValueError("the coordinator closed the connection early")
        buf += chunk
    return bytes(buf)
