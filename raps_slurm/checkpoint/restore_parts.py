"""What a restore returns, and the small pieces :mod:`raps_slurm.checkpoint.restore` is
made of: the peak charge, a call made once, the read-ahead of pulled batches."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from raps_slurm.checkpoint.local import Restored
from raps_slurm.errors import RapsError

Charge = Callable[[int], None]
"""Charges the caller (its uid) for bytes a restore is about to allocate, or raises."""


class Peak:
    """Charges only what a restore holds at its peak: a generation given up frees its
    memory before the next is tried, so ``need(n)`` (the bytes held now, in all) charges
    just what passes the most charged so far."""

    def __init__(self, charge: Charge) -> None:
        self._charge, self._charged = charge, 0

    def need(self, nbytes: int) -> None:
        if nbytes > self._charged:
            self._charge(nbytes - self._charged)
            self._charged = nbytes


class Once:
    """A call made at most once, by whichever caller comes first; a caller that comes
    while it runs waits for it to end."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn: Callable[[], object] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
            if fn is not None:
                fn()


class RestoreError(RapsError):
    """No generation of the rank could be restored (every fallback failed).
    ``unreached``: holders that were down or did not answer (their copies were not
    checked: the loss may be only for now); empty when every copy was checked."""

    def __init__(self, message: str, unreached: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.unreached = unreached


@dataclass
class Fallback:
    """One generation a restore gave up on, and why."""

    generation: int | str
    reason: str
    bad: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON shape."""
        return {"generation": self.generation, "reason": self.reason, "bad": self.bad}


@dataclass
class RestoreResult:
    """A verified restore: the data, the generation it came from, what was skipped."""

    restored: Restored
    generation: int | str
    fallbacks: list[Fallback]
    pulled_chunks: int
    pulled_bytes: int = 0  # as stored (compressed), what crossed the network
    sources: tuple[str, ...] = ()  # holders chunks were pulled from
    pull_s: float = 0.0  # pulling missing chunks (network, verification, storing)
    local_s: float = 0.0  # decoding and verifying the state into memory
    early: bool = False  # made before the rank asked (:mod:`raps_slurm.checkpoint.early`)


def prefetch(batches: Iterator[list[Any]], depth: int = 2) -> Iterator[list[Any]]:
    """The batches of ``batches``, read ahead by a thread (up to ``depth`` waiting)."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue(depth)
    stop = threading.Event()

    def put(item: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for b in batches:
                if not put(("batch", b)):
                    return  # the consumer gave up
            put(("end", None))
        except BaseException as exc:  # handed to the consumer, raised there
            put(("error", exc))

    t = threading.Thread(target=produce, name="raps-prefetch", daemon=True)
    t.start()
    try:
        while True:
            kind, item = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()
        t.join(timeout=60)
