"""``rapsctl bench heartbeats``: one real raps-coordinator under N synthetic nodes' heartbeats.

Set-up, all on 127.0.0.1: a throw-away etcd (``raps_slurm.testing.EtcdServer``), N node
registrations ``nodes/<name>`` written in transactions of ``MAX_TXN_OPS``, a new cluster
key and config (production detection defaults: 1 s heartbeats, 3 strikes, 0.5 s fence
margin), and ``python -m raps_slurm.coordinator`` with ``SLURM_CONF`` pointing at an
empty file: its Slurm calls (job states, drains) fail at once and are logged, which is
all a coordinator without Slurm can do. (With a missing file squeue retries for 60 s;
the coordinator's loop waits for it up to the 30 s command timeout and loses its 10 s
leader lease meanwhile.) No agent runs: a separate load process (spawned,
so that it has its own interpreter and GIL) sends every node's signed heartbeat once
per second, spread evenly over the second, from one socket per ``PER_SOCKET`` nodes. It
reads the coordinator's acks (counted, not decoded: only an accepted heartbeat is acked)
and answers probes at once, so that a node the detector suspects is not declared dead
because the load process was slow.

Measured over ``--seconds`` after a warm-up: datagrams sent, received (sent minus the
kernel's drops at the coordinator's socket, /proc/net/udp), accepted (the coordinator's
``raps_coordinator_heartbeats_total``, its metrics endpoint on ``--port`` + 1) and acked
per second, the CPU of the coordinator, of etcd and of the load process (psutil),
and every DEAD verdict written to etcd (a watch on ``nodes/``): all of them are false,
since every node keeps sending. Then the load stops 10 random nodes at once (no
heartbeat, no probe answer: a crash) and the DEAD verdicts' ``at`` is timed from that
instant: the detection latency under load, whose goal is the idle one, miss window +
fence margin + one interval = 4.5 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import multiprocessing
import os
import random
import selectors
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import yaml

from raps_slurm.config import load_file
from raps_slurm.errors import BadDatagram, BenchError, StoreError
from raps_slurm.store import MAX_TXN_OPS, Keys, Put, StateStore, open_store
from raps_slurm.testing import EtcdServer
from raps_slurm.testing.cluster import wait_until
from raps_slurm.wire.heartbeat import (
    KIND_ACK,
    KIND_HEARTBEAT,
    KIND_PROBE,
    MAGIC,
    VERSION,
    Heartbeat,
    Probe,
    claimed_node,
    create_key,
    decode,
    new_incarnation,
    node_key,
)

PER_SOCKET = 2500  # nodes per load socket: a socket's acks stay far below its buffer
STOPPED = 10  # nodes stopped at once for the latency figures
BOUND_S = 4.5  # miss window 3 s + fence margin 0.5 s + one interval, as for bench detect
WARMUP_S = 10.0  # > the new leader's grace (3.5 s) and a few registry reads (every 2 s)
SOCKET_BUFFER = 4 << 20  # bytes asked for the load sockets (the kernel caps at rmem_max)
_HB = struct.Struct(">QQdB")  # the Heartbeat fields of heartbeat.py's wire format
_HB_HEADER = MAGIC + bytes((VERSION, KIND_HEARTBEAT))


def node_name(i: int) -> str:
    """The synthetic node ``i``."""
    return f"hb{i:06d}"


# --------------------------------------------------------------------------- helpers


class VerdictWatch:
    """Records every node verdict written under ``nodes/`` (a watch read by a thread)."""

    def __init__(self, store: StateStore, keys: Keys) -> None:
        self.store, self.keys = store, keys
        self.events: list[tuple[float, str, str, float]] = []  # (seen, node, kind, at)
        self._stop = threading.Event()
        self._watch = store.watch_prefix(keys.nodes_prefix())
        self._thread = threading.Thread(target=self._run, name="verdict-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = 0
        while not self._stop.is_set():
            try:
                ev = self._watch.next(0.5)
            except StoreError:  # stream lost: go on from the last event seen
                if self._stop.is_set():
                    return
                time.sleep(0.5)
                with contextlib.suppress(StoreError):
                    self._watch = self.store.watch_prefix(self.keys.nodes_prefix(), last + 1)
                continue
            if ev is None:
                continue
            last = ev.mod_revision
            parts = self.keys.split(ev.key)
            if ev.kind != "put" or len(parts) != 3 or parts[2] != "verdict":
                continue
            value = json.loads(ev.value)
            self.events.append((time.time(), parts[1], str(value["kind"]), float(value["at"])))

    def dead(self, since: float = 0.0, until: float = math.inf) -> list[tuple[str, float]]:
        """(node, at) of the DEAD verdicts seen between ``since`` and ``until``."""
        return [(n, at) for seen, n, kind, at in list(self.events)
                if kind == "DEAD" and since <= seen < until]

    def count(self, kind: str, since: float = 0.0, until: float = math.inf) -> int:
        """Verdicts of ``kind`` seen between ``since`` and ``until``."""
        return sum(1 for seen, _, k, _ in list(self.events) if k == kind and since <= seen < until)

    def close(self) -> None:
        """Stop watching."""
        self._stop.set()
        self._watch.cancel()
        self._thread.join(timeout=5)


def udp_drops(ports: set[int]) -> int:
    """Datagrams the kernel dropped at the UDP sockets bound to these ports (/proc/net/udp)."""
    total = 0
    try:
        lines = Path("/proc/net/udp").read_text().splitlines()[1:]
    except OSError:
        return 0
    for line in lines:
        fields = line.split()
        if int(fields[1].rpartition(":")[2], 16) in ports:
            total += int(fields[-1])
    return total


def accepted(metrics_port: int) -> float | None:
    """The coordinator's count of accepted datagrams (Prometheus text), None if not exported."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith('raps_coordinator_heartbeats_total{result="accepted"}'):
            return float(line.split()[-1])
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its children so far (every thread;
    the coordinator's receiver processes count as the coordinator's)."""
    proc = psutil.Process(pid)
    total = 0.0
    for p in (proc, *proc.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); with 10 values p99 is the maximum."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# --------------------------------------------------------------------------- load process


class _Load:
    """The load process's state: sockets, counters, the send schedule (no threads)."""

    def __init__(self, nodes: int, key: bytes) -> None:
        self.nodes = nodes
        self.names = [node_name(i).encode() for i in range(nodes)]
        self.keys = [node_key(key, node_name(i)) for i in range(nodes)]  # as agents hold them
        self.macs = [hmac.new(k, digestmod=hashlib.sha256) for k in self.keys]  # copied per use
        self.index = {name.decode(): i for i, name in enumerate(self.names)}
        self.tails = [bytes((len(n),)) + n for n in self.names]  # name length + name
        self.incarnation = new_incarnation()
        self.counters = [0] * nodes
        self.stopped = bytearray(nodes)
        self.socks: list[socket.socket] = []
        for _ in range(math.ceil(nodes / PER_SOCKET)):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            s.bind(("127.0.0.1", 0))
            s.setblocking(False)
            self.socks.append(s)
        self.target: tuple[str, int] = ("127.0.0.1", 0)
        self.stats = {"sent": 0, "send_errors": 0, "acks": 0, "probes_answered": 0,
                      "probes_ignored": 0, "other": 0, "skipped_late": 0}
        self.max_lag = 0.0

    def datagram(self, i: int, probe_reply: bool = False) -> bytes:
        """Node ``i``'s next heartbeat, signed (the layout of heartbeat.encode, built faster)."""
        self.counters[i] += 1
        body = (_HB_HEADER + _HB.pack(self.incarnation, self.counters[i], time.time(),
                                      1 if probe_reply else 0) + self.tails[i])
        mac = self.macs[i].copy()
        mac.update(body)
        return body + mac.digest()

    def check_format(self) -> None:
        """Fail early if the fast encoder drifted from heartbeat.py's format."""
        msg = decode(self.datagram(0), self.keys[0])
        if not (isinstance(msg, Heartbeat) and msg.node == node_name(0)
                and msg.counter == self.counters[0]):
            raise RuntimeError(f"load encoder out of date: decoded {msg!r}")

    def send(self, i: int) -> None:
        try:
            self.socks[i // PER_SOCKET].sendto(self.datagram(i), self.target)
            self.stats["sent"] += 1
        except OSError:
            self.stats["send_errors"] += 1

    def drain(self, s: socket.socket) -> None:
        """Read everything pending on ``s``: count acks, answer probes of running nodes."""
        stats = self.stats
        while True:
            try:
                data = s.recv(2048)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            kind = data[4] if len(data) > 4 else 0
            if kind == KIND_ACK:
                stats["acks"] += 1
                continue
            if kind != KIND_PROBE:
                stats["other"] += 1
                continue
            try:
                i = self.index.get(claimed_node(data))
                msg = decode(data, self.keys[i]) if i is not None else None
            except BadDatagram:
                stats["other"] += 1
                continue
            i = i if isinstance(msg, Probe) else None
            if i is None or self.stopped[i]:
                stats["probes_ignored"] += 1
                continue
            try:  # from the node's own socket, as an agent answers
                s.sendto(self.datagram(i, probe_reply=True), self.target)
                stats["probes_answered"] += 1
                stats["sent"] += 1
            except OSError:
                stats["send_errors"] += 1

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.stats)
        out["max_lag_s"], out["time"] = round(self.max_lag, 4), time.time()
        self.max_lag = 0.0
        return out


