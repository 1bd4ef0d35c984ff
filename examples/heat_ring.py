"""A 1-D heat equation split over ranks in a ring: each step exchanges halo cells with both
neighbours, checkpoints every ``--every`` steps, and prints a digest of the field at the
end (rank 0 gathers every rank's digest). Run it:

    python -m raps_slurm.runtime.local -n 4 -- python examples/heat_ring.py --steps 200
    python examples/heat_ring.py --local 4                       # runtime.init(local=4)
    raps-run -- python examples/heat_ring.py                      # in a --raps job

``--die-at STEP`` makes the last rank exit at that step in its first epoch (to watch a
relaunch restore it and its neighbours replay; with the local launcher use
``--restarts 1``). ``--spin-at STEP`` makes it spin in a Python loop instead, alive and
heartbeating from the runtime's thread but making no progress: a hang the detector finds
by the step alone.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import numpy as np

from raps_slurm import runtime


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--cells", type=int, default=4096, help="cells per rank")
    p.add_argument("--every", type=int, default=25, help="checkpoint every N steps")
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--spin-at", type=int, default=None)
    p.add_argument("--step-sec", type=float, default=0.0,
                   help="sleep this long each step (stands for real work: a run long enough "
                        "to crash a node in the middle of it)")
    p.add_argument("--local", type=int, default=None, help="run N ranks here (no launcher)")
    p.add_argument("--ballast-mb", type=int, default=0,
                   help="extra state of this many MiB (random, unchanged) in one rank's "
                        "checkpoints: what `rapsctl bench recovery --state` restores")
    p.add_argument("--ballast-rank", type=int, default=-1,
                   help="the rank that carries the ballast (default: the last)")
    p.add_argument("--ballast-ranks", type=int, default=1,
                   help="how many ranks carry it, ending at --ballast-rank (e.g. a node's)")
    a = p.parse_args()
    ctx = runtime.init(local=a.local)
    left, right = (ctx.rank - 1) % ctx.size, (ctx.rank + 1) % ctx.size
    state = ctx.restore()
    if state is None:
        x = np.linspace(0, 1, a.cells) + ctx.rank
        state = {"u": np.sin(np.pi * x) ** 2, "step": np.array([0], dtype=np.int64)}
        last = a.ballast_rank % ctx.size
        if a.ballast_mb and last - a.ballast_ranks < ctx.rank <= last:
            rng = np.random.default_rng(ctx.rank)
            state["ballast"] = np.frombuffer(rng.bytes(a.ballast_mb << 20), dtype=np.uint8)
    u, step = state["u"], int(state["step"][0])
    if step:
        print(f"rank {ctx.rank} epoch {ctx.epoch} resumed at step {step}", file=sys.stderr,
              flush=True)
    while step < a.steps:
        if a.die_at is not None and step == a.die_at and ctx.epoch == 1 \
                and ctx.rank == ctx.size - 1:
            os._exit(17)  # a crash: nothing flushed, nothing closed
        if a.spin_at is not None and step == a.spin_at and ctx.epoch == 1 \
                and ctx.rank == ctx.size - 1:
            while True:  # a livelock: the process lives, the step never changes
                pass
        if ctx.size > 1:
            ctx.send(left, u[:1].tobytes())
            ctx.send(right, u[-1:].tobytes())
            lo = np.frombuffer(ctx.recv(left), dtype=np.float64)
            hi = np.frombuffer(ctx.recv(right), dtype=np.float64)
        else:
            lo, hi = u[-1:], u[:1]
        padded = np.concatenate([lo, u, hi])
        u = u + 0.1 * (padded[:-2] - 2 * u + padded[2:])
        step += 1
        if a.step_sec:
            time.sleep(a.step_sec)
        ctx.heartbeat(step=step)
        if step % a.every == 0 or ctx.checkpoint_due():  # due: interval passed, or SIGUSR1
            state = {**state, "u": u, "step": np.array([step], dtype=np.int64)}
            ctx.checkpoint(state)
    digest = hashlib.sha256(u.tobytes()).hexdigest()[:16]
    if ctx.rank == 0:
        digests = [digest] + [ctx.recv(r).decode() for r in range(1, ctx.size)]
        print("final", " ".join(digests), flush=True)
    else:
        ctx.send(0, digest.encode())
    ctx.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
