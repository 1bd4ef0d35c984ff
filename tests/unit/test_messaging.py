"""Message logging, replay and fencing on loopback TCP, ranks as threads, local ports.

A *program* is a list of rounds; in each round every rank sends to some peers (payload
derived from its state), then receives from every peer that sent to it, in rank order,
folding each payload into its state; some ranks checkpoint at the end of some rounds.
All sends of a round come before its receives, so a program cannot deadlock. A run with
failures must end in exactly the states of the failure-free run.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.core.launch import LOST_EXIT
from raps_slurm.runtime.agent_client import AgentError
from raps_slurm.runtime.context import Context, Settings
from raps_slurm.runtime.msglog import MessagingError, NotDeterministic
from raps_slurm.runtime.ports import LocalPort
from raps_slurm.testing.jobs import damage_chunks
from raps_slurm.wire import datapath

PARAMS = CodecParams(avg_chunk_kb=4)
SMALL = Settings(flush_ms=20, large_threshold=256, high_watermark=1 << 20,
                 buffer_bytes=2 << 20, checkpoint_interval=1e9, max_generations=2,
                 recv_timeout=20.0)


@dataclass
class Program:
    ranks: int
    sends: list[list[list[int]]]          # round -> rank -> destinations
    checkpoints: list[set[int]]           # rank -> rounds after which it checkpoints
    sizes: list[int] = field(default_factory=list)  # payload size per round
    parts: bool = False  # sent as a mutable buffer (copied into the log), not as bytes

    @property
    def rounds(self) -> int:
        return len(self.sends)


class Killed(Exception):
    pass


def payload(state: bytes, rnd: int, src: int, dst: int, size: int) -> bytes:
    seed = hashlib.sha256(state + bytes([rnd % 256, src, dst])).digest()
    return (seed * (size // 32 + 1))[:size]


def run_rank(prog: Program, rank: int, root: Path, *, epoch: int = 1,
             kill_at: int | None = None, tweak: Callable[[bytes], bytes] | None = None,
             ctx_hook: Callable[[Context], None] | None = None,
             settings: Settings = SMALL, lose_log: bool = False) -> bytes:
    """One incarnation after another until the program ends; the final state."""
    while True:
        ctx = Context(LocalPort(root, "1", rank, epoch, PARAMS, max_generations=2),
                      rank, prog.ranks, epoch, settings)
        if ctx_hook:
            ctx_hook(ctx)
        try:
            restored = ctx.restore()
            if restored is None:
                state, start = hashlib.sha256(b"start").digest(), 0
            else:
                state, start = bytes(restored["h"]), int(restored["round"][0])
            for rnd in range(start, prog.rounds):
                if kill_at is not None and rnd == kill_at and epoch == 1:
                    raise Killed
                size = prog.sizes[rnd] if prog.sizes else 64
                for dst in prog.sends[rnd][rank]:
                    data = payload(state, rnd, rank, dst, size)
                    if tweak is not None and epoch > 1:
                        data = tweak(data)
                    ctx.send(dst, bytearray(data) if prog.parts else data)
                for src in range(prog.ranks):
                    if rank in prog.sends[rnd][src]:
                        state = hashlib.sha256(state + ctx.recv(src)).digest()
                if rnd + 1 in prog.checkpoints[rank]:
                    ctx.checkpoint({"h": np.frombuffer(state, dtype=np.uint8).copy(),
                                    "round": np.array([rnd + 1], dtype=np.int64)})
            ctx.finalize()
            return state
        except Killed:
            ctx.close()  # as a crash: nothing flushed, connections cut
            epoch += 1
            if lose_log:  # its node and its log backup lost together
                logs = root / "logs" / "job-1" / "logs" / str(rank)
                assert logs.is_dir()
                shutil.rmtree(logs)


def run(prog: Program, root: Path, kills: dict[int, int] | None = None,
        **kw: object) -> list[bytes | BaseException]:
    out: list[bytes | BaseException] = [b""] * prog.ranks

    def one(r: int) -> None:
        try:
            out[r] = run_rank(prog, r, root, kill_at=(kills or {}).get(r), **kw)  # type: ignore[arg-type]
        except BaseException as exc:  # reported by the test
            out[r] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(prog.ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@st.composite
def programs(draw: st.DrawFn) -> tuple[Program, dict[int, int]]:
    n = draw(st.integers(3, 4))
    rounds = draw(st.integers(2, 6))
    sends = [[sorted(draw(st.sets(st.sampled_from([d for d in range(n) if d != r]),
                                  max_size=n - 1))) for r in range(n)] for _ in range(rounds)]
    ckpts = [draw(st.sets(st.integers(1, rounds - 1), max_size=rounds)) for _ in range(n)]
    sizes = [draw(st.sampled_from([16, 200, 1000])) for _ in range(rounds)]  # 1000 > large
    victim = draw(st.integers(0, n - 1))
    at = draw(st.integers(0, rounds - 1))
    return Program(n, sends, ckpts, sizes), {victim: at}


@given(programs())
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_random_programs_survive_a_killed_rank(tmp_path_factory: pytest.TempPathFactory,
                                               case: tuple[Program, dict[int, int]]) -> None:
    prog, kills = case
    clean = run(prog, tmp_path_factory.mktemp("clean"))
    faulty = run(prog, tmp_path_factory.mktemp("faulty"), kills)
    assert all(isinstance(x, bytes) for x in clean), clean
    assert faulty == clean


def ring(n: int, rounds: int, every: int = 2, size: int = 64) -> Program:
    return Program(n, [[[(r + 1) % n] for r in range(n)] for _ in range(rounds)],
                   [set(range(every, rounds, every)) for _ in range(n)], [size] * rounds)


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_messages_logged_as_they_are_sent_survive_a_killed_rank_and_lost_frames(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Messages of 96 KiB leave from the application's buffer while they are copied into
    the log (wire/datapath.py), on the compiled path and on its fallback: a killed rank
    re-executes from the logs (each body checked against the checksum taken before it
    was sent), and frames lost on the way are sent again from the log."""
    monkeypatch.setenv(datapath.ENV, path)
    monkeypatch.setattr(datapath, "mode", path)  # read at import
    if path == "compiled" and not datapath.compiled():
        pytest.fail("raps_slurm.wire._datapath is not built (pip install -e .)")
    seen: list[Context] = []

    def lossy(ctx: Context) -> None:
        ctx.drop_every = 5
        seen.append(ctx)

    prog = ring(3, 8, every=2, size=96 << 10)
    prog.parts = True
    clean = run(prog, tmp_path / "clean")
    assert all(isinstance(s, bytes) for s in clean), clean
    assert run(prog, tmp_path / "faulty", {1: 5}, ctx_hook=lossy) == clean
    assert sum(c.log.reserved for c in seen) >= len(seen), "none copied as it was sent"
    assert sum(c.resent for c in seen) > 0