def _load_main(conn: Connection, nodes: int, key: bytes) -> None:
    """Entry of the load process: ("ports", [...]) first, then commands from ``conn``.

    Commands: ("go", port) starts sending to 127.0.0.1:port (answers the wall time);
    ("snapshot",) answers the
    counters; ("stop", [i, ...]) stops those nodes at once and answers the wall time;
    ("quit",) ends. Nothing else runs here, so the send schedule only waits for select.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us with "quit"
    load = _Load(nodes, key)
    load.check_format()
    conn.send(("ports", [s.getsockname()[1] for s in load.socks]))
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ, None)
    for s in load.socks:
        sel.register(s, selectors.EVENT_READ, s)
    started: float | None = None
    seq = 0  # heartbeats scheduled so far: the one of node seq % N is due at started + seq / N
    while True:
        if started is not None:
            due = int((time.monotonic() - started) * nodes)
            lag = (due - seq) / nodes
            load.max_lag = max(load.max_lag, lag)
            if lag > 0.5:  # stalled: skip, as a paused agent does, rather than burst
                load.stats["skipped_late"] += due - seq
                seq = due
            while seq < due:
                i = seq % nodes
                seq += 1
                if not load.stopped[i]:
                    load.send(i)
            timeout: float | None = max(0.0, started + (seq + 1) / nodes - time.monotonic())
        else:
            timeout = None
        for sk, _ in sel.select(timeout):
            if sk.data is not None:
                load.drain(sk.data)
                continue
            cmd = conn.recv()
            if cmd[0] == "go":
                load.target, started = ("127.0.0.1", int(cmd[1])), time.monotonic()
                conn.send(time.time())
            elif cmd[0] == "snapshot":
                conn.send(load.snapshot())
            elif cmd[0] == "stop":
                for i in cmd[1]:
                    load.stopped[i] = 1
                conn.send(time.time())
            else:
                for s in load.socks:
                    s.close()
                return


class LoadProcess:
    """The parent's handle on the load process (spawned: its own interpreter)."""

    def __init__(self, nodes: int, key: bytes) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_load_main, args=(child, nodes, key),
                                name="raps-bench-load", daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            raise RuntimeError("the load process did not start within 60 s")
        self.ports: list[int] = list(self.conn.recv()[1])

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def ask(self, *cmd: Any) -> Any:
        """Send one command, return the answer (30 s at most)."""
        self.conn.send(cmd)
        if not self.conn.poll(30):
            raise RuntimeError(f"the load process did not answer {cmd[0]!r} within 30 s")
        return self.conn.recv()

    def close(self) -> None:
        """Stop it (by its own pid only)."""
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("quit",))
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


