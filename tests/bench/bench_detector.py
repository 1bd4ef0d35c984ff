"""Benchmark: the failure detector under loss and jitter, on a virtual clock; prints JSON.

    python tests/bench/bench_detector.py [--node-minutes 1000000] [--nodes 2000]
        [--loss 0.3] [--jitter 0.3] [--seed 1] [--crashes 10000] [--tick PROBE_INTERVAL]

A discrete-event simulation drives the real ``core.detector.Detector`` with the default
``DetectionConfig`` (1 s heartbeats, 3 strikes, 0.5 s fence margin). Every node's agent
sends a heartbeat each interval at its own phase; the leader acks each one it receives;
an agent without an ack after interval/3 resends once. Probes are a request and a reply.
Every heartbeat, ack, probe request and probe reply is lost with ``--loss`` and delayed
by a uniform 0..``--jitter`` s. The coordinator ticks every ``--tick`` s: ``tick()``, then
one probe per node ``probes_due()`` names; it reports an answer when it arrives and an
unanswered probe after ``probe_timeout``.

``--crashes`` nodes crash at random times (they stop sending and answering; datagrams
already in flight still arrive) and restart shortly after their DEAD verdict; the
latency is verdict time - crash time. A DEAD verdict for a node that is up is a false
DEAD. ``fence_silences`` counts the heartbeat silences of live nodes that were long enough
for conditions (a)-(c): only the probes stood between those nodes and a false DEAD, and
``expected_false_dead`` = fence_silences x P(probe fails)^K is what the maths predicts.

Events live in a calendar queue of ``--tick``-wide buckets (each sorted when its turn
comes), crash bookkeeping in a heapq: every datagram is simulated, nothing is sampled.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import platform
import random
import statistics
import time
from collections import Counter

from raps_slurm.config import DetectionConfig
from raps_slurm.core.detector import Detector, DetectorSettings

HEARTBEAT, ANSWER, TIMEOUT = 0, 1, 2          # bucket event kinds
RESTART, CHECK = 0, 1                          # crash-heap event kinds
HORIZON = 60.0                                 # a crash not declared DEAD by then is missed
SPACING = 120.0                                # between two crashes of one node


def plan_crashes(rng: random.Random, nodes: int, count: int, start: float,
                 end: float) -> list[list[float]]:
    """Per node, sorted crash times at least SPACING apart."""
    per: list[list[float]] = [[] for _ in range(nodes)]
    placed = 0
    for _ in range(count * 20):
        if placed == count:
            break
        t, i = rng.uniform(start, end), rng.randrange(nodes)
        if all(abs(t - c) >= SPACING for c in per[i]):
            per[i].append(t)
            placed += 1
    for times in per:
        times.sort(reverse=True)  # pop() gives the next one
    return per


def run(a: argparse.Namespace) -> dict[str, object]:
    settings = DetectorSettings.from_config(DetectionConfig())
    rng = random.Random(a.seed)
    rnd = rng.random
    n = a.nodes
    interval, W, F = settings.interval, settings.miss_window, settings.fence_margin
    T, K = settings.probe_timeout, settings.probe_failures
    p, J = a.loss, a.jitter
    third = interval / 3
    tick = a.tick if a.tick > 0 else settings.probe_interval
    # Enough virtual time that the live node-minutes reach the target despite crashes.
    end = (60.0 * a.node_minutes + 10.0 * a.crashes) / n
    names = [f"n{i}" for i in range(n)]
    index = {name: i for i, name in enumerate(names)}
    phase = [rnd() * interval for _ in range(n)]

    crashes = plan_crashes(rng, n, a.crashes, 10 * interval, end - HORIZON)
    inf = math.inf
    down_start = [c.pop() if c else inf for c in crashes]
    down_end = [inf] * n
    ctl: list[tuple[float, int, int]] = [(t + HORIZON, CHECK, i)
                                          for i, t in enumerate(down_start) if t < inf]
    heapq.heapify(ctl)

    det = Detector(settings, 0.0)
    for name in names:
        det.watch(name, 0.0)
    hb, answer = det.heartbeat, det.probe_result

    inv = 1.0 / tick
    lookahead = 2 * interval + 2 * J + T
    ring_size = int(lookahead * inv) + 4
    ring: list[list[tuple[float, int, int, float]]] = [[] for _ in range(ring_size)]
    last_rx = [0.0] * n              # for fence_silences: last receipt, last acked send
    last_ack = [-inf] * n
    grace = det.grace_until
    silences = probes = resends = 0
    latencies: list[float] = []
    false_dead = missed = 0
    down_total = 0.0
    kinds: Counter[str] = Counter()

    next_base, k = 0.0, 0
    cur = 0
    while True:
        t_tick = (cur + 1) * tick
        if t_tick > end:
            break
        # Heartbeats of every period that starts before this bucket ends.
        while next_base < t_tick:
            for i in range(n):
                s = next_base + phase[i]
                if down_start[i] <= s < down_end[i]:
                    continue
                if rnd() >= p:
                    at = s + rnd() * J
                    j = int(at * inv)
                    ring[(j if j > cur else cur) % ring_size].append((at, HEARTBEAT, i, s))
                    if rnd() >= p and at + rnd() * J <= s + third:
                        continue  # ack back in time: no resend
                s2 = s + third
                if down_start[i] <= s2 < down_end[i]:
                    continue
                resends += 1
                if rnd() >= p:
                    at = s2 + rnd() * J
                    j = int(at * inv)
                    ring[(j if j > cur else cur) % ring_size].append((at, HEARTBEAT, i, s2))
            k += 1
            next_base = k * interval
        events = ring[cur % ring_size]
        ring[cur % ring_size] = []
        events.sort()
        for at, kind, i, x in events:
            if kind == HEARTBEAT:
                hb(names[i], x, at, acked=True)  # the leader acks every heartbeat it gets
                if at - last_rx[i] > W and at > last_ack[i] + W + F and at > grace:
                    silences += 1
                last_rx[i] = at
                if x > last_ack[i]:
                    last_ack[i] = x
            else:
                answer(names[i], kind == ANSWER, at, sent_at=x)
        # Crash bookkeeping, then the coordinator's tick.
        while ctl and ctl[0][0] <= t_tick:
            at, what, i = heapq.heappop(ctl)
            if what == RESTART:
                down_start[i] = crashes[i].pop() if crashes[i] else inf
                down_end[i] = inf
                if down_start[i] < inf:
                    heapq.heappush(ctl, (down_start[i] + HORIZON, CHECK, i))
            elif down_end[i] == inf and down_start[i] <= at:
                missed += 1
                down_end[i] = at
                down_total += at - down_start[i]
                last_rx[i] = inf
                heapq.heappush(ctl, (at, RESTART, i))
        for v in det.tick(t_tick):
            kinds[v.kind] += 1
            if v.kind != "DEAD":
                continue
            i = index[v.node]
            if down_start[i] <= v.at < down_end[i]:
                latencies.append(v.at - down_start[i])
                down_end[i] = v.at + 0.5 + rnd()   # the node restarts shortly after
                down_total += down_end[i] - down_start[i]
                last_rx[i] = inf                    # its silence is no live-node silence
                heapq.heappush(ctl, (down_end[i], RESTART, i))
            else:
                false_dead += 1
        lo = cur + 1
        for name in det.probes_due(t_tick):
            probes += 1
            i = index[name]
            back = inf
            if rnd() >= p:
                there = t_tick + rnd() * J
                if not down_start[i] <= there < down_end[i] and rnd() >= p:
                    back = there + rnd() * J
                    j = int(back * inv)
                    ring[(j if j > lo else lo) % ring_size].append((back, ANSWER, i, t_tick))
            if back - t_tick > T:  # unanswered within the timeout: reported failed
                fail = t_tick + T
                j = int(fail * inv)
                ring[(j if j > lo else lo) % ring_size].append((fail, TIMEOUT, i, t_tick))
        cur += 1

    f = 1 - (1 - p) ** 2
    lat = sorted(latencies)
    return {
        "benchmark": "detector",
        "node_minutes": round((n * end - down_total) / 60.0),
        "nodes": n, "virtual_s": round(end, 1),
        "loss": p, "jitter_s": J, "tick_s": tick,
        "interval_s": interval, "miss_threshold": settings.miss_threshold, "fence_margin_s": F,
        "probe_interval_s": settings.probe_interval, "probe_timeout_s": T,
        "probe_failures": K,
        "false_dead": false_dead,
        "fence_silences": silences,
        "expected_false_dead": float(f"{silences * f ** K:.3g}"),
        "crashes": len(latencies) + missed, "missed_crashes": missed,
        "detect_p50_s": round(statistics.median(lat), 3) if lat else None,
        "detect_p99_s": round(lat[int(0.99 * (len(lat) - 1))], 3) if lat else None,
        "detect_max_s": round(lat[-1], 3) if lat else None,
        "bound_s": W + F + interval,
        "goals_met": bool(false_dead == 0 and missed == 0 and lat
                          and statistics.median(lat) <= 3.5 and lat[-1] <= W + F + interval),
        "verdicts": dict(kinds),
        "resends": resends, "probes": probes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--node-minutes", type=float, default=1_000_000)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--loss", type=float, default=0.3, help="loss of every datagram")
    ap.add_argument("--jitter", type=float, default=0.3, help="uniform 0..JITTER s delay")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--crashes", type=int, default=10_000)
    ap.add_argument("--tick", type=float, default=0.0,
                    help="coordinator tick period (default: the probe interval)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    result = run(a)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["python"] = platform.python_version()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
