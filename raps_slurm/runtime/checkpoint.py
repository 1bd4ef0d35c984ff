"""The rank side of checkpoints: save and restore through the local agent.

A :class:`CheckpointClient` has its own connection to the agent's socket (a save may
take seconds and must not hold up the heartbeat connection). The agent closes a
connection idle for a minute (a stranger must not hold one for ever), and checkpoints are
minutes apart: the client opens a new connection when the agent closed the old one, and
sends a request again, once, on a new connection when the old one broke before any reply
(:data:`NOT_RESENT` lists the ops for which that could store a thing twice).

``save`` cuts, names and compresses the state on this process's CPUs, ships only new
chunks in sealed memory files and commits; the agent records the generation in etcd only
if this rank's epoch is still the current one. ``restore`` gets the newest verified
generation as a memory file and maps it copy-on-write, so arrays come back writable
without a copy.

The state is bytes, a numpy array, or a dict of them (see
:mod:`raps_slurm.checkpoint.writer`).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.checkpoint.manifest import MAX_MANIFEST, Manifest
from raps_slurm.checkpoint.pack import PackWriter, sealed_bytes
from raps_slurm.checkpoint.reader import materialize
from raps_slurm.checkpoint.writer import SaveStats, encode_state
from raps_slurm.runtime.agent_client import (
    _HEADER,
    MAX_REQUEST,
    AgentError,
    encode_frame,
    recv_exact,
)


@dataclass
class Saved:
    """One committed generation."""

    generation: int
    state: str
    holders: list[str]
    stats: SaveStats


@dataclass
class Loaded:
    """A restored state and where it came from."""

    state: object
    generation: int | str
    fallbacks: list[dict[str, Any]] = field(default_factory=list)


# A log segment the agent took in before the connection broke would be stored twice if
# sent again: sent again only when the send itself failed (the agent then never read it).
NOT_RESENT = frozenset({"log_append"})


class _Broken(Exception):
    """The connection failed; ``replied``: some of the reply had come."""

    def __init__(self, exc: BaseException, *, sent: bool, replied: bool) -> None:
        super().__init__(str(exc))
        self.exc, self.sent, self.replied = exc, sent, replied


class CheckpointClient:
    """Saves and restores of one rank (thread-safe: one operation at a time)."""

    def __init__(self, socket_path: str | os.PathLike[str], job: str, rank: int,
                 epoch: int, *, timeout: float = 600.0) -> None:
        self.socket_path = os.fspath(socket_path)
        self.job, self.rank, self.epoch = job, rank, epoch
        self.timeout = timeout
        self.last: Manifest | None = None  # base of the next incremental save
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def close(self) -> None:
        """Close the connection."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def request(self, message: dict[str, Any], fds: list[int] | None = None
                ) -> tuple[dict[str, Any], list[int]]:
        """One request to the agent on this connection: (reply, descriptors received).
        AgentError on a refusal or a broken connection."""
        return self._call(message, fds)

    def _call(self, message: dict[str, Any], fds: list[int] | None = None
              ) -> tuple[dict[str, Any], list[int]]:
        frame = encode_frame(message)
        reused = self._sock is not None and self._open()
        try:
            try:
                reply, got = self._exchange(frame, fds)
            except _Broken as broken:
                self.close()
                # A connection that served before and broke with no reply: the agent
                # closed it (idle, or it restarted) rather than dropped this request. A
                # timeout is not that: the agent may still be working on the request.
                again = (reused and not broken.replied
                         and not isinstance(broken.exc, TimeoutError)
                         and (not broken.sent or message.get("op") not in NOT_RESENT))
                if not again:
                    raise broken.exc from None
                try:
                    reply, got = self._exchange(frame, fds)
                except _Broken as second:
                    self.close()
                    raise second.exc from None
        except (OSError, ValueError) as exc:
            raise AgentError(f"checkpoint request to the agent at {self.socket_path} "
                             f"failed: {exc}") from exc
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            for fd in got:
                os.close(fd)
            kind = reply.get("kind") if isinstance(reply, dict) else None
            error = reply.get("error") if isinstance(reply, dict) else reply
            raise AgentError(f"{message.get('op')}: {error}", kind if isinstance(kind, str)
                             else None)
        return reply, got

    def _open(self) -> bool:
        """Whether the kept connection is still open; closes it if the agent hung up
        (nothing is ever due from the agent between requests, so readable means EOF)."""
        assert self._sock is not None
        poller = select.poll()
        poller.register(self._sock, select.POLLIN | select.POLLHUP)
        if poller.poll(0):
            self.close()
            return False
        return True

    def _exchange(self, frame: bytes, fds: list[int] | None
                  ) -> tuple[Any, list[int]]:
        """One request and its reply on the kept connection (opened if need be);
        _Broken if the connection fails, ValueError for a malformed reply."""
        sent = replied = False
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(self.timeout)
                    sock.connect(self.socket_path)
                except OSError:
                    sock.close()
                    raise
                self._sock = sock
            sock = self._sock
            if fds:
                n = socket.send_fds(sock, [frame], fds)
                sent = True
                if n < len(frame):
                    sock.sendall(frame[n:])
            else:
                sock.sendall(frame)
            sent = True
            head, got, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
            if not head:
                raise ConnectionError("the agent closed the connection")
            replied = True
            try:
                head += recv_exact(sock, _HEADER.size - len(head))
                (n,) = _HEADER.unpack(head)
                if not 1 <= n <= MAX_REQUEST:
                    raise ConnectionError(f"reply length {n} outside 1..{MAX_REQUEST}")
                return json.loads(recv_exact(sock, n)), got
            except BaseException:
                for fd in got:
                    os.close(fd)
                raise
        except OSError as exc:
            raise _Broken(exc, sent=sent, replied=replied) from None
        except ValueError:
            self.close()
            raise

    def save(self, state: object, extra: dict[str, Any] | None = None) -> Saved:
        """Checkpoint ``state`` as this rank's next generation.

        AgentError with kind ``epoch`` when this copy was superseded (stop the rank).
        """
        with self._lock:
            base = self.last.generation if self.last is not None else None
            reply, _ = self._call({"op": "ckpt_begin", "job": self.job, "rank": self.rank,
                                   "epoch": self.epoch, "base": base})
            sid = reply["session"]
            p = reply["params"]
            params = CodecParams(int(p["avg_chunk_kb"]), str(p["digest"]),
                                 int(p["zstd_level"]), bool(p["shuffle"]))
            previous = self.last if reply.get("base_ok") else None

            def sink(pack: PackWriter) -> None:
                pack.seal()
                self._call({"op": "ckpt_put", "session": sid}, [pack.fd])

            try:
                manifest, stats = encode_state(state, job=self.job, rank=self.rank,
                                               epoch=self.epoch, params=params,
                                               previous=previous, sink=sink, extra=extra)
            except BaseException:
                with contextlib.suppress(AgentError):
                    self._call({"op": "ckpt_abort", "session": sid})
                raise
            fd = sealed_bytes(manifest.to_json(), "raps-manifest")
            try:
                done, _ = self._call({"op": "ckpt_commit", "session": sid}, [fd])
            finally:
                os.close(fd)
            gen = int(done["generation"])
            self.last = manifest.with_generation(gen)
            return Saved(gen, str(done["state"]), list(done["holders"]), stats)

    def restore(self) -> Loaded | None:
        """The newest verified generation (None if this rank never committed one)."""
        with self._lock:
            reply, fds = self._call({"op": "ckpt_restore", "job": self.job,
                                     "rank": self.rank})
            try:
                if reply.get("generation") is None:
                    return None
                if len(fds) != 2:
                    raise AgentError(f"ckpt_restore: expected 2 descriptors, got {len(fds)}")
                data_fd, manifest_fd = fds
                manifest = Manifest.from_json("manifest from the agent",
                                              os.pread(manifest_fd, MAX_MANIFEST, 0))
                size = manifest.total_size
                # Copy-on-write: the rank may change its arrays; the memory file stays as
                # restored (the agent keeps no mapping of it).
                buf = mmap.mmap(data_fd, size, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None
                state = materialize(manifest, buf)
            finally:
                for fd in fds:
                    os.close(fd)
            gen = reply["generation"]
            if isinstance(gen, int):
                self.last = manifest.with_generation(gen)
            return Loaded(state, gen, list(reply.get("fallbacks") or []))
