"""A test rank that saves and restores through its node's agent (``python -m``).

``save``: registers, saves a seeded float64 field ``--saves`` times (changing a slice
between saves), prints one JSON line per save. ``restore``: registers, restores,
compares with the field the same seed and save count give, prints one JSON line.
Used by the integration tests and the checkpoint demo; exits 75 when fenced.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from raps_slurm.runtime.agent_client import EXIT_FENCED, AgentClient, AgentError
from raps_slurm.runtime.checkpoint import CheckpointClient


def make_state(seed: int, saves: int, size: int) -> dict[str, np.ndarray]:
    """The state after ``saves`` saves: each save before it changed one slice."""
    n = size // 8
    rng = np.random.default_rng(seed)
    field = np.sin(np.linspace(0, 40, n)) * 100 + rng.standard_normal(n) * 1e-3
    for i in range(1, saves):
        lo = (i * 7919 * 64) % max(1, n - 4096)
        field[lo:lo + 4096] += i
    return {"field": field, "step": np.array([saves], dtype=np.int64)}


def main(argv: list[str] | None = None) -> int:
    """Run the test rank."""
    p = argparse.ArgumentParser(prog="ckpt_rank")
    p.add_argument("mode", choices=("save", "restore"))
    p.add_argument("--socket", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--epoch", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--saves", type=int, default=2)
    p.add_argument("--size", type=int, default=8 << 20)
    a = p.parse_args(argv)
    agent = AgentClient(a.socket, a.job, a.rank, a.epoch, interval=1.0)
    ckpt = CheckpointClient(a.socket, a.job, a.rank, a.epoch)
    try:
        agent.register()
        if a.mode == "save":
            for i in range(1, a.saves + 1):
                saved = ckpt.save(make_state(a.seed, i, a.size))
                print(json.dumps({"generation": saved.generation, "state": saved.state,
                                  "new_chunks": saved.stats.new_chunks,
                                  "chunks": saved.stats.chunks,
                                  "new_stored_bytes": saved.stats.new_stored_bytes}),
                      flush=True)
        else:
            loaded = ckpt.restore()
            if loaded is None:
                print(json.dumps({"generation": None}), flush=True)
            else:
                state = loaded.state
                assert isinstance(state, dict)
                saves = int(state["step"][0])
                want = make_state(a.seed, saves, a.size)
                same = all(np.array_equal(state[k], v) for k, v in want.items())
                print(json.dumps({"generation": loaded.generation, "saves": saves,
                                  "identical": same, "fallbacks": loaded.fallbacks}),
                      flush=True)
    except AgentError as exc:
        print(json.dumps({"error": str(exc), "kind": exc.kind}), flush=True)
        return EXIT_FENCED if exc.kind == "epoch" else 1
    finally:
        ckpt.close()
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
