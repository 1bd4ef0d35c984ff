"""What an unprivileged user throws at her own node's agent, for the attack tests
(``python -m raps_slurm.testing.attacks`` run as that user; one JSON line out).

``agent SOCKET JOB DECLARED_MB FLOOD [--go FILE]``: once FILE exists (the test's
signal), registers rank 0 of JOB (a job the caller owns, on the agent of SOCKET) and
reports progress for it every half second (a rank that does not is held hung), saves a
state of DECLARED_MB MiB of zeros (a few KiB on disk), restores it once (the reply's
size and the blocks its memory file holds), then opens FLOOD connections and sends on
all of them at once a ``ckpt_restore`` each, and a quarter as many ``log_read``: what
came back, by op and by result kind.

``hold UID HOLD SOURCES [--only FILE]``: until a line comes on stdin, keeps HOLD idle
connections open to every TCP port UID listens on (``/proc/net/tcp``; with ``--only``,
those of them FILE lists, once it exists), spread over the SOURCES addresses
(comma-separated), replacing each the listener closes; a new listener is taken at once.
Prints ``ready`` when it watches, then how many ports it held and connections it opened.

``fill DIR``: writes ``DIR/fill`` until the file system says it is full; the bytes written.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import select
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from raps_slurm.checkpoint.sparse import allocated_bytes
from raps_slurm.runtime.agent_client import AgentError
from raps_slurm.runtime.checkpoint import CheckpointClient

MIB = 1 << 20


def _outcome(client: CheckpointClient, message: dict[str, Any], start: threading.Barrier
             ) -> str:
    """``ok`` or the refusal's kind (``broken`` for a connection that failed)."""
    try:
        client.request({"op": "hello"})  # connected first: the requests come all at once
        start.wait(60)
        _, fds = client.request(message)
        for fd in fds:
            os.close(fd)
        return "ok"
    except AgentError as exc:
        return exc.kind or "broken"
    finally:
        client.close()


def _heartbeats(socket_path: str, job: str, done: threading.Event) -> None:
    """Rank 0's progress, a step every half second, until ``done``."""
    client = CheckpointClient(socket_path, job, 0, 1, timeout=60)
    step = 0
    while not done.wait(0.5):
        step += 1
        client.request({"op": "heartbeat", "job": job, "rank": 0, "step": step, "items": 0,
                        "blocked_on": None})
    client.close()