# --------------------------------------------------------------------------- the benchmark


def _config(run_dir: Path, etcd_url: str, port: int) -> Path:
    """Production detection defaults, a fresh key, the coordinator on 127.0.0.1:port."""
    key = run_dir / "raps.key"
    create_key(str(key))
    data = {"detection": {"kernel_heartbeat_interval_sec": 1.0, "miss_threshold": 3,
                          "fence_margin_sec": 0.5, "lease_duration_sec": 15.0,
                          "cluster_key_file": str(key)},
            "store": {"endpoints": [etcd_url]},
            "coordinator": {"heartbeat_address": f"127.0.0.1:{port}",
                            "metrics_address": f"127.0.0.1:{port + 1}"},
            "logging": {"level": "INFO"}}
    path = run_dir / "raps.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _register(store: StateStore, keys: Keys, nodes: int, ports: list[int]) -> None:
    """``nodes/<name>`` for every synthetic node, ``MAX_TXN_OPS`` per transaction."""
    for first in range(0, nodes, MAX_TXN_OPS):
        ops = [Put(keys.node(node_name(i)), json.dumps({
            "node": node_name(i), "host": "127.0.0.1",
            "udp": f"127.0.0.1:{ports[i // PER_SOCKET]}"}).encode())
            for i in range(first, min(nodes, first + MAX_TXN_OPS))]
        store.transaction([], ops)


