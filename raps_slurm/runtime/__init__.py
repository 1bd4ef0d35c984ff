"""What an application rank imports::

    from raps_slurm import runtime
    ctx = runtime.init()              # RAPS_* from the environment (raps-run / the SPANK shim)
    state = ctx.restore() or initial_state()
    ctx.send(dst, payload); payload = ctx.recv(src)
    ctx.heartbeat(step=i)
    if ctx.checkpoint_due(): ctx.checkpoint(state)
    ctx.finalize()

``runtime.init(local=N)`` runs the same program as N ranks on this machine without
Slurm or an agent: the calling process becomes rank 0 and forks ranks 1..N-1 (call it
first thing, before starting threads); peers, logs and checkpoints go to a directory
(``RAPS_LOCAL_DIR``, else a new temp dir). Rank 0's ``finalize()`` waits for the others
and exits non-zero if one failed.

Semantics (docs/messaging.md): a rank must be piecewise deterministic; ``recv`` names
its source; ``send`` never waits for a peer; the state is bytes, a numpy array or a dict
of them. Lower layers: :mod:`.agent_client` (heartbeats, fencing),
:mod:`.checkpoint` (save/restore through the agent), :mod:`.context` (messaging).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raps_slurm.runtime.context import Context, Settings

__all__ = ["Context", "MessagingError", "NotDeterministic", "Settings", "init"]


def __getattr__(name: str) -> Any:
    # Lazy: the agent imports raps_slurm.runtime.msglog (log segments) without pulling in
    # the whole runtime, and the runtime imports the checkpoint package.
    if name in ("Context", "Settings"):
        from raps_slurm.runtime import context
        return getattr(context, name)
    if name in ("MessagingError", "NotDeterministic"):
        from raps_slurm.runtime import msglog
        return getattr(msglog, name)
    raise AttributeError(f"module 'raps_slurm.runtime' has no attribute {name!r}")


def settings_from(env: Mapping[str, str]) -> Settings:
    """Runtime settings: the config file, then the job's ``RAPS_CKPT_INTERVAL``
    (``--raps-ckpt-interval``); no spinning when ``RAPS_LOCAL_SIZE`` (the ranks on this
    node) exceeds the node's cores. A config the rank cannot read (it holds no secret,
    but a site may keep it from users) gives the built-in defaults, said on stderr; a
    malformed one raises ConfigError naming what is wrong: its settings were meant."""
    from raps_slurm import config as cfgmod
    from raps_slurm.runtime.context import Settings

    path = cfgmod.find_config_path(env.get("RAPS_CONFIG") or None)
    if path is not None and path.exists() and not os.access(path, os.R_OK):
        print(f"raps: {path}: not readable by this user: built-in defaults", file=sys.stderr)
        cfg = cfgmod.Config()
    else:
        cfg = cfgmod.load_config(str(path) if path is not None else None)
    m, c = cfg.messagelog, cfg.checkpoint
    interval = float(c.interval_sec)
    text = env.get("RAPS_CKPT_INTERVAL", "")
    if text.isdigit() and int(text) > 0:
        interval = float(text)
    host = m.listen_address or env.get("RAPS_LISTEN_ADDRESS", "") or _node_address()
    spin = m.spin_us
    local = env.get("RAPS_LOCAL_SIZE", "")
    if local.isdigit() and int(local) > (os.cpu_count() or 1):
        spin = 0  # more ranks than cores here: a spinning rank takes the sender's CPU
    return Settings(flush_ms=m.batch_flush_ms, large_threshold=c.large_message_threshold_kb * 1024,
                    buffer_bytes=m.buffer_size_mb << 20,
                    high_watermark=m.buffer_high_watermark_mb << 20,
                    checkpoint_interval=interval, max_generations=c.max_generations,
                    recv_timeout=m.recv_timeout_sec, host=host,
                    stats_interval=m.stats_interval_sec, spin_us=spin,
                    frame_mac=m.frame_mac, same_node=m.same_node)


def _node_address() -> str:
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _need(env: Mapping[str, str], name: str, low: int = 0) -> int:
    text = env.get(name, "")
    if not (text.isascii() and text.isdigit()) or int(text) < low:
        raise ValueError(f"{name}={text!r}: expected an integer >= {low}")
    return int(text)


def init(local: int | None = None, env: Mapping[str, str] | None = None) -> Context:
    """The rank's context (see the module docstring); ValueError naming a bad variable."""
    from raps_slurm.runtime.context import Context

    env = dict(os.environ if env is None else env)
    if local is not None or env.get("RAPS_LOCAL_DIR"):
        return _init_local(local, env)
    from raps_slurm.runtime.ports import AgentPort

    path = env.get("RAPS_AGENT_SOCKET", "")
    if not path:
        raise ValueError("RAPS_AGENT_SOCKET is not set (run under raps-run or a --raps job, "
                         "or use runtime.init(local=N))")
    if "%n" in path:
        if not env.get("SLURMD_NODENAME"):
            raise ValueError("SLURMD_NODENAME is not set (needed for %n in RAPS_AGENT_SOCKET)")
        path = path.replace("%n", env["SLURMD_NODENAME"])
    job = env.get("RAPS_JOB") or env.get("SLURM_JOB_ID", "")
    if not (job.isascii() and job.isdigit()):
        raise ValueError(f"RAPS_JOB={job!r}: expected a Slurm job id")
    rank, size = _need(env, "RAPS_RANK"), _need(env, "RAPS_SIZE", 1)
    epoch = _need(env, "RAPS_EPOCH", 1) if env.get("RAPS_EPOCH") else 1
    if rank >= size:
        raise ValueError(f"RAPS_RANK={rank} is not below RAPS_SIZE={size}")
    s = settings_from(env)
    hb = float(env.get("RAPS_APP_HEARTBEAT_SEC") or 10.0)
    port = AgentPort(path, job, rank, epoch, heartbeat_sec=hb)
    ctx = Context(port, rank, size, epoch, s, job=job)
    if threading.current_thread() is threading.main_thread():
        # raps-run passes SIGUSR1 on (sbatch --signal=B:USR1@T): save, exit, be requeued
        signal.signal(signal.SIGUSR1, ctx.preempt)
    return ctx


