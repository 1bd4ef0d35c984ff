"""The compute-bound program of ``rapsctl bench recovery --program compute`` (and its
sleeping twin, ``--program sleep``): a 2-D Jacobi solver split into bands over ranks in a
ring, on the Python runtime.

Each step a rank sends its first row to its left neighbour and its last row to its right
one, receives theirs as ghost rows and runs ``--sweeps`` Jacobi sweeps over its band of
``--rows`` x ``--cols`` float64 (real arithmetic, no sleep). With ``--sleep-sec S`` it
sleeps S seconds instead of sweeping: the same messages and checkpoints, no arithmetic,
like heat_ring's steps. It checkpoints its band whenever ``checkpoint_due()`` says so.

Every step each rank prints ``progress RANK EPOCH STEP WALL CPU`` (the wall clock and the
process's CPU seconds after the step) and after a restore ``resumed RANK EPOCH STEP WALL
CPU``: from these the benchmark takes the failure-free step time and the time a relaunched
rank takes to redo its lost steps. ``--ballast-mb`` adds random, unchanging state to the
last ``--ballast-ranks`` ranks, as heat_ring's does (what ``--state`` restores). At the
end each rank prints ``final RANK DIGEST`` of its band.

    python -m raps_slurm.runtime.local -n 4 -- python -m raps_slurm.bench.jacobi_prog --steps 50
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import numpy as np

from raps_slurm import runtime


def sweep(u: np.ndarray, sweeps: int) -> np.ndarray:
    """``sweeps`` Jacobi sweeps of the interior of ``u`` (ghost rows first and last, the
    side columns fixed); a new array."""
    for _ in range(sweeps):
        nxt = u.copy()
        nxt[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
        u = nxt
    return u


def initial(rank: int, rows: int, cols: int) -> np.ndarray:
    """A rank's band with one ghost row above and below: a smooth field, different per rank."""
    y = (np.arange(rows + 2, dtype=np.float64)[:, None] + rank * rows) / 997.0
    x = np.arange(cols, dtype=np.float64)[None, :] / cols
    return (4.0 * x * (1.0 - x) + 0.5 * np.cos(3.0 * y)) * np.ones((rows + 2, cols))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rows", type=int, default=256, help="rows of a rank's band")
    p.add_argument("--cols", type=int, default=512, help="columns of the plate")
    p.add_argument("--sweeps", type=int, default=8, help="Jacobi sweeps per step")
    p.add_argument("--sleep-sec", type=float, default=0.0,
                   help="sleep this long per step instead of sweeping (0: sweep)")
    p.add_argument("--ballast-mb", type=int, default=0,
                   help="extra random state of this many MiB in the last ranks' checkpoints")
    p.add_argument("--ballast-ranks", type=int, default=1)
    a = p.parse_args()
    ctx = runtime.init()
    left, right = (ctx.rank - 1) % ctx.size, (ctx.rank + 1) % ctx.size
    state = ctx.restore()
    if state is None:
        state = {"u": initial(ctx.rank, a.rows, a.cols), "step": np.array([0], dtype=np.int64)}
        if a.ballast_mb and ctx.rank >= ctx.size - a.ballast_ranks:
            rng = np.random.default_rng(ctx.rank)
            state["ballast"] = np.frombuffer(rng.bytes(a.ballast_mb << 20), dtype=np.uint8)
    u, step = np.array(state["u"]), int(state["step"][0])
    if step:
        print(f"resumed {ctx.rank} {ctx.epoch} {step} {time.time():.4f} "
              f"{time.process_time():.4f}", flush=True)
    while step < a.steps:
        if ctx.size > 1:
            ctx.send(left, u[1].tobytes())
            ctx.send(right, u[-2].tobytes())
            u[-1] = np.frombuffer(ctx.recv(right), dtype=np.float64)
            u[0] = np.frombuffer(ctx.recv(left), dtype=np.float64)
        if a.sleep_sec:
            time.sleep(a.sleep_sec)
        else:
            u = sweep(u, a.sweeps)
        step += 1
        print(f"progress {ctx.rank} {ctx.epoch} {step} {time.time():.4f} "
              f"{time.process_time():.4f}", flush=True)
        ctx.heartbeat(step=step)
        if ctx.checkpoint_due():
            state = {**state, "u": u, "step": np.array([step], dtype=np.int64)}
            ctx.checkpoint(state)
    # each rank's own result: a relaunched rank must end with the same bits
    print(f"final {ctx.rank} {hashlib.sha256(u.tobytes()).hexdigest()[:16]}", flush=True)
    ctx.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