def run_heartbeats(nodes: int, seconds: int, port: int, receivers: int,
                   say: Callable[[str], None]) -> dict[str, Any]:
    """One raps-coordinator receiving N nodes' signed heartbeats at 1 Hz over loopback;
    progress lines go to ``say``. The JSON object of ``rapsctl bench heartbeats``."""
    run_dir = Path(tempfile.mkdtemp(prefix="raps-bench-hb-"))
    coordinator: subprocess.Popen[bytes] | None = None
    load: LoadProcess | None = None
    watch: VerdictWatch | None = None
    store: StateStore | None = None
    try:
        with EtcdServer() as etcd:
            try:
                cfg_path = _config(run_dir, etcd.url, port)
                cfg = load_file(cfg_path)
                store, keys = open_store(cfg.store)
                key = (run_dir / "raps.key").read_bytes()
                load = LoadProcess(nodes, key)
                started = time.monotonic()
                _register(store, keys, nodes, load.ports)
                say(f"registered {nodes} nodes in {time.monotonic() - started:.1f}s")
                watch = VerdictWatch(store, keys)
                log_path = run_dir / "coordinator.log"
                # An empty slurm.conf: every Slurm command fails at once (see the docstring).
                slurm_conf = run_dir / "slurm.conf"
                slurm_conf.touch()
                with open(log_path, "wb") as out:
                    coordinator = subprocess.Popen(
                        [sys.executable, "-m", "raps_slurm.coordinator", "--config",
                         str(cfg_path), "--name", "bench", "--user-address", "",
                         "--heartbeat-receivers", str(receivers)],
                        env={**os.environ, "SLURM_CONF": str(slurm_conf)},
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                s, k, proc = store, keys, coordinator
                wait_until("the coordinator to lead",
                           lambda: proc.poll() is not None or s.get(k.leader()) is not None,
                           timeout=60)
                if coordinator.poll() is not None:
                    raise BenchError(
                        f"the coordinator exited {coordinator.returncode}:\n"
                        + log_path.read_text(errors="replace")[-2000:])
                result = _measure(coordinator.pid, etcd.pid or 0, load, watch, nodes, seconds,
                                  port, say)
                result["receivers"] = receivers
                result["coordinator_alive"] = coordinator.poll() is None
                result["coordinator_log"] = _log_summary(log_path)
            finally:  # before etcd stops: the coordinator resigns through it
                _stop(coordinator, load, watch, store)
    except BaseException:
        print(f"bench heartbeats: run dir kept: {run_dir}", file=sys.stderr)
        raise
    shutil.rmtree(run_dir, ignore_errors=True)  # kept above when something failed
    return result


def _stop(coordinator: subprocess.Popen[bytes] | None, load: LoadProcess | None,
          watch: VerdictWatch | None, store: StateStore | None) -> None:
    """Stop what the benchmark started, each by its own handle."""
    if watch is not None:
        watch.close()
    if load is not None:
        load.close()
    if coordinator is not None and coordinator.poll() is None:
        coordinator.terminate()
        try:
            coordinator.wait(15)
        except subprocess.TimeoutExpired:
            coordinator.kill()
            coordinator.wait(5)
    if store is not None:
        store.close()


def _log_summary(path: Path) -> dict[str, int]:
    """Counts of the coordinator's log lines that matter here (it must not crash on Slurm)."""
    text = path.read_text(errors="replace")
    return {"lines": text.count("\n"), "slurm_errors": text.count("SlurmCommandError")
            + text.count("cannot read job states") + text.count("draining "),
            "tracebacks": text.count("Traceback"), "verdict_lines": text.count("verdict: ")}


def _measure(coordinator: int, etcd: int, load: LoadProcess, watch: VerdictWatch, nodes: int,
             seconds: int, port: int, say: Callable[[str], None]) -> dict[str, Any]:
    go = float(load.ask("go", port))
    say(f"load started; warm-up {WARMUP_S:.0f}s")
    time.sleep(WARMUP_S)
    ports = set(load.ports)
    pids = {"coordinator": coordinator, "etcd": etcd, "load": load.pid}
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    drops0 = (udp_drops({port}), udp_drops(ports))
    a = load.ask("snapshot")
    accepted0 = accepted(port + 1)
    for left in range(seconds, 0, -10):
        time.sleep(min(10, left))
        say(f"... {seconds - left + min(10, left)}s: {len(watch.dead(go))} DEAD verdicts so far")
    b = load.ask("snapshot")
    accepted1 = accepted(port + 1)
    cpu1 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    drops1 = (udp_drops({port}), udp_drops(ports))
    wall = float(b["time"] - a["time"])
    window_end = time.time()

    def rate(name: str) -> float:
        return round(float(b[name] - a[name]) / wall, 1)

    sent = b["sent"] - a["sent"]  # heartbeats and probe answers: all go to the coordinator
    coordinator_drops = drops1[0] - drops0[0]
    false_window = len(watch.dead(a["time"], window_end))
    # A crash of STOPPED nodes at once: the verdicts' "at" from the instant they went quiet.
    victims = random.sample(range(nodes), STOPPED)
    stopped_at = float(load.ask("stop", victims))
    names = {node_name(i) for i in victims}
    say(f"stopped {STOPPED} nodes; waiting for their DEAD verdicts")

    def found() -> dict[str, float]:
        return {n: at for n, at in watch.dead(stopped_at) if n in names}

    try:
        verdicts = wait_until("the stopped nodes' DEAD verdicts", found,
                              lambda v: len(v) == STOPPED, timeout=30, interval=0.05)
    except AssertionError:
        verdicts = found()
    latency = [at - stopped_at for at in verdicts.values()]
    acked = (b["acks"] - a["acks"]) / sent if sent else 0.0
    goals = (acked >= 0.99 and false_window == 0 and len(latency) == STOPPED
             and max(latency) <= BOUND_S)
    false_total = len([n for n, _ in watch.dead(go) if n not in names])
    after = load.ask("snapshot")
    return {
        "benchmark": "heartbeats", "nodes": nodes, "seconds": round(wall, 1),
        "warmup_s": WARMUP_S, "load_sockets": len(ports),
        "sent_per_s": rate("sent"), "probe_answers_per_s": rate("probes_answered"),
        "received_per_s": round((sent - coordinator_drops) / wall, 1),
        "accepted_per_s": (round((accepted1 - accepted0) / wall, 1)
                           if accepted0 is not None and accepted1 is not None else None),
        "acks_per_s": rate("acks"),
        "acked_share": round(acked, 5),
        "coordinator_socket_drops": coordinator_drops,
        "load_socket_drops": drops1[1] - drops0[1],
        "coordinator_cpu_percent": round((cpu1["coordinator"] - cpu0["coordinator"])
                                         / wall * 100, 1),
        "etcd_cpu_percent": round((cpu1["etcd"] - cpu0["etcd"]) / wall * 100, 1),
        "load_generator_cpu_percent": round((cpu1["load"] - cpu0["load"]) / wall * 100, 1),
        "load_max_lag_s": b["max_lag_s"], "load_skipped_late": b["skipped_late"],
        "probes_answered": b["probes_answered"] - a["probes_answered"],
        "false_verdicts": false_window, "false_verdicts_whole_run": false_total,
        "alive_verdicts": watch.count("ALIVE", go),
        "stopped": STOPPED, "dead_found": len(latency),
        "verdict_latency_p50_s": round(statistics.median(latency), 3) if latency else None,
        "verdict_latency_p99_s": round(percentile(latency, 99), 3) if latency else None,
        "verdict_latency_max_s": round(max(latency), 3) if latency else None,
        "bound_s": BOUND_S, "goals_met": goals,
        "probes_ignored_after_stop": after["probes_ignored"],
        "python": sys.version.split()[0], "cpus": os.cpu_count(),
    }
