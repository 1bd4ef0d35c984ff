"""Node supervisors and raps-run's control server on localhost, without Slurm: real
supervisor processes, real ranks, the real channel."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.core.launch import cpu_share
from raps_slurm.launcher.channel import connect
from raps_slurm.launcher.control import LOST_EXIT, ControlServer, RankHandle
from raps_slurm.wire.framing import HEADER, FrameError

# The ranks print word by word (PYTHONUNBUFFERED, see start()) at the same moment into
# the supervisor's one output: their lines come out whole (launcher/output.py).
RANK = ["-c", "import os, time\nprint('rank', os.environ['RAPS_RANK'], 'epoch', "
        "os.environ['RAPS_EPOCH'], 'key' if 'RAPS_CONTROL_KEY' in os.environ else 'nokey', "
        "flush=True)\ntime.sleep(600)"]


def wait(what: str, ok: object, timeout: float = 20.0, seen: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ok():  # type: ignore[operator]
        if time.monotonic() > deadline:
            said = seen.read_text(errors="replace")[-2000:] if seen else ""
            raise AssertionError(f"timed out waiting for {what}; output: {said!r}")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def supervisor(ctl: ControlServer, node: str, out: Path) -> subprocess.Popen[bytes]:
    """What srun would start on ``node``: the supervisor with the step's environment."""
    ctl.expect(node)
    env = {**os.environ, **ctl.env(), "SLURMD_NODENAME": node}
    with out.open("ab") as f:
        return subprocess.Popen([sys.executable, "-m", "raps_slurm.launcher.supervisor"],
                                env=env, stdout=f, stderr=subprocess.STDOUT)


@pytest.fixture
def ctl() -> Iterator[ControlServer]:
    c = ControlServer("127.0.0.1")
    try:
        yield c
    finally:
        c.close()


def start(ctl: ControlServer, node: str, rank: int, epoch: int, slot: int, slots: int
          ) -> RankHandle:
    return ctl.start(node, rank, epoch, [sys.executable, *RANK],
                     {"RAPS_RANK": str(rank), "RAPS_EPOCH": str(epoch),
                      "PYTHONUNBUFFERED": "1"}, slot, slots)


def test_four_ranks_one_restarted_in_place_the_others_untouched_then_control_lost(
        ctl: ControlServer, tmp_path: Path) -> None:
    out = tmp_path / "n1.out"
    # the starts are asked before the supervisor connects: they wait for its hello
    handles = [start(ctl, "n1", r, 1, r, 4) for r in range(4)]
    sup = supervisor(ctl, "n1", out)
    try:
        assert ctl.wait_started(handles, 30), out.read_text()
        pids = [h.pid for h in handles]
        wait("the ranks' first lines", lambda: out.read_text().count("epoch 1 nokey") == 4,
             seen=out)
        firsts = sorted(line for line in out.read_text().splitlines() if "epoch" in line)
        assert firsts == [f"rank {r} epoch 1 nokey" for r in range(4)]
        assert all(p is not None and alive(p) for p in pids)
        cpus = sorted(os.sched_getaffinity(0))
        for h in handles:  # pinned as srun would: each slot's share of the task's CPUs
            assert h.cpus == cpu_share(cpus, h.rank, 4)
            assert sorted(os.sched_getaffinity(h.pid or 0)) == h.cpus
        # rank 2 hangs: stopped, then restarted in place with epoch 2 by the same supervisor
        old = handles[2]
        assert old.pid is not None
        os.kill(old.pid, signal.SIGSTOP)
        old.kill()
        assert old.poll() == LOST_EXIT  # killed: it counts as exited at once
        new = start(ctl, "n1", 2, 2, 2, 4)
        assert ctl.wait_started([new], 10)
        wait("the stopped rank gone", lambda: not alive(old.pid or 0))
        assert new.pid not in pids and alive(new.pid or 0)
        assert [h.pid for h in handles if h.rank != 2] == [p for i, p in enumerate(pids)
                                                            if i != 2]
        assert all(alive(h.pid or 0) and h.poll() is None for h in handles if h.rank != 2)
        # a signal through the channel; the rank's exit is reported with its code
        handles[0].send_signal(signal.SIGTERM)
        assert handles[0].wait(10) == -signal.SIGTERM
        wait("the new rank's line", lambda: "rank 2 epoch 2 nokey" in out.read_text())
        assert " key\n" not in out.read_text()  # the channel's secret stays with the supervisor
        # control lost (raps-run gone): the supervisor kills its ranks and exits 1
        ctl.links["n1"].chan.close()
        assert sup.wait(15) == 1
        running = [handles[1], handles[3], new]
        assert all(not alive(h.pid or 0) for h in running)
        wait("the lost ranks counted as exited",
             lambda: all(h.poll() == LOST_EXIT for h in running))
    finally:
        with contextlib.suppress(ProcessLookupError):
            sup.kill()
        sup.wait(10)


