"""``rapsctl bench messaging``'s memory figures, from a real run of two ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from raps_slurm.runtime.lanes import ROW_BYTES

COUNT = 200_000  # some 9 MB of rows and bodies

# In an interpreter of its own: the ranks are forked from it, and a forked heap that
# already has free memory (a long test session's) would take the entries without growing.
MEASURE = """
import json, sys
from raps_slurm.bench.messaging import measure
from raps_slurm.runtime.context import Settings
print(json.dumps(measure(int(sys.argv[1]), 8, logging=sys.argv[2] == "1",
                         base=Settings(stats_interval=3600.0))))
"""


def _measure(logging: bool) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(COUNT), str(int(logging))],
                          capture_output=True, text=True, timeout=300, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_log_memory_per_message_is_what_the_watermark_counts() -> None:
    """A logged run holds every small message (no receiver checkpoint covers them) and
    counts against the high watermark what they take: a row each and the chunks their
    bodies are in. The sender's memory grows by about that (it grew by 24 times the
    counted bytes when only bodies counted and each message was an object). An unlogged
    run holds and counts nothing."""
    logged = _measure(True)
    assert logged["held"] == COUNT, logged
    assert logged["held_counted"] >= (8 + ROW_BYTES) * COUNT, logged
    assert logged["held_counted"] * 0.7 < logged["rss_grown"] < logged["held_counted"] * 1.5, \
        logged
    unlogged = _measure(False)
    assert unlogged["held"] == 0 and unlogged["held_counted"] == 0, unlogged
    assert unlogged["rss_grown"] < logged["rss_grown"] / 4, (logged, unlogged)
