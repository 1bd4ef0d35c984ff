"""A node supervisor: the one task per node of a raps-run step.

``python -m raps_slurm.launcher.supervisor`` (raps-run starts it with its own
interpreter as ``srun --ntasks-per-node=1 ...``) connects to raps-run's control address
(``RAPS_CONTROL``), proves it holds the run's secret (``RAPS_CONTROL_KEY``, removed from
the environment before any rank starts) and says hello with its node name
(``SLURMD_NODENAME``). Then it applies what raps-run decides and decides nothing itself:

``start {rank, epoch, argv, env, slot, slots, label}``  start the rank: the
    supervisor's environment plus ``env``, stdin from /dev/null, output where the
    supervisor's goes (srun's) in whole lines (launcher/output.py: the node's ranks share
    that one stream), each starting with ``RANK: `` if ``label`` is true (right-aligned
    to the width of ``RAPS_SIZE - 1`` in ``env``, as srun's labels), pinned to slot
    ``slot`` of ``slots``'s share of the CPUs this task got
    (``os.sched_setaffinity`` in the child before exec); reports
    ``started {rank, epoch, pid}`` or, if it cannot be started, ``exited`` with 127;
``signal {rank, epoch, signum}``  signal that incarnation if it still runs;
``kill {rank, epoch}``  SIGKILL it (its ``exited`` report follows);
``exit``  kill what still runs and end the task.

Each rank that ends is reported ``exited {rank, epoch, code}`` (``code`` as
``subprocess`` gives it: negative for a signal), with ``agent: false`` when it failed
and its node's agent takes no connection at the rank's ``RAPS_AGENT_SOCKET``: the rank
could not reach it, a failure of the node rather than of the program. SIGUSR1, SIGTERM
and SIGINT that srun or Slurm deliver to the supervisor are passed on to every running
rank. When the control connection is lost (raps-run gone, its node gone, a bad frame)
the supervisor kills its ranks and exits 1: ranks raps-run no longer watches must not
run on. Connecting, it retries a refused, dropped or timed-out attempt with backoff
(:data:`RETRY_FIRST_SEC` doubling up to :data:`RETRY_MAX_SEC`, jittered) for
:data:`CONNECT_SEC`: strangers holding raps-run's listener are evicted for it, and it
must be there to take its slot. A peer that fails to prove the run's secret is not
raps-run: that ends the attempts at once.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from raps_slurm.config import node_dir
from raps_slurm.core.launch import FENCED_EXIT, LOST_EXIT, PREEMPTED_EXIT, cpu_share
from raps_slurm.launcher.channel import ENV_ADDRESS, ENV_KEY, Channel, connect
from raps_slurm.launcher.output import Lines, label
from raps_slurm.launcher.output import say as output_say
from raps_slurm.wire.framing import FrameError

FORWARDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
CANNOT_START = 127
AGENT_CONNECT_SEC = 2.0  # an agent's listener accepts at once, however busy the agent
# Exits the runtime chose (fenced, checkpointed for a move, no generation whole): their
# rank reached its agent.
_OWN_EXITS = (0, FENCED_EXIT, PREEMPTED_EXIT, LOST_EXIT)
WAKE_SEC = 1.0  # a rank's exit also wakes the loop at once (SIGCHLD)
DRAIN_SEC = 5.0  # at the end, how long the ranks' last output may take to come
CONNECT_SEC = 50.0  # tries to reach raps-run this long (it gives up on a node after 60 s)
RETRY_FIRST_SEC = 0.1
RETRY_MAX_SEC = 2.0


def say(text: str, output: Lines | None = None) -> None:
    """One line on stderr (the job's error file), prefixed like raps-run's, in one write;
    through ``output``, the ranks' forwarder, once there is one (their lines go there
    too)."""
    output_say(f"raps-supervisor: {text}\n", output)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def agent_answers(path: str, timeout: float = AGENT_CONNECT_SEC) -> bool:
    """Whether an agent takes connections on the unix socket ``path`` (a connection opened
    and closed at once: nothing is asked of it)."""
    if not path:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


class Supervisor:
    """One node's ranks: started, watched, signalled and reported over ``chan``."""

    def __init__(self, chan: Channel, cpus: set[int],
                 environ: Mapping[str, str] | None = None) -> None:
        self.chan = chan
        self.output = Lines()
        self.cpus = sorted(cpus)
        self.environ = dict(os.environ if environ is None else environ)
        for name in (ENV_ADDRESS, ENV_KEY):
            self.environ.pop(name, None)  # the ranks never see the channel's secret
        self.ranks: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
        self.sockets: dict[tuple[int, int], str] = {}  # each rank's agent socket
        self.done = False

    # -- commands -----------------------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> None:
        """Apply one command; a malformed one is said and ignored."""
        op = msg.get("op")
        if op == "exit":
            self.done = True
            return
        rank, epoch = msg.get("rank"), msg.get("epoch")
        if not (_is_int(rank) and _is_int(epoch)):
            say(f"ignored a {op!r} command without an integer rank and epoch", self.output)
            return
        assert isinstance(rank, int) and isinstance(epoch, int)
        if op == "start":
            self.start(rank, epoch, msg)
        elif op in ("signal", "kill"):
            proc = self.ranks.get((rank, epoch))
            signum = signal.SIGKILL if op == "kill" else msg.get("signum")
            if proc is None or proc.returncode is not None or not _is_int(signum):
                return
            assert isinstance(signum, int)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)
        else:
            say(f"ignored an unknown command {op!r}", self.output)

    def start(self, rank: int, epoch: int, msg: dict[str, Any]) -> None:
        """Start one rank (see the module docstring)."""
        argv, env = msg.get("argv"), msg.get("env")
        slot, slots = msg.get("slot", 0), msg.get("slots", 1)
        if (not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv)
                or not isinstance(env, dict)
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
                or not (_is_int(slot) and _is_int(slots)) or not 0 <= slot < slots):
            say(f"rank {rank} epoch {epoch}: malformed start command", self.output)
            self.chan.send({"op": "exited", "rank": rank, "epoch": epoch,
                            "code": CANNOT_START})
            return
        assert isinstance(slot, int) and isinstance(slots, int)
        share = cpu_share(self.cpus, slot, slots) if self.cpus else []
        size = env.get("RAPS_SIZE", "")
        ranks = int(size) if size.isascii() and size.isdigit() and len(size) < 10 else 0
        tag = label(rank, max(ranks, rank + 1)) if msg.get("label") is True else b""
        try:
            proc = self.output.start(argv, tag, env={**self.environ, **env},
                                     stdin=subprocess.DEVNULL, preexec_fn=_pin(share))
        except OSError as exc:
            say(f"rank {rank} epoch {epoch}: cannot start {argv[0]!r}: {exc}", self.output)
            self.chan.send({"op": "exited", "rank": rank, "epoch": epoch,
                            "code": CANNOT_START})
            return
        self.ranks[(rank, epoch)] = proc
        where = env.get("RAPS_AGENT_SOCKET") or self.environ.get("RAPS_AGENT_SOCKET", "")
        self.sockets[(rank, epoch)] = node_dir(where, self.environ.get("SLURMD_NODENAME", ""))
        self.chan.send({"op": "started", "rank": rank, "epoch": epoch, "pid": proc.pid,
                        "cpus": share})

    # -- watching -----------------------------------------------------------------------

    def reap(self) -> None:
        """Report every rank that ended since the last look."""
        for (rank, epoch), proc in list(self.ranks.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.ranks[(rank, epoch)]
            path = self.sockets.pop((rank, epoch), "")
            msg: dict[str, Any] = {"op": "exited", "rank": rank, "epoch": epoch, "code": code}
            # Only a failure the runtime did not choose, and not a kill (raps-run's, or
            # the node's end), can be an agent out of reach.
            if code > 0 and code not in _OWN_EXITS and path and not agent_answers(path):
                msg["agent"] = False
                say(f"rank {rank} epoch {epoch} exited with {code} and the agent at {path} "
                    "takes no connection", self.output)
            self.chan.send(msg)

    def forward(self, signum: int) -> None:
        """Pass a signal srun delivered on to every running rank."""
        for proc in self.ranks.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def kill_all(self) -> None:
        """SIGKILL every rank still running and reap it."""
        for proc in self.ranks.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for proc in self.ranks.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def serve(self, wake_fd: int) -> int:
        """Follow commands until ``exit`` (0) or the connection is lost (1)."""
        try:
            while not self.done:
                sock = self.chan.sock.fileno()
                ready, _, _ = select.select([sock, wake_fd], [], [], WAKE_SEC)
                if wake_fd in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_fd, 512)
                if sock in ready:
                    self.handle(self.chan.recv(idle_timeout=1.0))
                self.reap()
        except FrameError as exc:
            say(f"control connection lost ({exc}): killing {len(self.ranks)} running ranks",
                self.output)
            self.kill_all()
            return 1
        self.kill_all()
        with contextlib.suppress(FrameError):
            self.reap()
        return 0


