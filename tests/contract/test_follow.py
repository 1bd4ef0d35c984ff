"""PrefixFollower on both stores: one read, then changes from a watch, a re-read after a
lost watch, and waiting for a revision this process just wrote."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from raps_slurm.errors import StoreUnavailable
from raps_slurm.store import MemoryStore
from raps_slurm.store.follow import PrefixFollower

if TYPE_CHECKING:
    from conftest import Backend


def _events(follow: PrefixFollower, until: int = 0) -> list[tuple[str, str, bytes]]:
    changes = follow.poll(until, timeout=5.0 if until else 0.0)
    assert changes is not None and not changes.reset
    return [(e.kind, e.key, e.value) for e in changes.events]


def test_read_then_watch_then_read_again(backend: Backend) -> None:
    s, prefix = backend.store, backend.key("f", "")
    a, b = backend.key("f", "a"), backend.key("f", "b")
    created = s.put(a, b"1")
    s.put(backend.key("elsewhere"), b"not followed")
    follow = PrefixFollower(s, prefix, retry_every=0.0)
    try:
        first = follow.poll()
        assert first is not None and first.reset
        assert [(e.kind, e.key, e.value, e.create_revision) for e in first.events] == [
            ("put", a, b"1", created)]
        # Changes come from the watch; wait for each write as a caller that made it would.
        r2 = s.put(b, b"2")
        assert _events(follow, r2) == [("put", b, b"2")]
        assert s.delete(a)
        assert _events(follow, s.current_revision()) == [("delete", a, b"")]
        assert follow.revision == s.current_revision()
        # Nothing new: an empty answer at once, not a full read.
        started = time.monotonic()
        assert _events(follow) == []
        assert time.monotonic() - started < 1.0
        # A lost watch: the next poll reads everything again.
        follow.cancel()
        again = follow.poll()
        assert again is not None and again.reset
        assert [(e.key, e.value) for e in again.events] == [(b, b"2")]
    finally:
        follow.cancel()


def test_waiting_for_a_revision_gives_up_after_the_timeout(backend: Backend) -> None:
    s = backend.store
    follow = PrefixFollower(s, backend.key("g", ""), retry_every=0.0)
    try:
        assert follow.poll() is not None
        far = s.current_revision() + 1000  # never written under this prefix
        started = time.monotonic()
        changes = follow.poll(far, timeout=0.3)
        assert changes is not None and changes.events == []
        assert 0.25 <= time.monotonic() - started < 3.0
    finally:
        follow.cancel()


def test_a_store_that_cannot_be_read_is_retried_at_its_pace() -> None:
    reads = []

    class Down(MemoryStore):
        def current_revision(self) -> int:
            reads.append(1)
            raise StoreUnavailable("no etcd endpoint answered")

    now = [0.0]
    follow = PrefixFollower(Down(), "/n/", retry_every=5.0, monotonic=lambda: now[0])
    assert follow.poll() is None and len(reads) == 1
    now[0] = 1.0
    assert follow.poll() is None and len(reads) == 1  # not tried again yet
    now[0] = 6.0
    assert follow.poll() is None and len(reads) == 2
