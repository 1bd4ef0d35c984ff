"""``rapsctl bench messaging``'s memory figures, from a real run of two ranks."""

from __future__ import annotations

from raps_slurm.bench.messaging import measure
from raps_slurm.runtime.context import Settings

COUNT = 200_000  # some 40 MB of entries: more than a forked heap's free memory holds


def test_the_log_memory_per_message_is_measured_against_what_the_watermark_counts() -> None:
    """A logged run holds every small message (no receiver checkpoint covers them) and
    counts their bodies' bytes against the high watermark; the sender's memory grows by
    more than that (each entry's own objects), which the benchmark reports apart. An
    unlogged run holds and counts nothing."""
    base = Settings(stats_interval=3600.0)
    logged = measure(COUNT, 8, logging=True, base=base)
    assert logged["held"] == COUNT, logged
    assert logged["held_counted"] == 8 * COUNT, logged
    assert logged["rss_grown"] > 4 * logged["held_counted"], logged
    unlogged = measure(COUNT, 8, logging=False, base=base)
    assert unlogged["held"] == 0 and unlogged["held_counted"] == 0, unlogged
    assert unlogged["rss_grown"] < logged["rss_grown"] / 4, (logged, unlogged)