def connect_retrying(address: str, key: bytes, node: str, *, within: float = CONNECT_SEC,
                     clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep,
                     dial: Callable[[str, bytes, str], Channel] = connect) -> Channel:
    """The authenticated channel to raps-run, retrying with backoff for ``within``
    seconds; the last error if none succeeded (a FrameError of kind ``auth`` at once)."""
    deadline = clock() + within
    pause = RETRY_FIRST_SEC
    attempt = 0
    while True:
        attempt += 1
        try:
            return dial(address, key, node)
        except (OSError, FrameError) as exc:
            if isinstance(exc, FrameError) and exc.kind == "auth":
                raise
            left = deadline - clock()
            if left <= 0:
                raise
            if attempt == 1:
                say(f"raps-run at {address} refused or dropped the connection ({exc}): "
                    f"retrying for {within:g}s")
            sleep(min(left, pause * random.uniform(0.5, 1.0)))
            pause = min(RETRY_MAX_SEC, pause * 2)


def _pin(cpus: list[int]) -> Callable[[], None] | None:
    if not cpus:
        return None

    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    return pin


def main() -> None:
    """Entry point: connect, authenticate, say hello, serve."""
    address = os.environ.get(ENV_ADDRESS, "")
    key_hex = os.environ.pop(ENV_KEY, "")
    node = os.environ.get("SLURMD_NODENAME", "")
    try:
        key = bytes.fromhex(key_hex)
    except ValueError:
        key = b""
    if not address or len(key) < 16 or not node:
        say(f"{ENV_ADDRESS}, {ENV_KEY} (hex, at least 16 bytes) and SLURMD_NODENAME must be "
            "set: the supervisor runs in a step raps-run started")
        sys.exit(2)
    try:
        chan = connect_retrying(address, key, node)
    except (OSError, ValueError, FrameError) as exc:
        say(f"cannot reach raps-run at {address}: {exc}")
        sys.exit(1)
    cpus = os.sched_getaffinity(0)
    rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    sup = Supervisor(chan, cpus)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        sup.forward(signum)

    for sig in FORWARDED:
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes select via the fd
    try:
        chan.send({"op": "hello", "node": node, "pid": os.getpid(), "cpus": sorted(cpus)})
        code = sup.serve(rfd)
    except FrameError as exc:
        say(f"control connection lost ({exc})", sup.output)
        sup.kill_all()
        code = 1
    finally:
        chan.close()
        sup.output.close(DRAIN_SEC)  # the ranks' last lines, before srun sees the task end
    sys.exit(code)


if __name__ == "__main__":
    main()