def test_exit_command_ends_the_supervisor_and_its_ranks(ctl: ControlServer, tmp_path: Path
                                                        ) -> None:
    out = tmp_path / "n2.out"
    sup = supervisor(ctl, "n2", out)
    try:
        h = start(ctl, "n2", 0, 1, 0, 1)
        assert ctl.wait_started([h], 30)
        bad = ctl.start("n2", 1, 1, ["/nonexistent/program"], {}, 0, 1)
        assert bad.wait(10) == 127
        # labelled: a line that ends, then one the rank has not ended when it is killed;
        # of 16 ranks, the label is as wide as "15"
        env = {"PYTHONUNBUFFERED": "1", "RAPS_SIZE": "16"}
        said = ctl.start("n2", 3, 1, [sys.executable, "-c", "print('labelled', 'hello')"],
                         env, 0, 1, label=True)
        assert said.wait(10) == 0
        wrote = tmp_path / "wrote"
        cut = ctl.start("n2", 4, 1, [sys.executable, "-c", "import sys, time\n"
                                     "sys.stdout.write('unfinished')\n"
                                     f"open({str(wrote)!r}, 'w').close()\ntime.sleep(600)"],
                        env, 0, 1, label=True)
        assert ctl.wait_started([cut], 30)
        wait("the labelled line", lambda: " 3: labelled hello\n" in out.read_text(), seen=out)
        wait("the unfinished line written", wrote.exists)
        ctl.close()
        assert sup.wait(15) == 0
        wait("the rank gone", lambda: not alive(h.pid or 0))
        # what the killed rank had written came out before the supervisor's task ended,
        # ended with a newline as srun ends a labelled task's last partial line
        assert out.read_text().endswith("\n 4: unfinished\n"), out.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            sup.kill()
        sup.wait(10)


def test_a_rank_that_fails_with_its_agent_out_of_reach_is_reported_so(
        ctl: ControlServer, tmp_path: Path) -> None:
    """Exit 1 with no agent on the rank's socket: ``agent: false`` (a failure of the node);
    the same exit with an agent listening, or a kill, is the rank's own."""
    out = tmp_path / "n3.out"
    sup = supervisor(ctl, "n3", out)
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        fail = [sys.executable, "-c", "raise SystemExit(1)"]
        here = tmp_path / "%n.sock"
        gone = ctl.start("n3", 0, 1, fail, {"RAPS_AGENT_SOCKET": str(here)}, 0, 1)
        assert gone.wait(15) == 1 and gone.agent_lost
        wait("the supervisor's word", lambda: "n3.sock takes no connection" in out.read_text(),
             seen=out)
        agent.bind(str(tmp_path / "n3.sock"))  # %n is the node's name
        agent.listen(4)
        there = ctl.start("n3", 1, 1, fail, {"RAPS_AGENT_SOCKET": str(here)}, 0, 1)
        assert there.wait(15) == 1 and not there.agent_lost
        agent.close()
        killed = ctl.start("n3", 2, 1, [sys.executable, *RANK],
                           {"RAPS_AGENT_SOCKET": str(here), "RAPS_RANK": "2",
                            "RAPS_EPOCH": "1"}, 0, 1)
        assert ctl.wait_started([killed], 30)
        killed.kill()
        assert killed.wait(5) == LOST_EXIT and not killed.agent_lost
    finally:
        agent.close()
        ctl.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            sup.wait(15)
        with contextlib.suppress(ProcessLookupError):
            sup.kill()
        sup.wait(10)


