"""A random communication pattern drawn from ``--seed``, in the manner of the messaging
tests' random programs, as a standalone program for ``raps-run`` or the local launcher.

Every rank draws the same program from the seed and the job's size: ``--rounds`` rounds;
in each, every rank sends to some peers (payload derived from its state, of a size drawn
per round, some above the large-message threshold), then receives from every peer that
sent to it, in rank order, folding each payload into its state; each rank checkpoints
after rounds of its own (uncoordinated). All sends of a round come before its receives,
so a program cannot deadlock. Rank 0 prints ``final`` and every rank's state digest: a run
with failures must print exactly the line of the failure-free run.

    python -m raps_slurm.runtime.local -n 4 -- python examples/random_program.py --seed 7
    raps-run -- python examples/random_program.py --seed 7 --step-sec 0.05
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time

import numpy as np

from raps_slurm import runtime

SIZES = (16, 200, 1000, 70000)  # the largest is above the default large-message threshold


def draw(seed: int, ranks: int, rounds: int,
         every: int) -> tuple[list[list[list[int]]], list[int], list[set[int]]]:
    """(round -> rank -> destinations, payload size per round, rank -> rounds after which it
    checkpoints); the same on every rank for the same arguments."""
    rng = random.Random(seed)
    sends = [[sorted(rng.sample([d for d in range(ranks) if d != r],
                                rng.randint(0, ranks - 1)))
              for r in range(ranks)] for _ in range(rounds)]
    sizes = [rng.choice(SIZES) for _ in range(rounds)]
    # about one checkpoint every `every` rounds per rank, at rounds of its own
    ckpts = [{n for n in range(1, rounds) if rng.random() < 1 / every} for _ in range(ranks)]
    return sends, sizes, ckpts


def payload(state: bytes, rnd: int, src: int, dst: int, size: int) -> bytes:
    """The message ``src`` sends ``dst`` in round ``rnd``: a function of its state."""
    seed = hashlib.sha256(state + rnd.to_bytes(4, "little") + bytes([src % 256, dst % 256]))
    return (seed.digest() * (size // 32 + 1))[:size]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1, help="draws the program")
    p.add_argument("--rounds", type=int, default=120)
    p.add_argument("--every", type=int, default=20,
                   help="each rank checkpoints after about one round in this many")
    p.add_argument("--step-sec", type=float, default=0.0,
                   help="sleep this long each round (stands for real work)")
    a = p.parse_args()
    ctx = runtime.init()
    sends, sizes, ckpts = draw(a.seed, ctx.size, a.rounds, a.every)
    restored = ctx.restore()
    if restored is None:
        state, start = hashlib.sha256(b"start").digest(), 0
    else:
        state, start = bytes(restored["h"]), int(restored["round"][0])
        print(f"rank {ctx.rank} epoch {ctx.epoch} resumed at step {start}", file=sys.stderr,
              flush=True)
    for rnd in range(start, a.rounds):
        for dst in sends[rnd][ctx.rank]:
            ctx.send(dst, payload(state, rnd, ctx.rank, dst, sizes[rnd]))
        for src in range(ctx.size):
            if ctx.rank in sends[rnd][src]:
                state = hashlib.sha256(state + ctx.recv(src)).digest()
        if a.step_sec:
            time.sleep(a.step_sec)
        ctx.heartbeat(step=rnd + 1)
        if rnd + 1 in ckpts[ctx.rank]:
            ctx.checkpoint({"h": np.frombuffer(state, dtype=np.uint8).copy(),
                            "round": np.array([rnd + 1], dtype=np.int64)})
    if ctx.rank:
        ctx.send(0, state.hex()[:16].encode())
    else:  # every rank's digest, gathered in rank order
        print("final", state.hex()[:16], *(ctx.recv(r).decode() for r in range(1, ctx.size)),
              flush=True)
    ctx.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
