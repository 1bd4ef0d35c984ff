"""The rank side of checkpoints: save and restore through the local agent.

A :class:`CheckpointClient` has its own connection to the agent's socket (a save may
take seconds and must not hold up the heartbeat connection). ``save`` cuts, names and
compresses the state on this process's CPUs, ships only new chunks in sealed memory
files and commits; the agent records the generation in etcd only if this rank's epoch
is still the current one. ``restore`` gets the newest verified generation as a memory
file and maps it copy-on-write, so arrays come back writable without a copy.

The state is bytes, a numpy array, or a dict of them (see
:mod:`raps_slurm.checkpoint.writer`).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
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
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                sock.connect(self.socket_path)
                self._sock = sock
            sock = self._sock
            if fds:
                sent = socket.send_fds(sock, [frame], fds)
                if sent < len(frame):
                    sock.sendall(frame[sent:])
            else:
                sock.sendall(frame)
            head, got, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
            if not head:
                raise ConnectionError("the agent closed the connection")
            head += recv_exact(sock, _HEADER.size - len(head))
            (n,) = _HEADER.unpack(head)
            if not 1 <= n <= MAX_REQUEST:
                raise ConnectionError(f"reply length {n} outside 1..{MAX_REQUEST}")
            reply = json.loads(recv_exact(sock, n))
        except (OSError, ValueError) as exc:
            self.close()
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
