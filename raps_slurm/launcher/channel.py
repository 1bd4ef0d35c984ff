"""The control channel between ``raps-run`` and its node supervisors: authentication and
JSON messages over :mod:`raps_slurm.wire.framing`.

raps-run makes a fresh random secret per run and passes it, with its address, in the
environment of the steps it starts (``RAPS_CONTROL=host:port``, ``RAPS_CONTROL_KEY`` in
hex): srun hands that environment to the job's own processes only, readable by the job's
user and root. The secret never crosses the wire. A connection begins with a
challenge-response over it, both ways:

1. raps-run sends ``{"challenge": Ns}`` (32 random bytes, hex);
2. the supervisor answers ``{"node": NAME, "nonce": Nc, "proof": HMAC(key, client|Ns|Nc|NAME)}``;
3. raps-run checks it and answers ``{"proof": HMAC(key, server|Ns|Nc|NAME)}``, which the
   supervisor checks in turn (it talks to the raps-run that holds the secret).

Both then derive one key per direction from the secret and both nonces, and every
further frame carries an HMAC with a sequence number (a frame replayed from an earlier
connection, reflected back or reordered is refused). The supervisor's first message is
``hello``. Only the standard library and :mod:`raps_slurm.wire.framing` are imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import socket
import threading
import time
from typing import Any

from raps_slurm.wire.framing import FrameError, FrameMac, read_frame, send_frame

PROTOCOL = b"raps-control/1"
NONCE_BYTES = 32
MAX_MESSAGE = 1 << 20  # a start command carries the program's argv
FRAME_SEC = 10.0  # one whole frame, once it began
AUTH_SEC = 5.0  # the whole handshake (and the hello after it, at raps-run)
MAX_NODE_NAME = 255
ENV_ADDRESS = "RAPS_CONTROL"
ENV_KEY = "RAPS_CONTROL_KEY"


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join((PROTOCOL, *parts)), hashlib.sha256).digest()


def _hex(obj: dict[str, Any], name: str, size: int) -> bytes:
    value = obj.get(name)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise FrameError("malformed", f"handshake: {name!r} is not {size} bytes of hex")
    return raw


def _json(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError("malformed", f"not a JSON object: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError("malformed", "not a JSON object")
    return obj


def _dump(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")


def valid_node_name(name: object) -> bool:
    """A Slurm node name as a supervisor may call itself (printable ASCII, no spaces)."""
    return (isinstance(name, str) and 0 < len(name) <= MAX_NODE_NAME and name.isascii()
            and name.isprintable() and " " not in name)


class Channel:
    """An authenticated message stream; ``send`` may be called from any thread, ``recv``
    from one."""

    def __init__(self, sock: socket.socket, node: str, send_key: bytes, recv_key: bytes
                 ) -> None:
        self.sock, self.node = sock, node
        self._tx, self._rx = FrameMac(send_key), FrameMac(recv_key)
        self._lock = threading.Lock()

    def send(self, msg: dict[str, Any], timeout: float = FRAME_SEC) -> None:
        """One message; FrameError if it cannot be written within ``timeout``."""
        with self._lock:
            send_frame(self.sock, _dump(msg), mac=self._tx, max_size=MAX_MESSAGE,
                       timeout=timeout)

    def recv(self, idle_timeout: float | None = None) -> dict[str, Any]:
        """The next message (waiting ``idle_timeout`` for it to begin, None: for ever)."""
        return _json(read_frame(self.sock, frame_timeout=FRAME_SEC, idle_timeout=idle_timeout,
                                mac=self._rx, max_size=MAX_MESSAGE))

    def close(self) -> None:
        """Close the connection; the peer's next read fails."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _keys(key: bytes, ns: bytes, nc: bytes) -> tuple[bytes, bytes]:
    session = _mac(key, b"session", ns, nc)
    return (hmac.new(session, b"supervisor->raps-run", hashlib.sha256).digest(),
            hmac.new(session, b"raps-run->supervisor", hashlib.sha256).digest())


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FrameError("timeout", "handshake not finished in time")
    return left


def accept(sock: socket.socket, key: bytes, timeout: float = AUTH_SEC) -> Channel:
    """raps-run's side of the handshake; FrameError (kind ``auth``, ``timeout``,
    ``malformed``, ...) and nothing learnt about the secret when the peer fails it."""
    deadline = time.monotonic() + timeout
    ns = os.urandom(NONCE_BYTES)
    send_frame(sock, _dump({"challenge": ns.hex()}), timeout=_left(deadline))
    left = _left(deadline)
    hello = _json(read_frame(sock, frame_timeout=left, idle_timeout=left, max_size=4096))
    node = hello.get("node")
    if not valid_node_name(node):
        raise FrameError("malformed", "handshake: no valid node name")
    assert isinstance(node, str)
    nc = _hex(hello, "nonce", NONCE_BYTES)
    proof = _hex(hello, "proof", 32)
    if not hmac.compare_digest(proof, _mac(key, b"client", ns, nc, node.encode())):
        raise FrameError("auth", f"handshake: bad proof from a peer calling itself {node!r}")
    send_frame(sock, _dump({"proof": _mac(key, b"server", ns, nc, node.encode()).hex()}),
               timeout=_left(deadline))
    up, down = _keys(key, ns, nc)
    return Channel(sock, node, send_key=down, recv_key=up)


def connect(address: str, key: bytes, node: str, timeout: float = AUTH_SEC) -> Channel:
    """The supervisor's side: connect to ``host:port`` and authenticate both ways;
    OSError or FrameError when it fails."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{ENV_ADDRESS}={address!r}: expected HOST:PORT")
    deadline = time.monotonic() + timeout
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        left = _left(deadline)
        ns = _hex(_json(read_frame(sock, frame_timeout=left, idle_timeout=left,
                                   max_size=4096)), "challenge", NONCE_BYTES)
        nc = os.urandom(NONCE_BYTES)
        send_frame(sock, _dump({"node": node, "nonce": nc.hex(),
                                "proof": _mac(key, b"client", ns, nc, node.encode()).hex()}),
                   timeout=_left(deadline))
        left = _left(deadline)
        proof = _hex(_json(read_frame(sock, frame_timeout=left, idle_timeout=left,
                                      max_size=4096)), "proof", 32)
        if not hmac.compare_digest(proof, _mac(key, b"server", ns, nc, node.encode())):
            raise FrameError("auth", f"{address} does not hold this run's secret")
    except BaseException:
        sock.close()
        raise
    up, down = _keys(key, ns, nc)
    return Channel(sock, node, send_key=up, recv_key=down)
