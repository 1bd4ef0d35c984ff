"""A fake clock for tests and the simulator: time moves only when told to."""

from __future__ import annotations


class FakeClock:
    """A monotonic clock (callable like ``time.monotonic``) that moves on ``advance``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        self.now += seconds