def agent_flood(socket_path: str, job: str, declared: int, flood: int) -> dict[str, Any]:
    """The ``agent`` attack (see the module's docstring); its findings."""
    own = CheckpointClient(socket_path, job, 0, 1, timeout=120)
    own.request({"op": "register", "job": job, "rank": 0, "epoch": 1, "pid": os.getpid()})
    done = threading.Event()
    beats = threading.Thread(target=_heartbeats, args=(socket_path, job, done), daemon=True)
    beats.start()
    # untouched pages: the zeros cost this process nothing either
    own.save({"z": np.zeros(declared, dtype=np.uint8), "tag": b"declared"})
    reply, fds = own.request({"op": "ckpt_restore", "job": job, "rank": 0})
    try:
        restored = {"size": reply["size"], "allocated": allocated_bytes(fds[0])}
    finally:
        for fd in fds:
            os.close(fd)
    asks = [{"op": "ckpt_restore", "job": job, "rank": 0}] * flood
    asks += [{"op": "log_read", "job": job, "rank": 0}] * max(1, flood // 4)
    start = threading.Barrier(len(asks))
    results: list[tuple[str, str]] = []
    lock = threading.Lock()

    def one(message: dict[str, Any]) -> None:
        got = _outcome(CheckpointClient(socket_path, job, 0, 1, timeout=600), message, start)
        with lock:
            results.append((str(message["op"]), got))

    threads = [threading.Thread(target=one, args=(m,)) for m in asks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    beats.join()
    own.request({"op": "unregister", "job": job, "rank": 0})
    own.close()
    by_op: dict[str, Counter[str]] = {}
    for op, got in results:
        by_op.setdefault(op, Counter())[got] += 1
    return {"restored": restored, "flood": {op: dict(c) for op, c in by_op.items()}}


def _listening() -> list[tuple[int, int, int]]:
    """(port, uid, socket inode) of every IPv4 TCP socket listening on this host."""
    out = []
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                out.append((int(fields[1].split(":")[1], 16), int(fields[7]), int(fields[9])))
    return out


def _listeners(uid: int, only: Path | None) -> set[int]:
    """The TCP ports ``uid`` listens on (IPv4); with ``only``, those it lists."""
    ports = {port for port, owner, _ in _listening() if owner == uid}
    if only is None:
        return ports
    try:
        return ports & {int(x) for x in only.read_text().split()}
    except FileNotFoundError:
        return set()


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (IPv4; the caller must see its fds)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return {port for port, _, inode in _listening() if inode in inodes}


def _connect(source: str, port: int) -> socket.socket | None:
    s = socket.socket()
    s.setblocking(False)
    s.bind((source, 0))
    try:
        s.connect(("127.0.0.1", port))
    except BlockingIOError:
        pass
    except OSError:
        s.close()
        return None
    return s


def hold(uid: int, count: int, sources: list[str], only: Path | None = None
         ) -> dict[str, int]:
    """The ``hold`` attack (see the module's docstring); ports held, connections opened
    and closed on it."""
    held: dict[int, list[socket.socket]] = {}
    opened = closed = 0
    refilled = 0.0
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:
        # a new listener is taken at once (before its peers find it); the others are
        # topped up every 20 ms, replacing what the listener closed
        now = time.monotonic()
        refill = now - refilled >= 0.02
        for port in _listeners(uid, only):
            socks = held.setdefault(port, [])
            if socks and not refill:
                continue
            ready, _, _ = select.select(socks, [], [], 0) if socks else ([], [], [])
            for s in ready:  # readable: end of file or a reset
                try:
                    data = s.recv(64)
                except OSError:
                    data = b""
                if not data:
                    socks.remove(s)
                    s.close()
                    closed += 1
            while len(socks) < count:
                new = _connect(sources[(opened + len(socks)) % len(sources)], port)
                if new is None:
                    break
                socks.append(new)
                opened += 1
        if refill:
            refilled = now
        time.sleep(0.002)
    return {"ports": len(held), "opened": opened, "closed": closed}


def fill(directory: Path) -> int:
    """The ``fill`` attack: bytes written into ``directory/fill`` before ENOSPC."""
    written = 0
    with open(directory / "fill", "wb", buffering=0) as f:
        for size in (MIB, 4096, 512):  # smaller writes take what a larger one left
            block = b"x" * size
            try:
                while True:
                    written += f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        try:
            os.fsync(f.fileno())
        except OSError as exc:  # delayed allocation: what did not fit is said here
            if exc.errno != errno.ENOSPC:
                raise
    return written


def main(argv: list[str] | None = None) -> int:
    """Run one attack; print its findings as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m raps_slurm.testing.attacks")
    sub = p.add_subparsers(dest="attack", required=True)
    a = sub.add_parser("agent", help="a huge zero state and a flood of restores and log reads")
    a.add_argument("socket")
    a.add_argument("job")
    a.add_argument("declared_mb", type=int)
    a.add_argument("flood", type=int)
    a.add_argument("--go", type=Path, help="start once this file exists")
    h = sub.add_parser("hold", help="hold connections to every port a uid listens on")
    h.add_argument("uid", type=int)
    h.add_argument("count", type=int)
    h.add_argument("sources")
    h.add_argument("--only", type=Path, help="hold only the ports this file lists")
    f = sub.add_parser("fill", help="fill a directory's file system")
    f.add_argument("directory", type=Path)
    args = p.parse_args(argv)
    out: object
    if args.attack == "agent":
        while args.go is not None and not args.go.exists():
            time.sleep(0.05)
        out = agent_flood(args.socket, args.job, args.declared_mb * MIB, args.flood)
    elif args.attack == "hold":
        out = hold(args.uid, args.count, args.sources.split(","), args.only)
    else:
        out = {"written": fill(args.directory)}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
