"""One rank of ``rapsctl bench launch``, run as a script (``python launch_rank.py DIR SIZE``)
under ``raps-run`` and under plain ``srun`` alike.

Its first statement takes the wall-clock time: that is when the rank "runs" (its own
code executing). It writes that time to ``DIR/<rank>`` (``SLURM_PROCID``, which raps-run
sets too), then waits until all SIZE ranks wrote theirs, so that no rank's later work
slows the start of the others; under raps-run (``RAPS_JOB`` set) it then joins the job
through ``raps_slurm.runtime`` and finalizes, as a RAPS program does (without waiting
for its peers: it sent them nothing).
"""

import time

STARTED = time.time()

import os  # noqa: E402  (after the time stamp on purpose)
import sys  # noqa: E402

BARRIER_SEC = 300.0


def main() -> int:
    """Write the time stamp, wait for every rank's, join the RAPS job if there is one."""
    out, size = sys.argv[1], int(sys.argv[2])
    rank = os.environ["SLURM_PROCID"]
    tmp = os.path.join(out, f".{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{STARTED:.6f}\n")
    os.replace(tmp, os.path.join(out, rank))  # whole or absent: the bench reads it later
    deadline = time.monotonic() + BARRIER_SEC
    while sum(1 for n in os.listdir(out) if not n.startswith(".")) < size:
        if time.monotonic() > deadline:
            print(f"rank {rank}: not every rank started within {BARRIER_SEC:g}s",
                  file=sys.stderr)
            return 1
        time.sleep(0.2)
    if os.environ.get("RAPS_JOB"):
        from raps_slurm import runtime

        ctx = runtime.init()
        # No message was sent, so no peer can need a resend: waiting for every other
        # rank through the agents would only load this machine after the measurement.
        ctx.finalize(timeout=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
