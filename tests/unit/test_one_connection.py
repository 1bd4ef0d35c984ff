"""Two ranks talk over one TCP connection, both ways: the lower rank opens it when it
starts and the higher one answers over it (runtime/links.py, ``_outgoing``), so a
message's ACK rides on the answer instead of costing a packet of its own. The answers
carry the other direction's MAC label, so neither side's frames can be sent back as its
own; a higher rank whose lower peer does not connect opens its own connection after
``CONNECT_GRACE``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.runtime.context import Context, Settings
from raps_slurm.runtime.frames import COVERED, HELLO, Frame, encode
from raps_slurm.runtime.links import CONNECT_GRACE
from raps_slurm.runtime.ports import LocalPort
from raps_slurm.runtime.rankauth import Auth
from raps_slurm.runtime.transport import Listener, unix_name
from raps_slurm.wire import framing

PARAMS = CodecParams(avg_chunk_kb=4)
SETTINGS = Settings(flush_ms=20, large_threshold=256, high_watermark=1 << 20,
                    buffer_bytes=2 << 20, checkpoint_interval=1e9, recv_timeout=30.0)
KEY = b"K" * 32


def wait_for(cond: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def opened(contexts: list[Context]) -> int:
    """Connections open between the ranks' listeners, as the kernel lists them: over TCP
    the sockets whose remote end is a listener's port (the opening ends), over Unix
    sockets the ones bound to a listener's name, less the listening ones (the accepted
    ends)."""
    ports = {c.listener.address[1] for c in contexts}
    tcp = sum(1 for s in psutil.Process().net_connections("tcp")
              if s.status == psutil.CONN_ESTABLISHED and s.raddr and s.raddr.port in ports)
    names = {"@" + unix_name(c.listener.address)[1:] for c in contexts}
    unix = sum(1 for s in psutil.Process().net_connections("unix") if s.laddr in names)
    return tcp + max(0, unix - sum(1 for c in contexts if c.listener.usock is not None))


def run_ranks(n: int, body: Callable[[Context], None], root: Path, same_node: str
              ) -> tuple[list[dict], int]:  # type: ignore[type-arg]
    """``body`` on ranks 0..n-1 (threads of this process): each one's stats once every
    rank's body is done, and the connections open between them then."""
    settings = replace(SETTINGS, same_node=same_node)
    stats: list[dict] = [{}] * n  # type: ignore[type-arg]
    errors: list[BaseException] = []
    contexts: list[Context] = []
    done = threading.Barrier(n + 1, timeout=60)
    finish = threading.Event()

    def one(r: int) -> None:
        ctx = Context(LocalPort(root, "1", r, 1, PARAMS), r, n, 1, settings)
        contexts.append(ctx)
        try:
            body(ctx)
            stats[r] = ctx.stats()
        except BaseException as exc:  # reported below
            errors.append(exc)
        done.wait()
        finish.wait(60)
        ctx.finalize(timeout=20)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    done.wait()
    count = opened(contexts)
    finish.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return stats, count


@pytest.mark.parametrize("same_node", ["tcp", "unix"])
def test_each_pair_of_ranks_talks_over_one_connection(tmp_path: Path, same_node: str) -> None:
    n = 4

    def body(ctx: Context) -> None:
        for rnd in range(20):  # every rank to every other, both ways
            for p in range(n):
                if p != ctx.rank:
                    ctx.send(p, bytes([ctx.rank, rnd]))
            for p in range(n):
                if p != ctx.rank:
                    assert ctx.recv(p) == bytes([p, rnd])

    stats, count = run_ranks(n, body, tmp_path, same_node)
    for r in range(n):
        for p, peer in stats[r]["peers"].items():
            # the lower rank of a pair opened the connection; the higher one answers on it
            assert peer["sends_over"] == ("own" if r < p else "theirs"), (r, p, peer)
    assert count == n * (n - 1) // 2


def test_a_higher_rank_opens_its_own_connection_when_the_lower_one_stays_silent(
        tmp_path: Path) -> None:
    """Rank 0 does not communicate at all for longer than the grace: rank 1's message
    waits in its log, rank 1 connects itself, and rank 0, once it receives, answers over
    rank 1's connection."""
    quiet = CONNECT_GRACE * 6  # rank 1 connects after the grace, well before rank 0 starts
    got: list[tuple[bytes, float]] = []

    def body(ctx: Context) -> None:
        if ctx.rank == 1:
            t = time.monotonic()
            ctx.send(0, b"early")
            assert ctx.recv(0) == b"answer"
            got.append((b"", time.monotonic() - t))
        else:
            time.sleep(quiet)
            got.append((ctx.recv(1), 0.0))
            ctx.send(1, b"answer")

    stats, count = run_ranks(2, body, tmp_path, "tcp")
    assert got[0][0] == b"early"
    assert stats[1]["peers"][0]["sends_over"] == "own"
    assert stats[0]["peers"][1]["sends_over"] == "theirs"
    assert count == 1
    assert got[1][1] < quiet + 5


@pytest.fixture
def pair() -> tuple[Listener, Listener, list[tuple[Frame, int]], list[int]]:
    """Listeners of rank 0 (``a``) and rank 1 (``b``); what ``a`` received and the
    connections it saw end."""
    got: list[tuple[Frame, int]] = []
    ended: list[int] = []
    a = Listener("127.0.0.1", lambda f, cid: got.append((f, cid)), ended.append,
                 Auth(KEY, 0, max_message=1024, epoch=1))
    b = Listener("127.0.0.1", lambda f, cid: None, lambda cid: None,
                 Auth(KEY, 1, max_message=1024, epoch=1))
    yield a, b, got, ended  # type: ignore[misc]
    a.close()
    b.close()


def test_answers_come_back_on_the_connection_once_and_with_their_own_label(
        pair: tuple[Listener, Listener, list[tuple[Frame, int]], list[int]]) -> None:
    a, b, got, ended = pair
    out = a.connect(b.address, 1, 1)  # rank 0 -> rank 1
    taken = []
    wait_for(lambda: taken.append(b.reverse(0, 1)) or taken[-1] is not None,
             "rank 0's connection at rank 1")
    assert b.reverse(0, 1) is None  # handed out once
    a2 = a.connect(b.address, 1, 1)  # a second connection: rank 1 may answer over it
    wait_for(lambda: b._reverse.get(0) is not None, "the second connection")
    assert b.reverse(0, 2) is None  # an older incarnation's connection is not the peer's
    back = b.reverse(0, 1)
    assert back is not None and back.theirs and back.cid is not None
    back.send(encode(HELLO, 1, 0, 0, 1))
    back.send(encode(COVERED, 1, 0, 3, 1))
    wait_for(lambda: len(got) == 2, "two answers")
    assert [(f.kind, f.src, cid) for f, cid in got] == [(HELLO, 1, a2.cid), (COVERED, 1, a2.cid)]
    # a frame tagged as rank 0's own direction (label c), sent back: refused
    back.mac = framing.FrameMac(back.session, "blake3", b"c")
    back.mac.seq = 2
    back.send(encode(HELLO, 1, 0, 0, 1))
    wait_for(lambda: a.auth.refusals().get("mac") == 1, "the refusal")
    wait_for(lambda: a2.cid in ended, "the connection's end")
    assert len(got) == 2
    # closing a connection the pump reads ends it at both ends
    out.close()
    wait_for(lambda: out.cid in ended, "the first connection's end")
