"""raps_slurm.wire.gate: which connection goes when slots run out, per source, and when."""

from __future__ import annotations

import socket
from collections import Counter

import pytest

from raps_slurm.wire.gate import Gate


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair()


def _shut(sock: socket.socket) -> bool:
    """Whether ``sock``'s side was shut down (its peer reads end of file)."""
    return sock.recv(1) == b""


@pytest.fixture
def pairs() -> list[tuple[socket.socket, socket.socket]]:
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made  # type: ignore[misc]
    for a, b in made:
        a.close()
        b.close()


def test_the_heaviest_source_loses_its_oldest_and_others_keep_theirs(
        pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    counts: Counter[str] = Counter()
    gate = Gate(4, lambda kind: counts.update([kind]))
    for src in ("peer", "flood", "flood", "flood"):
        pairs.append(_pair())
        assert gate.admit(pairs[-1][0], src)
    pairs.append(_pair())
    assert _admit_evicting(gate, pairs[-1][0], "other")
    assert counts == {"evicted": 1}
    assert _shut(pairs[1][1])  # the flood's oldest, not the older peer's
    pairs[0][1].setblocking(False)
    with pytest.raises(BlockingIOError):
        pairs[0][1].recv(1)
    assert gate.in_use() == 4 and gate.waiting() == 4


def _admit_evicting(gate: Gate, sock: socket.socket, source: str) -> bool:
    """admit(), with the evicted connection's slot given back as its thread would."""
    import threading

    def free() -> None:
        for _ in range(200):
            with gate._lock:
                gone = list(gate._evicted)
            for s in gone:
                gate.leave(s)
            if gone:
                return
            threading.Event().wait(0.005)

    t = threading.Thread(target=free)
    t.start()
    try:
        return gate.admit(sock, source)
    finally:
        t.join()


def test_a_source_holds_at_most_per_source_waiting_slots(
        pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    counts: Counter[str] = Counter()
    gate = Gate(8, lambda kind: counts.update([kind]), per_source=2)
    for _ in range(2):
        pairs.append(_pair())
        assert gate.admit(pairs[-1][0], "a")
    pairs.append(_pair())
    assert _admit_evicting(gate, pairs[-1][0], "a")
    assert counts == {"source": 1}
    assert _shut(pairs[0][1]) and gate.waiting() == 2
    pairs.append(_pair())
    assert gate.admit(pairs[-1][0], "b")  # another source is not limited by a's
    gate.settled(pairs[1][0])  # past its first request: no longer counts, never evicted
    pairs.append(_pair())
    assert gate.admit(pairs[-1][0], "a")
    assert counts == {"source": 1}


def test_a_connection_past_the_deadline_goes_at_the_next_admission(
        pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    counts: Counter[str] = Counter()
    now = [0.0]
    gate = Gate(8, lambda kind: counts.update([kind]), deadline=5.0, clock=lambda: now[0])
    pairs.append(_pair())
    assert gate.admit(pairs[-1][0], "a")
    now[0] = 3.0
    pairs.append(_pair())
    assert gate.admit(pairs[-1][0], "a")
    now[0] = 5.5
    pairs.append(_pair())
    assert gate.admit(pairs[-1][0], "b")
    assert counts == {"timeout": 1}
    assert _shut(pairs[0][1]) and gate.evicted(pairs[0][0])
    assert not gate.evicted(pairs[1][0])


def test_busy_when_every_slot_holds_an_authenticated_peer(
        pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    counts: Counter[str] = Counter()
    gate = Gate(2, lambda kind: counts.update([kind]), per_source=1, deadline=1.0)
    for src in ("a", "b"):
        pairs.append(_pair())
        assert gate.admit(pairs[-1][0], src)
        gate.settled(pairs[-1][0])
    pairs.append(_pair())
    assert not gate.admit(pairs[-1][0], "c")
    assert counts == {"busy": 1}
    with pytest.raises(ValueError, match="at least 0"):
        Gate(2, print, per_source=-1)