def test_the_listener_refuses_strangers_wrong_keys_and_unexpected_nodes(
        ctl: ControlServer) -> None:
    # wrong key: the supervisor side fails, raps-run counts an auth refusal
    with pytest.raises(FrameError):
        connect(ctl.address, b"w" * 32, "n1")
    wait("the auth refusal", lambda: ctl.refused["auth"] == 1)
    # a node no step was started on: authenticated, but its hello is refused
    chan = connect(ctl.address, ctl.key, "n9")
    chan.send({"op": "hello", "node": "n9", "pid": 1, "cpus": [0]})
    wait("the unexpected refusal", lambda: ctl.refused["unexpected"] == 1)
    chan.close()
    # garbage instead of a handshake
    with socket.create_connection(("127.0.0.1", ctl.port)) as s:
        s.recv(4096)  # the challenge
        s.sendall(HEADER.pack(1 << 30))
        wait("the oversized refusal", lambda: ctl.refused["oversized"] == 1)
    assert not ctl.links


def test_connections_are_bounded_and_silent_peers_time_out(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    import raps_slurm.launcher.control as control

    monkeypatch.setattr(control, "AUTH_SEC", 0.5)
    ctl = ControlServer("127.0.0.1")
    socks = []
    try:
        # one address holds PER_SOURCE handshakes at most: each further one evicts its oldest
        for _ in range(control.PER_SOURCE + 3):
            socks.append(socket.create_connection(("127.0.0.1", ctl.port)))
        wait("the per-source evictions", lambda: ctl.refused["source"] == 3)
        wait("the silent peers timed out", lambda: ctl.refused["timeout"] == control.PER_SOURCE)
        assert ctl.refused["busy"] == 0
    finally:
        for s in socks:
            s.close()
        ctl.close()


def test_a_supervisor_gets_through_strangers_holding_every_slot() -> None:
    import raps_slurm.launcher.control as control
    from raps_slurm.launcher.supervisor import connect_retrying

    ctl = ControlServer("127.0.0.1")
    ctl.expect("n1")
    strangers = []
    try:
        # silent strangers from two addresses fill every slot and stay (AUTH_SEC is long)
        for i in range(control.HANDSHAKES):
            s = socket.socket()
            s.bind((f"127.0.0.{2 + i % 2}", 0))
            s.connect(("127.0.0.1", ctl.port))
            strangers.append(s)
        wait("every slot held", lambda: ctl._gate.waiting() == control.HANDSHAKES)
        chan = connect_retrying(ctl.address, ctl.key, "n1", within=10.0)
        chan.send({"op": "hello", "node": "n1", "pid": os.getpid(), "cpus": [0]})
        wait("the supervisor linked", lambda: ctl.linked("n1"))
        assert ctl.refused["evicted"] >= 1, ctl.refused
        chan.close()
    finally:
        for s in strangers:
            s.close()
        ctl.close()


def test_connect_retrying_backs_off_then_succeeds_and_stops_on_a_wrong_secret() -> None:
    from raps_slurm.launcher.supervisor import RETRY_FIRST_SEC, RETRY_MAX_SEC, connect_retrying

    now = [0.0]
    pauses: list[float] = []
    tries: list[int] = []

    def sleep(sec: float) -> None:
        pauses.append(sec)
        now[0] += sec

    def dial(address: str, key: bytes, node: str) -> Any:
        tries.append(1)
        if len(tries) < 8:
            raise ConnectionResetError("refused")
        return "channel"

    got = connect_retrying("h:1", b"k" * 32, "n1", within=60.0, clock=lambda: now[0],
                           sleep=sleep, dial=dial)
    assert got == "channel" and len(tries) == 8
    for i, pause in enumerate(pauses):  # doubling from RETRY_FIRST_SEC, jittered down
        step = min(RETRY_MAX_SEC, RETRY_FIRST_SEC * 2 ** i)
        assert step / 2 <= pause <= step, (i, pauses)

    def wrong(address: str, key: bytes, node: str) -> Any:
        tries.append(1)
        raise FrameError("auth", "not raps-run")

    tries.clear()
    with pytest.raises(FrameError):
        connect_retrying("h:1", b"k" * 32, "n1", clock=lambda: now[0], sleep=sleep, dial=wrong)
    assert len(tries) == 1

    def never(address: str, key: bytes, node: str) -> Any:
        raise ConnectionRefusedError("nobody")

    start = now[0]
    with pytest.raises(ConnectionRefusedError):
        connect_retrying("h:1", b"k" * 32, "n1", within=5.0, clock=lambda: now[0],
                         sleep=sleep, dial=never)
    assert 5.0 - 1e-6 <= now[0] - start <= 5.0 + RETRY_MAX_SEC