def test_under_frame_mac_all_a_large_message_is_logged_whole_then_sent_tagged(
        tmp_path: Path) -> None:
    seen: list[Context] = []
    prog = ring(3, 4, every=2, size=96 << 10)
    prog.parts = True
    clean = run(prog, tmp_path / "clean")
    tagged = run(prog, tmp_path / "all", settings=replace(SMALL, frame_mac="all"),
                 ctx_hook=seen.append)
    assert tagged == clean and all(isinstance(s, bytes) for s in clean), tagged
    assert seen and all(c.log.reserved == 0 and c.listener.auth.frame_mac == "all" for c in seen)


def test_two_neighbours_killed_together(tmp_path: Path) -> None:
    prog = ring(4, 8)
    clean = run(prog, tmp_path / "clean")
    assert run(prog, tmp_path / "faulty", {1: 5, 2: 5}) == clean


def test_two_neighbours_killed_with_their_logs_lost_replay_from_their_checkpoints(
        tmp_path: Path) -> None:
    # Each needs messages the other sent before its own checkpoint and after the other's:
    # with both logs lost (node and log backup gone), only the checkpoints carry them.
    # (small and large messages: a large body travels as a checkpoint item of its own)
    prog = Program(4, [[[(r + 1) % 4, (r - 1) % 4] for r in range(4)] for _ in range(10)],
                   [{2, 6}, {3, 7}, {4, 8}, {5}], [100, 1000] * 5)
    clean = run(prog, tmp_path / "clean")
    assert run(prog, tmp_path / "faulty", {1: 9, 2: 9}, lose_log=True) == clean


def test_whole_job_restart_from_uncoordinated_checkpoints(tmp_path: Path) -> None:
    prog = Program(3, [[[1, 2], [0, 2], [0, 1]] for _ in range(8)],
                   [{2, 5}, {3, 6}, {4}], [100] * 8)
    clean = run(prog, tmp_path / "clean")
    # every rank dies at a different round, each after its own last checkpoint
    assert run(prog, tmp_path / "faulty", {0: 6, 1: 7, 2: 5}) == clean


def test_every_rank_killed_at_once_restarts_from_its_own_latest_checkpoint(
        tmp_path: Path) -> None:
    # What a requeue of the whole job looks like: every rank stops at the same round and
    # comes back from its own latest checkpoint, taken at a different round for each.
    prog = Program(4, [[[(r + 1) % 4, (r + 2) % 4] for r in range(4)] for _ in range(9)],
                   [{2, 5}, {3, 6}, {4}, {1, 7}], [300] * 9)
    clean = run(prog, tmp_path / "clean")
    assert run(prog, tmp_path / "faulty", {0: 8, 1: 8, 2: 8, 3: 8}) == clean