_children: list[int] = []


def _init_local(local: int | None, env: dict[str, str]) -> Context:
    from raps_slurm.runtime.context import Context, Settings
    from raps_slurm.runtime.ports import LocalPort

    root = env.get("RAPS_LOCAL_DIR", "")
    if env.get("RAPS_RANK"):  # a rank of a local run started by a launcher
        rank, size = _need(env, "RAPS_RANK"), _need(env, "RAPS_SIZE", 1)
    else:
        size = local if local is not None else _need(env, "RAPS_SIZE", 1)
        if size < 1:
            raise ValueError(f"local={size}: expected at least one rank")
        created = not root
        if created:
            root = tempfile.mkdtemp(prefix="raps-local-")
        rank = 0
        for r in range(1, size):
            pid = os.fork()
            if pid == 0:
                rank = r
                _children.clear()
                break
            _children.append(pid)
        if rank == 0 and created:
            # nothing can find a temporary run's data again: rank 0 removes it at exit,
            # after its children (atexit runs the later registration first), unless a
            # rank failed (_wait_children exits at once: the data stays to look at)
            atexit.register(shutil.rmtree, root, True)
        if rank == 0 and _children:
            atexit.register(_wait_children)
    epoch = int(env.get("RAPS_EPOCH") or 1)
    s = settings_from({**env, "RAPS_LISTEN_ADDRESS": "127.0.0.1"})
    # --unlogged (the local launcher): a benchmark's baseline, only in a local run
    s = Settings(**{**s.__dict__, "host": "127.0.0.1",
                    "logging": env.get("RAPS_LOCAL_UNLOGGED") != "1"})
    return Context(LocalPort(root, "0", rank, epoch), rank, size, epoch, s, job="0")


def _wait_children() -> None:
    failed = 0
    for pid in _children:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failed += 1
    _children.clear()
    if failed:
        print(f"raps: {failed} local rank(s) failed", file=sys.stderr)
        os._exit(1)
