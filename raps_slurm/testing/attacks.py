"""What an unprivileged user throws at her own node's agent, for the attack tests
(``python -m raps_slurm.testing.attacks`` run as that user; one JSON line out).

``agent SOCKET JOB DECLARED_MB FLOOD [--go FILE]``: once FILE exists (the test's
signal), registers rank 0 of JOB (a job the caller owns, on the agent of SOCKET) and
reports progress for it every half second (a rank that does not is held hung), saves a
state of DECLARED_MB MiB of zeros (a few KiB on disk), restores it once (the reply's
size and the blocks its memory file holds), then opens FLOOD connections and sends on
all of them at once a ``ckpt_restore`` each, and a quarter as many ``log_read``: what
came back, by op and by result kind.
"""

from __future__ import annotations

import argparse
import json
import os
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
    args = p.parse_args(argv)
    while args.go is not None and not args.go.exists():
        time.sleep(0.05)
    print(json.dumps(agent_flood(args.socket, args.job, args.declared_mb * MIB, args.flood)),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