def test_dropped_frames_are_resent_in_order(tmp_path: Path) -> None:
    prog = ring(3, 12, every=100)
    clean = run(prog, tmp_path / "clean")
    seen: list[Context] = []

    def lossy(ctx: Context) -> None:
        ctx.drop_every = 3
        seen.append(ctx)

    assert run(prog, tmp_path / "lossy", ctx_hook=lossy) == clean
    assert sum(c.resent for c in seen) >= len(seen)  # every rank's third frame was lost


@pytest.mark.parametrize("size", [64, 96 << 10])
def test_non_deterministic_rank_is_an_error_not_a_wrong_result(tmp_path: Path,
                                                               size: int) -> None:
    """Small messages carry their checksum; a large one sent as it is copied into the log
    carries none, and its checksum follows in a CHECKSUMS frame: compared all the same."""
    prog = ring(3, 6, every=2, size=size)
    prog.parts = size > 64
    quick = Settings(flush_ms=20, large_threshold=256, high_watermark=1 << 20,
                     buffer_bytes=2 << 20, checkpoint_interval=1e9, max_generations=2,
                     recv_timeout=3.0)
    out = run(prog, tmp_path, {0: 5}, tweak=lambda b: b[::-1], settings=quick)
    errors = [x for x in out if isinstance(x, BaseException)]
    assert errors, out
    # compared against what was delivered ("re-sent"), or against the copy still
    # waiting to be delivered ("sent ... twice") when the receiver had not taken it yet
    # (a busy machine)
    assert any(isinstance(e, NotDeterministic) and ("rank 0 re-sent seq" in str(e)
               or re.search(r"rank 0 sent seq \d+ twice", str(e)))
               and "not piecewise deterministic" in str(e) for e in errors), errors


def test_frames_from_a_fenced_epoch_are_refused_and_counted(tmp_path: Path) -> None:
    a = Context(LocalPort(tmp_path, "1", 0, 1, PARAMS), 0, 2, 1, SMALL)
    b = Context(LocalPort(tmp_path, "1", 1, 1, PARAMS), 1, 2, 1, SMALL)
    a.send(1, b"first")
    assert b.recv(0, timeout=10) == b"first"
    # rank 0 is relaunched (epoch 2, no checkpoint): it re-executes and goes on
    newer = Context(LocalPort(tmp_path, "1", 0, 2, PARAMS), 0, 2, 2, SMALL)
    newer.send(1, b"first")  # the re-executed send: a duplicate, dropped
    newer.send(1, b"second")
    assert b.recv(0, timeout=10) == b"second"
    assert b.stats()["duplicates"] >= 1
    # the old incarnation (a node back from a partition) connects again: refused at its
    # handshake, the rank map having rank 0 at epoch 2
    a._drop_out(1)
    a.send(1, b"stale")
    deadline = time.monotonic() + 10
    while not b.stats()["refused_connections"].get("epoch") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert b.stats()["refused_connections"].get("epoch", 0) >= 1, b.stats()
    with pytest.raises(MessagingError, match="waited 1s for seq 3 from rank 0"):
        b.recv(0, timeout=1)
    for c in (a, b, newer):
        c.close()


