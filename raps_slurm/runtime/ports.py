"""Where a rank's runtime keeps what outlives it: peer addresses, its message log, its
checkpoints. Two implementations of one small interface:

- :class:`AgentPort`: the node's agent, over its unix socket (production; the rank
  holds no etcd credentials: docs/architecture.md, Trust boundaries);
- :class:`LocalPort`: a directory on this machine (``runtime.init(local=N)`` and the
  tests): peers are files, the log is segment files, checkpoints go to a chunk store
  in the directory, ``epochs/<rank>`` plays the rank map's epoch check and ``job.key``
  (mode 0600, made by the first rank) the job's key.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Protocol

from raps_slurm.checkpoint.chunkstore import ChunkStore, write_atomic
from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.checkpoint.local import LocalCheckpoints
from raps_slurm.checkpoint.logstore import LogStore
from raps_slurm.checkpoint.manifest import Manifest
from raps_slurm.checkpoint.reader import materialize
from raps_slurm.checkpoint.writer import encode_state
from raps_slurm.runtime.agent_client import AgentError
from raps_slurm.runtime.rankauth import KEY_BYTES, RankKeys


class Port(Protocol):
    """What the runtime needs from its agent (or its stand-in)."""

    def rank_keys(self, peer: int) -> RankKeys: ...
    def publish(self, host: str, port: int, epoch: int, done: bool = False) -> None: ...
    def lookup(self, rank: int) -> tuple[str, int, int, bool] | None: ...
    def log_append(self, parts: list[bytes | memoryview]) -> None: ...
    def log_read(self) -> bytes: ...
    def log_trim(self, floors: dict[int, int]) -> None: ...
    def save(self, items: dict[str, Any], extra: dict[str, Any]) -> int: ...
    def restore(self) -> tuple[dict[str, Any], int, dict[str, Any]] | None: ...
    def heartbeat(self, step: int, items: int) -> None: ...
    def blocked(self, peer: int | None) -> None: ...
    def escalate(self, reason: str, requeue: bool = True) -> None: ...
    def report(self, stats: dict[str, Any]) -> None: ...
    def recovery_event(self, phase: str, detail: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class LocalPort:
    """A directory shared by the ranks of one local run."""

    def __init__(self, root: str | os.PathLike[str], job: str, rank: int, epoch: int,
                 params: CodecParams | None = None, max_generations: int = 5) -> None:
        self.root = Path(root)
        self.job, self.rank, self.epoch = job, rank, epoch
        self.params = params or CodecParams()
        self.max_generations = max_generations
        for d in ("peers", "epochs", "tmp"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        # One store per rank: several processes share the directory, and a store's
        # collection must only ever see its own process's pins.
        self._ckpt = LocalCheckpoints(ChunkStore(self.root / "ckpt" / str(rank)))
        self._logs = LogStore(self.root / "logs", cold=True)  # no backup to copy to
        self._last: Manifest | None = None
        self._lock = threading.Lock()
        current = self.current_epoch(rank)
        if current is None or current < epoch:
            write_atomic(self.root / "epochs", self.root / "tmp", str(rank),
                         [str(epoch).encode()], sync_dir=False)

    def current_epoch(self, rank: int) -> int | None:
        """The epoch the 'rank map' says rank runs at."""
        try:
            return int((self.root / "epochs" / str(rank)).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _check_epoch(self) -> None:
        current = self.current_epoch(self.rank)
        if current is not None and current != self.epoch:
            raise AgentError(f"rank {self.rank} is at epoch {current}; this copy is epoch "
                             f"{self.epoch}", "epoch")

    def rank_keys(self, peer: int) -> RankKeys:
        """One key for every pair (a local run is one user's ranks on one host), and the
        epoch ``peer`` runs at."""
        key = self.job_key()
        return RankKeys(key, (key,), self.current_epoch(peer))

    def job_key(self) -> bytes:
        """The run's key: ``job.key`` in the directory, made by whichever rank asks first
        (written aside, then linked: another rank never reads half a key)."""
        path = self.root / "job.key"
        if not path.exists():
            tmp = self.root / "tmp" / f"job.key.{os.getpid()}.{threading.get_ident()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, os.urandom(KEY_BYTES))
            finally:
                os.close(fd)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
            tmp.unlink()
        key = path.read_bytes()
        if len(key) != KEY_BYTES:
            raise AgentError(f"{path}: {len(key)} bytes, expected a key of {KEY_BYTES}")
        return key

    def publish(self, host: str, port: int, epoch: int, done: bool = False) -> None:
        write_atomic(self.root / "peers", self.root / "tmp", f"{self.rank}.json",
                     [json.dumps({"host": host, "port": port, "epoch": epoch,
                                  "done": done}).encode()], sync_dir=False)

    def lookup(self, rank: int) -> tuple[str, int, int, bool] | None:
        try:
            d = json.loads((self.root / "peers" / f"{rank}.json").read_text())
            return str(d["host"]), int(d["port"]), int(d["epoch"]), bool(d.get("done"))
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def log_append(self, parts: list[bytes | memoryview]) -> None:
        if not parts:
            return
        with self._lock:
            self._check_epoch()
            self._logs.append(self.job, self.rank, parts, check=False)

    def log_read(self) -> bytes:
        return self._logs.read(self.job, self.rank)

    def log_trim(self, floors: dict[int, int]) -> None:
        self._logs.trim(self.job, self.rank, floors)

    def save(self, items: dict[str, Any], extra: dict[str, Any]) -> int:
        with self._lock:
            self._check_epoch()
            job, rank = self.job, self.rank
            base = self._last.generation if self._last else None
            session, ok = self._ckpt.begin(job, rank, self.epoch, base)
            try:
                m, _ = encode_state(items, job=job, rank=rank, epoch=self.epoch,
                                    params=self.params, previous=self._last if ok else None,
                                    sink=lambda p: _ignore(self._ckpt.ingest(session, p.fd)),
                                    extra=extra)
                gen = max(self._ckpt.store.generations(job, rank), default=0) + 1
                self._ckpt.finish(session, m, gen)
            finally:
                self._ckpt.end(session)
            self._last = m.with_generation(gen)
            self._ckpt.store.collect(job, self.max_generations)
            return gen

    def restore(self) -> tuple[dict[str, Any], int, dict[str, Any]] | None:
        """The newest whole generation; None if the rank never saved one; AgentError
        with kind ``lost`` if it saved some and none is whole (never a silent restart
        from the beginning: its peers' state depends on what it computed)."""
        gens = self._ckpt.store.generations(self.job, self.rank)
        for gen in reversed(gens):
            restored, _ = self._ckpt.restore(self.job, self.rank, gen)
            if restored is None:
                continue
            state = materialize(restored.manifest, restored.buffer)
            items = state if isinstance(state, dict) else {"": state}
            # Copies: the memory file is closed below.
            items = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in items.items()}
            self._last = restored.manifest
            extra = restored.manifest.extra
            restored.close()
            return items, gen, extra
        if gens:
            raise AgentError(f"no generation of rank {self.rank} could be restored: "
                             f"generations {gens} all have bad chunks", "lost")
        return None

    def heartbeat(self, step: int, items: int) -> None:
        return None

    def blocked(self, peer: int | None) -> None:
        return None

    def report(self, stats: dict[str, Any]) -> None:
        write_atomic(self.root / "peers", self.root / "tmp", f"{self.rank}.stats",
                     [json.dumps(stats).encode()], sync_dir=False)

    def recovery_event(self, phase: str, detail: dict[str, Any]) -> None:
        with open(self.root / "recovery-events.log", "a") as f:
            f.write(json.dumps({"rank": self.rank, "epoch": self.epoch, "phase": phase,
                                "detail": detail}) + "\n")

    def escalate(self, reason: str, requeue: bool = True) -> None:
        # The local launcher ends the job on a line asking for a requeue (runtime/local.py).
        from raps_slurm.runtime.local import ESCALATIONS, NO_REQUEUE
        (self.root / ESCALATIONS).mkdir(exist_ok=True)
        line = " ".join(reason.split()) + ("" if requeue else NO_REQUEUE)
        with open(self.root / ESCALATIONS / f"{self.rank}.log", "a") as f:
            f.write(line + "\n")

    def close(self) -> None:
        return None


class AgentPort:
    """The node's agent: the runtime's one door (unix socket, SO_PEERCRED)."""

    def __init__(self, socket_path: str, job: str, rank: int, epoch: int, *,
                 heartbeat_sec: float = 10.0) -> None:
        from raps_slurm.runtime.agent_client import AgentClient
        from raps_slurm.runtime.checkpoint import CheckpointClient

        self.job, self.rank, self.epoch = job, rank, epoch
        self.agent = AgentClient(socket_path, job, rank, epoch, interval=heartbeat_sec)
        self.agent.register()
        self.agent.start()
        self.ckpt = CheckpointClient(socket_path, job, rank, epoch)
        # Messaging ops get their own connection: a checkpoint in progress on the other
        # one must not hold up log flushes.
        self._msg = CheckpointClient(socket_path, job, rank, epoch, timeout=60)
        self._msg_lock = threading.Lock()
        self._socket_path = socket_path
        self._keys: CheckpointClient | None = None
        self._keys_lock = threading.Lock()

    def _call(self, message: dict[str, Any], fds: list[int] | None = None
              ) -> tuple[dict[str, Any], list[int]]:
        with self._msg_lock:
            return self._msg._call(message, fds)

    def rank_keys(self, peer: int) -> RankKeys:
        """The keys of this rank's traffic with ``peer`` and the epoch the rank map gives
        it, from the agent (served to the job owner's registered ranks only). On a
        connection of its own: a handshake must not wait behind a log flush."""
        with self._keys_lock:
            if self._keys is None:
                from raps_slurm.runtime.checkpoint import CheckpointClient

                self._keys = CheckpointClient(self._socket_path, self.job, self.rank,
                                              self.epoch, timeout=30)
            reply, _ = self._keys._call({"op": "rank_keys", "job": self.job,
                                         "rank": self.rank, "peer": peer})
        try:
            connect = reply.get("connect")
            accept = tuple(bytes.fromhex(k) for k in reply["accept"])
            keys = RankKeys(b"" if connect is None else bytes.fromhex(connect), accept,
                            int(reply["epoch"]))
        except (KeyError, TypeError, ValueError):
            keys = RankKeys(b"", (), None)
        if not keys.accept or any(len(k) != KEY_BYTES for k in (*keys.accept, keys.connect)
                                  if k):
            raise AgentError(f"the agent's keys for job {self.job}, rank {peer}, are "
                             "malformed")
        return keys

    def publish(self, host: str, port: int, epoch: int, done: bool = False) -> None:
        self._call({"op": "peer_publish", "job": self.job, "rank": self.rank,
                    "epoch": epoch, "host": host, "port": port, "done": done})

    def lookup(self, rank: int) -> tuple[str, int, int, bool] | None:
        reply, _ = self._call({"op": "peer_lookup", "job": self.job, "rank": rank})
        if reply.get("host") is None:
            return None
        return (str(reply["host"]), int(reply["port"]), int(reply["epoch"]),
                bool(reply.get("done")))

    def log_append(self, parts: list[bytes | memoryview]) -> None:
        if not parts:
            return
        from raps_slurm.checkpoint.pack import sealed_parts
        fd = sealed_parts(parts, "raps-log")
        try:
            self._call({"op": "log_append", "job": self.job, "rank": self.rank,
                        "epoch": self.epoch}, [fd])
        finally:
            os.close(fd)

    def log_read(self) -> bytes:
        reply, fds = self._call({"op": "log_read", "job": self.job, "rank": self.rank})
        try:
            return os.pread(fds[0], int(reply["size"]), 0) if fds else b""
        finally:
            for fd in fds:
                os.close(fd)

    def log_trim(self, floors: dict[int, int]) -> None:
        self._call({"op": "log_trim", "job": self.job, "rank": self.rank,
                    "floors": {str(k): v for k, v in floors.items()}})

    def save(self, items: dict[str, Any], extra: dict[str, Any]) -> int:
        return self.ckpt.save(items, extra).generation

    def restore(self) -> tuple[dict[str, Any], int, dict[str, Any]] | None:
        loaded = self.ckpt.restore()
        if loaded is None or not isinstance(loaded.generation, int):
            return None if loaded is None else (
                _items(loaded.state), 0, self.ckpt.last.extra if self.ckpt.last else {})
        assert self.ckpt.last is not None
        return _items(loaded.state), loaded.generation, self.ckpt.last.extra

    def heartbeat(self, step: int, items: int) -> None:
        self.agent.progress(step, items)

    def blocked(self, peer: int | None) -> None:
        self.agent.blocked(peer)

    def report(self, stats: dict[str, Any]) -> None:
        self._call({"op": "msg_stats", "job": self.job, "rank": self.rank,
                    "stats": json.loads(json.dumps(stats, default=str))})

    def recovery_event(self, phase: str, detail: dict[str, Any]) -> None:
        """Tell the recovery that gave this rank its epoch how far it got."""
        with contextlib.suppress(AgentError):
            self._call({"op": "recovery_event", "job": self.job, "rank": self.rank,
                        "epoch": self.epoch, "phase": phase, "detail": detail})

    def escalate(self, reason: str, requeue: bool = True) -> None:
        with contextlib.suppress(AgentError):
            self._call({"op": "escalate", "job": self.job, "rank": self.rank,
                        "reason": reason[:500], "requeue": requeue})

    def close(self) -> None:
        self.ckpt.close()
        self._msg.close()
        with self._keys_lock:
            if self._keys is not None:
                self._keys.close()
        self.agent.close()


def _ignore(_: object) -> None:
    return None


def _items(state: object) -> dict[str, Any]:
    return state if isinstance(state, dict) else {"": state}