def two_ranks(rank: Callable[[int], None]) -> None:
    """Ranks 0 and 1 of ``rank`` on two threads of this process, within 60 s."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "deadlock"


def test_fast_senders_both_ways_spill_and_never_deadlock(tmp_path: Path) -> None:
    tight = Settings(flush_ms=10, large_threshold=1024, high_watermark=256 << 10,
                     buffer_bytes=512 << 10, recv_timeout=30.0)
    n, size = 400, 4096  # 1.6 MB each way, six times the watermark
    peaks: dict[int, int] = {}
    done: dict[int, list[bytes]] = {}

    def rank(r: int) -> None:
        ctx = Context(LocalPort(tmp_path, "1", r, 1, PARAMS), r, 2, 1, tight)
        other = 1 - r
        for i in range(n):
            ctx.send(other, bytes([i % 256]) * size)
        done[r] = [ctx.recv(other) for _ in range(n)]
        peaks[r] = ctx.log.peak
        assert ctx.log.spilled > 0
        ctx.finalize()

    two_ranks(rank)
    for r in (0, 1):
        assert done[r] == [bytes([i % 256]) * size for i in range(n)]
        assert peaks[r] <= tight.buffer_bytes


def test_a_waiting_rank_reads_its_own_connections(tmp_path: Path) -> None:
    """A message reaches a rank waiting in recv on that rank's own thread (no hand-off
    from a reader thread), and large messages sent both ways at once never block."""
    rounds, big = 200, 2 << 20
    stats: dict[int, dict[str, int]] = {}
    got: dict[int, list[bytes]] = {}

    def rank(r: int) -> None:
        ctx = Context(LocalPort(tmp_path, "1", r, 1, PARAMS), r, 2, 1,
                      Settings(recv_timeout=30.0))
        other = 1 - r
        for i in range(rounds):  # ping-pong: one side always waits in recv
            if r == 0:
                ctx.send(other, i.to_bytes(8, "big"))
                assert ctx.recv(other) == i.to_bytes(8, "big")
            else:
                ctx.send(other, ctx.recv(other))
        for i in range(3):  # both send 2 MiB before either receives: more than TCP holds
            ctx.send(other, bytes([r * 16 + i]) * big)
        got[r] = [ctx.recv(other) for _ in range(3)]
        stats[r] = ctx.stats()
        ctx.finalize()

    two_ranks(rank)
    for r in (0, 1):
        assert got[r] == [bytes([(1 - r) * 16 + i]) * big for i in range(3)]
        # Nearly all of the 200 pings (or pongs) were read by the thread waiting for them.
        assert stats[r]["frames_read_waiting"] > rounds // 2, stats[r]


def test_the_flush_thread_spills_before_a_send_meets_the_watermark(tmp_path: Path) -> None:
    s = Settings(flush_ms=5000, large_threshold=1024, high_watermark=256 << 10,
                 buffer_bytes=512 << 10, recv_timeout=30.0)
    a = Context(LocalPort(tmp_path, "1", 0, 1, PARAMS), 0, 2, 1, s)
    b = Context(LocalPort(tmp_path, "1", 1, 1, PARAMS), 1, 2, 1, s)
    try:
        for i in range(50):  # 200 KiB: over 3/4 of the watermark, under the watermark
            a.send(1, bytes([i]) * 4096)
        assert not a.log.over_watermark()
        # The send that passed 3/4 woke the flush thread (its period is 5 s): it spills
        # down to half the watermark with no further send.
        deadline = time.monotonic() + 3
        while a.log.held > s.high_watermark // 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.log.held <= s.high_watermark // 2, a.log.held
        assert a.log.spilled > 0
        assert [b.recv(0) for _ in range(50)] == [bytes([i]) * 4096 for i in range(50)]
    finally:
        for c in (a, b):
            c.close()


def _heat(args: list[str], tmp: Path) -> str:
    import subprocess
    import sys
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", *args, "--",
                           sys.executable, str(repo / "examples" / "heat_ring.py"),
                           "--steps", "120", "--every", "20"],
                          capture_output=True, text=True, timeout=120, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("final ")]
    return line


def test_local_launcher_relaunches_a_crashed_rank_process(tmp_path: Path) -> None:
    clean = _heat(["-n", "3"], tmp_path)
    assert _heat(["-n", "3", "--restarts", "1"], tmp_path) == clean
    import subprocess
    import sys
    repo = Path(__file__).resolve().parents[2]
    crashed = subprocess.run(
        [sys.executable, "-m", "raps_slurm.runtime.local", "-n", "3", "--restarts", "1",
         "--dir", str(tmp_path / "run"), "--",
         sys.executable, str(repo / "examples" / "heat_ring.py"), "--steps", "120",
         "--every", "20", "--die-at", "70"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert crashed.returncode == 0, crashed.stderr[-2000:]
    assert "rank 2 exited with 17; relaunching it with epoch 2" in crashed.stderr
    assert clean in crashed.stdout
    # the relaunched rank said when it had regained its pre-fault progress: it re-sent
    # what it had sent between its checkpoint (step 60) and its death (step 70), 2
    # messages a step, as far as its peers had delivered them (not only what its log held)
    events = [json.loads(x) for x in
              (tmp_path / "run" / "recovery-events.log").read_text().splitlines()]
    assert [(e["rank"], e["epoch"], e["phase"]) for e in events] == [
        (2, 2, "running"), (2, 2, "caught_up")]
    assert events[0]["detail"]["step"] == 61   # running again: the first step redone
    detail = events[1]["detail"]
    assert 18 <= detail["replayed"] <= 20 and 69 <= detail["step"] <= 71, detail
    assert "finished" not in detail
    # to redo steps 60-70 it needed both neighbours' messages of those steps again, which
    # they replayed from their logs (one message each per step)
    assert detail["received"] >= 2 * (detail["step"] - 61), detail


def test_an_unlogged_first_message_waits_for_a_peer_that_starts_later(tmp_path: Path) -> None:
    """The benchmark's unlogged baseline keeps nothing to send again: its first message,
    sent before the receiver listens, once went nowhere and the receiver waited for ever
    (bench messaging: "rank 0 waited 120s for seq 1 from rank 1"). It waits instead."""
    unlogged = Settings(**{**SMALL.__dict__, "logging": False, "recv_timeout": 20.0})
    sender_started = threading.Event()
    got: list[bytes | BaseException] = []

    def sender() -> None:
        ctx = Context(LocalPort(tmp_path, "1", 1, 1), 1, 2, 1, unlogged)
        sender_started.set()
        ctx.send(0, b"go")          # rank 0 has not even published its address yet
        ctx.finalize(timeout=20)

    t = threading.Thread(target=sender)
    t.start()
    assert sender_started.wait(10)
    time.sleep(0.5)                  # the race the benchmark lost: the receiver is late
    receiver = Context(LocalPort(tmp_path, "1", 0, 1), 0, 2, 1, unlogged)
    try:
        got.append(receiver.recv(1, timeout=15))
    except MessagingError as exc:
        got.append(exc)
    receiver.finalize(timeout=20)
    t.join(30)
    assert got == [b"go"]


@pytest.mark.parametrize("logging", [True, False])
def test_small_sends_keep_order_and_bytes_on_either_lane(tmp_path: Path, logging: bool
                                                         ) -> None:
    """``send_small`` (the MPI layer's send of an envelope and a buffer below the arena's
    size) goes the general way before the connection is up and for a message too large,
    and its own lane otherwise: logged or not, the
    receiver gets every message in order with its bytes, and a logged one's log entry is
    the message's."""
    settings = Settings(**{**SMALL.__dict__, "logging": logging, "recv_timeout": 20.0})
    a = Context(LocalPort(tmp_path, "1", 0, 1), 0, 2, 1, settings)
    b = Context(LocalPort(tmp_path, "1", 1, 1), 1, 2, 1, settings)
    sent: list[bytes] = []
    try:
        for i in range(300):
            data = bytearray(np.full(1 + (i * 37) % 900, i % 256, np.uint8).tobytes())
            if i == 150:
                data = bytearray(70_000)  # from ARENA_AT on: the general way
            a.send_small(1, b"E%03d" % i, memoryview(data))
            sent.append(b"E%03d" % i + bytes(data))
            data[:] = bytes(len(data))  # the caller reuses its buffer at once
            if i == 1:
                assert b.recv(0, timeout=15) == sent[0]  # the connection is up now
                assert 1 in a._out, "no connection after a message went through"
        got = [b.recv(0, timeout=15) for _ in range(len(sent) - 1)]
        assert [sent[0], *got] == sent
        if logging:
            with a._mu:
                kept = [(e.seq, bytes(e.body or b"")) for e in a.log.after(1, 0)]
            assert kept == list(enumerate(sent, 1))
    finally:
        ends = [threading.Thread(target=ctx.finalize, kwargs={"timeout": 20}) for ctx in (a, b)]
        for t in ends:
            t.start()
        for t in ends:
            t.join(30)


def test_which_escalations_ask_for_a_requeue(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender that cannot serve a replay records it without asking for a requeue (it is
    not stuck; a real hole times the receiver's plan out); a receive that timed out asks."""
    ctx = Context(LocalPort(tmp_path, "1", 0, 1, PARAMS), 0, 2, 1, SMALL)
    asked: list[tuple[str, bool]] = []
    monkeypatch.setattr(ctx.port, "escalate",
                        lambda reason, requeue=True: asked.append((reason, requeue)))

    def hole(dst: int, after: int) -> list[object]:
        raise MessagingError("seq 14..20 were collected (floor 1)")

    monkeypatch.setattr(ctx.log, "after", hole)
    ctx._resend(1, 13)
    assert asked == [("rank 0 cannot replay to rank 1: seq 14..20 were collected (floor 1)",
                      False)]
    with pytest.raises(MessagingError):
        ctx.recv(1, timeout=0.2)
    assert asked[1][1] is True and "waited" in asked[1][0]
    ctx.close()


_RESTORE = """
import sys
from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.runtime.context import Context, Settings
from raps_slurm.runtime.ports import LocalPort
ctx = Context(LocalPort(sys.argv[1], "1", 0, 2, CodecParams(avg_chunk_kb=4)), 0, 2, 2,
              Settings(flush_ms=20))
ctx.restore()
print("restored")
"""


def test_a_rank_whose_every_generation_is_damaged_exits_74_not_from_the_start(
        tmp_path: Path) -> None:
    """Generations saved, each with a damaged chunk: the restore raises kind ``lost`` and
    a rank that calls it exits 74 (LOST_EXIT) instead of starting from the beginning."""
    port = LocalPort(tmp_path, "1", 0, 1, PARAMS)
    for seed in (1, 2):
        port.save({"x": np.random.default_rng(seed).standard_normal(20_000)}, {})
    port.close()
    assert damage_chunks(port._ckpt.store, "1") > 0
    with pytest.raises(AgentError, match=r"generations \[1, 2\] all have bad chunks") as e:
        LocalPort(tmp_path, "1", 0, 2, PARAMS).restore()
    assert e.value.kind == "lost"
    done = subprocess.run([sys.executable, "-c", _RESTORE, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == LOST_EXIT, done.stderr[-2000:]
    assert "restored" not in done.stdout
    assert "rank 0 epoch 2 cannot be restored" in done.stderr, done.stderr[-2000:]


def test_the_checkpoint_interval_counts_from_the_restore(tmp_path: Path) -> None:
    """A relaunched rank's restored state is a committed generation: its next checkpoint
    is due one interval after the restore, not at once because the restore took long."""
    now = [0.0]
    s = Settings(checkpoint_interval=10.0)
    ctx = Context(LocalPort(tmp_path, "1", 0, 1, PARAMS), 0, 1, 1, s, clock=lambda: now[0])
    ctx.checkpoint({"x": np.arange(4)})
    ctx.close()
    again = Context(LocalPort(tmp_path, "1", 0, 2, PARAMS), 0, 1, 2, s, clock=lambda: now[0])
    try:
        now[0] = 100.0  # the restore took long
        assert again.checkpoint_due()
        assert again.restore() is not None
        assert not again.checkpoint_due()
        now[0] = 110.0
        assert again.checkpoint_due()
    finally:
        again.close()


def test_a_restored_rank_defers_its_checkpoints_until_it_has_caught_up(
        tmp_path: Path) -> None:
    """Re-executing steps its lost incarnation had done, a rank saves nothing (a save
    would stall it and the neighbours waiting on it); once it has sent as much as
    before the loss, it saves again. A replay longer than three intervals saves anyway."""
    now = [0.0]
    s = Settings(flush_ms=20, checkpoint_interval=60.0)
    lost = Context(LocalPort(tmp_path, "1", 0, 1, PARAMS), 0, 2, 1, s, clock=lambda: now[0])
    for i in range(3):
        lost.send(1, b"%d" % i)
    first = lost.checkpoint({"i": np.array([3])})
    for i in range(3, 6):
        lost.send(1, b"%d" % i)
    lost._flush()  # logged, and then the rank is lost
    lost.close()
    ctx = Context(LocalPort(tmp_path, "1", 0, 2, PARAMS), 0, 2, 2, s, clock=lambda: now[0])
    try:
        assert int(ctx.restore()["i"][0]) == 3
        ctx.send(1, b"3")
        assert ctx.checkpoint({"i": np.array([4])}) == first  # deferred: replaying
        assert ctx.deferred_checkpoints == 1 and ctx.generation == first
        ctx.send(1, b"4")
        ctx.send(1, b"5")
        ctx.heartbeat(6)  # sent as much as before the loss: caught up
        assert ctx.checkpoint({"i": np.array([6])}) == first + 1
        assert ctx.deferred_checkpoints == 1
    finally:
        ctx.close()
    again = Context(LocalPort(tmp_path, "1", 0, 3, PARAMS), 0, 2, 3, s, clock=lambda: now[0])
    try:
        assert int(again.restore()["i"][0]) == 6
        again.send(1, b"6")  # nothing more had been sent: caught up at once
        assert again.checkpoint({"i": np.array([7])}) == first + 2
        again.send(1, b"7")
        again._flush()  # logged past the checkpoint, then lost
    finally:
        again.close()
    slow = Context(LocalPort(tmp_path, "1", 0, 4, PARAMS), 0, 2, 4, s, clock=lambda: now[0])
    try:
        assert int(slow.restore()["i"][0]) == 7
        now[0] += 179.0  # replaying, within three intervals of the restore: deferred
        assert slow.checkpoint({"i": np.array([7])}) == first + 2
        now[0] += 2.0  # a replay longer than three intervals: saved anyway
        assert slow.checkpoint({"i": np.array([7])}) == first + 3
        assert slow.deferred_checkpoints == 1
    finally:
        slow.close()



def re_executing(newer: Context, old: list[bytes]) -> threading.Thread:
    """A thread (not started) in which relaunched rank 0 re-sends ``old`` to rank 1, 0.4 s
    apart, then a new message, b"new"."""
    def re_execute() -> None:
        for m in old:
            newer.send(1, m)
            time.sleep(0.4)
        newer.send(1, b"new")

    return threading.Thread(target=re_execute)


def test_a_receive_waits_as_long_as_a_relaunched_peer_re_executes(tmp_path: Path) -> None:
    """recv_timeout bounds a silence, not a re-execution: the relaunched peer re-sends its
    old messages (duplicates) for longer than recv_timeout before the new one comes."""
    quick = Settings(**{**SMALL.__dict__, "recv_timeout": 1.0})
    a = Context(LocalPort(tmp_path, "1", 0, 1, PARAMS), 0, 2, 1, quick)
    b = Context(LocalPort(tmp_path, "1", 1, 1, PARAMS), 1, 2, 1, quick)
    old = [f"m{i}".encode() for i in range(8)]
    for m in old:
        a.send(1, m)
    assert [b.recv(0) for _ in old] == old
    a.close()  # rank 0 lost; its relaunch re-executes 8 sends, 0.4 s apart
    newer = Context(LocalPort(tmp_path, "1", 0, 2, PARAMS), 0, 2, 2, quick)

    t = re_executing(newer, old)
    started = time.monotonic()
    t.start()
    assert b.recv(0) == b"new"  # 3.2 s of re-execution, recv_timeout 1 s
    assert time.monotonic() - started > 3.0
    t.join()
    assert b.stats()["duplicates"] >= len(old)
    # Negative control: a silent peer still ends the wait after recv_timeout.
    began = time.monotonic()
    with pytest.raises(MessagingError, match="waited 1s for seq 10 from rank 0"):
        b.recv(0)
    assert 0.9 < time.monotonic() - began < 5
    for c in (b, newer):
        c.close()


def test_a_receive_waits_for_a_peer_blocked_on_a_re_executing_one(tmp_path: Path) -> None:
    """A chain: rank 2 waits for rank 1, which waits for rank 0 while rank 0 re-executes
    for longer than recv_timeout. Rank 1 sends rank 2 nothing meanwhile, but its PROGRESS
    frames say the chain moves, so rank 2 waits too; a chain that stops still times out."""
    quick = Settings(**{**SMALL.__dict__, "recv_timeout": 1.0, "flush_ms": 20})
    ctx = [Context(LocalPort(tmp_path, "1", r, 1, PARAMS), r, 3, 1, quick) for r in range(3)]
    a, b, c = ctx
    old = [f"m{i}".encode() for i in range(8)]
    for m in old:
        a.send(1, m)
    assert [b.recv(0) for _ in old] == old
    b.send(2, b"hello")
    assert c.recv(1) == b"hello"
    a.close()
    newer = Context(LocalPort(tmp_path, "1", 0, 2, PARAMS), 0, 3, 2, quick)

    def middle() -> None:
        assert b.recv(0) == b"new"  # 3.2 s of re-execution
        b.send(2, b"after")

    threads = [re_executing(newer, old), threading.Thread(target=middle)]
    started = time.monotonic()
    for t in threads:
        t.start()
    assert c.recv(1) == b"after"  # rank 1 sent nothing for 3.2 s, recv_timeout 1 s
    assert time.monotonic() - started > 3.0
    for t in threads:
        t.join()
    # Negative control: the chain stops (rank 0 silent, rank 1 waiting on it): both end.
    errors: list[BaseException] = []

    def stuck() -> None:
        try:
            b.recv(0)
        except MessagingError as exc:
            errors.append(exc)

    t = threading.Thread(target=stuck)
    began = time.monotonic()
    t.start()
    with pytest.raises(MessagingError, match="from rank 1"):
        c.recv(1)
    t.join()
    assert errors and time.monotonic() - began < 6
    for x in (b, c, newer):
        x.close()


@pytest.mark.parametrize("where", ["arena", "chunk"])
def test_a_changed_logged_body_is_refused_at_replay_naming_the_message(
        tmp_path: Path, where: str) -> None:
    """Frames carry no MAC under frame_mac control: a replay checks each logged body
    against the checksum it was logged with before it is sent. A body changed in the
    arena (a large message) or in its lane's chunk (a small one) is not replayed: the
    sender escalates once, naming rank and seq. (A body read back from the log store is
    checked as it is parsed: parse_records.)"""
    a = Context(LocalPort(tmp_path, "1", 0, 1, PARAMS), 0, 2, 1, SMALL)
    b = Context(LocalPort(tmp_path, "1", 1, 1, PARAMS), 1, 2, 1, SMALL)
    first = bytearray(b"f" * (100 << 10))  # copied into the arena (not bytes)
    a.send(1, first)
    a.send(1, b"s" * 200)  # small (SMALL: large above 256)
    assert b.recv(0, timeout=10) == bytes(first)
    assert b.recv(0, timeout=10) == b"s" * 200
    if where == "arena":
        seq, entry = 1, a.log.after(1, 0)[0]
        assert entry.slot is not None  # the arena holds it
        entry.body[12345] ^= 1  # type: ignore[index]  # the arena's memory changed
    else:
        seq, lane = 2, a.log.lanes[1]
        lane.body(lane.index(1))[100] ^= 1  # the chunk's memory changed
    b.close()  # rank 1 lost with no checkpoint: its relaunch asks for everything
    b2 = Context(LocalPort(tmp_path, "1", 1, 2, PARAMS), 1, 2, 2, SMALL)
    b2.restore()
    if seq == 2:
        assert b2.recv(0, timeout=10) == bytes(first)
    with pytest.raises(MessagingError, match=f"waited 1s for seq {seq} from rank 0"):
        b2.recv(0, timeout=1)
    said = (tmp_path / "escalations" / "0.log").read_text()
    assert f"logged body of seq {seq} to rank 1 does not match its checksum" in said, said
    assert said.count("\n") == 1, said  # once, however often rank 1 asks again
    for c in (a, b2):
        c.close()


def test_small_messages_spilled_whole_are_replayed_and_checkpointed_from_the_store(
        tmp_path: Path) -> None:
    """A spill drops small messages whole (their rows and chunks): a relaunched receiver
    still gets each of them, read back from the log store, and a checkpoint taken after
    the spill carries them, so the sender's own relaunch holds them in memory again."""
    a = Context(LocalPort(tmp_path, "1", 0, 1, PARAMS), 0, 2, 1, SMALL)
    b = Context(LocalPort(tmp_path, "1", 1, 1, PARAMS), 1, 2, 1, SMALL)
    sent = [bytes([i]) * (i + 1) for i in range(50)]
    for m in sent:
        a.send(1, m)
    assert [b.recv(0, timeout=10) for _ in sent] == sent
    a._spill(0)
    assert (a.log.held, a.log.count(), a.log.spilled) == (0, 50, 50)
    assert [(e.seq, e.body) for e in a.log.after(1, 0)] == [(i + 1, None) for i in range(50)]
    a.checkpoint({"step": b"1"})
    b.close()  # rank 1 lost with no checkpoint: its relaunch asks for everything
    b2 = Context(LocalPort(tmp_path, "1", 1, 2, PARAMS), 1, 2, 2, SMALL)
    b2.restore()
    assert [b2.recv(0, timeout=10) for _ in sent] == sent
    a.close()
    a2 = Context(LocalPort(tmp_path, "1", 0, 2, PARAMS), 0, 2, 2, SMALL)
    assert a2.restore() == {"step": b"1"}
    assert [e.body for e in a2.log.after(1, 0)] == sent
    for c in (a2, b2):
        c.close()


PAIR = """from raps_slurm import runtime
ctx = runtime.init(local=2)
if ctx.rank == 0:
    ctx.send(1, b"x")
else:
    assert ctx.recv(0) == b"x"
ctx.finalize()
"""


def test_a_forked_local_run_removes_its_temporary_directory(tmp_path: Path) -> None:
    """runtime.init(local=N) without RAPS_LOCAL_DIR: rank 0 removes the directory it made
    once its ranks are done (no later run could find the data in it)."""
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", PAIR], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_local_launcher_ends_the_job_when_a_rank_escalates(tmp_path: Path) -> None:
    """A rank that escalates asks for a whole-job requeue, which the local launcher does
    not do: it stops every rank at once, names the reason and fails, rather than leaving
    the job waiting for what cannot come (before, it waited for the ranks' recv_timeout)."""
    import subprocess
    import sys
    import time
    program = tmp_path / "escalate.py"
    program.write_text(
        "import os, time\n"
        "from raps_slurm.runtime.ports import LocalPort\n"
        "rank = int(os.environ['RAPS_RANK'])\n"
        "port = LocalPort(os.environ['RAPS_LOCAL_DIR'], 'local', rank, 1)\n"
        "if rank == 0:  # recorded only: a stale resend request, say; the job goes on\n"
        "    port.escalate('rank 0 cannot replay to rank 2: gone', requeue=False)\n"
        "if rank == 1:\n"
        "    time.sleep(1)\n"
        "    port.escalate('logged body of seq 1 to rank 0 does not match its checksum')\n"
        "time.sleep(120)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", "-n", "3", "--",
                           sys.executable, str(program)],
                          capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert time.monotonic() - start < 60, proc.stderr
    assert proc.returncode == 1, proc.stderr
    assert ("raps-local: rank 1 escalated (logged body of seq 1 to rank 0 does not match its "
            "checksum): a whole-job requeue, which this launcher does not do; stopping ranks "
            "[0, 1, 2]") in proc.stderr, proc.stderr


def test_an_escalation_that_asks_no_requeue_ends_no_local_job(tmp_path: Path) -> None:
    """A sender that could not serve a resend records it without asking for a requeue
    (a later request may supersede it): the local job goes on and ends well."""
    import subprocess
    import sys
    program = tmp_path / "record.py"
    program.write_text(
        "import os, time\n"
        "from raps_slurm.runtime.ports import LocalPort\n"
        "rank = int(os.environ['RAPS_RANK'])\n"
        "if rank == 0:\n"
        "    LocalPort(os.environ['RAPS_LOCAL_DIR'], 'local', 0, 1).escalate(\n"
        "        'rank 0 cannot replay to rank 1: gone', requeue=False)\n"
        "time.sleep(1.5)\n")
    proc = subprocess.run([sys.executable, "-m", "raps_slurm.runtime.local", "-n", "2", "--",
                           sys.executable, str(program)],
                          capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert proc.returncode == 0 and "escalated" not in proc.stderr, proc.stderr
