"""Failure detector: kernel heartbeats, probes and app heartbeats in, verdicts out; pure, no I/O.

The coordinator leader owns one :class:`Detector`. It feeds it verified heartbeats,
probe results and app heartbeats, sends the probes :meth:`Detector.probes_due` asks
for, and applies the :class:`Verdict` list each :meth:`Detector.tick` returns. Time
always comes in as ``now`` (seconds, one clock; a value earlier than one already
seen is taken as the latest seen), so the simulator and the tests drive the same code.

Node states
-----------
ALIVE -> SUSPECT when nothing was heard for more than ``suspect_after`` = 1.5 intervals:
a period's heartbeat, and its resend at interval/3 when the ack is late, normally
arrive well within half an interval of the send, so 1.5 intervals of silence means at
least one whole period (both copies) was lost. A heartbeat or an answered probe returns
a SUSPECT node to ALIVE. SUSPECT -> DEAD only when ALL of these hold:

(a) three strikes: ``now - last heartbeat received >= miss_window`` (interval x
    miss_threshold; silence counts from :meth:`Detector.watch` for a silent node);
(b) fencing: ``now >= send time of the last ACKED heartbeat + miss_window +
    fence_margin``. The ack promised the agent it may go on until that send time + the
    miss window, so by then its ranks have stopped by themselves; relaunching earlier
    could run two copies. The send time is used, not the receive time, because the
    agent counts from its own send (``sent_at`` later than ``now`` is clamped to ``now``:
    the send cannot follow the receipt; an agent clock behind ours by d makes this
    deadline d early, so fence_margin must cover the clock offsets the caller accepts).
    Unacked heartbeats prove life but move no deadline: the agent got no promise;
(c) new leader: no DEAD before this detector's start + miss_window + fence_margin. It
    cannot know which acks the previous leader sent, up to the moment it took over;
(d) second channel: at least ``probe_failures`` (K) probes sent during this suspicion
    were reported failed and none answered (an answer ends the suspicion). Failures
    count only against probes :meth:`Detector.probes_due` handed out in this suspicion,
    so a node the leader never probed is never declared dead.
A DEAD node heard from again (heartbeat or answered probe) gives one ALIVE verdict.

Probe maths (K, probe_interval, probe_timeout)
----------------------------------------------
Design point: interval I = 1 s, miss_threshold 3 (W = 3 s), fence_margin F = 0.5 s,
30 % independent loss and 0-300 ms delay on every datagram. A period goes unheard only
if the heartbeat and its resend are both lost: q = 0.3^2 = 0.09. (a)+(b) need about
three such periods in a row, q^3 = 7.3e-4 per period: some 4e4-6e4 times per 10^6
node-minutes (6e7 periods; the benchmark counts them as ``fence_silences``: 58,860).
Each of those silences is a false DEAD unless a probe gets through. A probe fails with
f = 1 - 0.7^2 = 0.51 (request or reply lost); the timeout T = 0.6 I covers the worst
round trip (2 x 300 ms), so a slow answer is never counted as a failure. With K = 29
failures required, the expected number of false DEAD verdicts is 6e4 x 0.51^29
= 6e4 x 3.3e-9 = 2e-4 per 10^6 node-minutes (at 5 % loss: below 1e-29).
Probes start at suspicion (last receipt + 1.5 I) and go out every probe_interval P, so
the K-th failure is known at last receipt + 1.5 I + (K-1) P + T. P is chosen so that
this equals W + F: P = (W + F - 1.5 I - T) / (K - 1) = 1.4 / 28 = 0.05 s = I/20. The
probes then cost no latency beyond (b) and the heartbeat delay: a crash right after a
send is declared DEAD at most 0.3 s (delay) + 3.5 s + the caller's tick after it, within
W + F + I = 4.5 s; a crash at a random phase of the period at about 3.2 s (median).
A shorter window (say miss_threshold 1) keeps P at I/20 and lets probes continue past
the fence deadline until K failures are in: a little latency for the same safety. The
model assumes independent losses; a link that drops everything at once is what (a)+(b)
alone are for, and epochs in the store are the guarantee against two copies anyway.

Probe budget: probes to all SUSPECT nodes together go out at most at
``PROBE_RATE_SHARE`` x watched nodes / I per second (at least ``MIN_PROBE_RATE``), with a
burst of ``PROBE_BURST_SEC`` of that rate. A coordinator overloaded by heartbeats drops
some; each drop makes a SUSPECT node, and 20 probes a second to each of them would add
more load than the heartbeats themselves (measured: at 100,000 nodes on one core,
30,000 probe answers a second on top of 63,000 heartbeats). Probes held back wait their
turn, oldest first: a DEAD verdict comes later (fewer failures counted per second),
never earlier, and never from probes that were not sent. At 50,000 nodes and 1 s the
budget is 25,000 probes a second, enough for 1,250 nodes suspected at once at full rate;
with 20 % of all nodes silent at once, their K failures take about 12 s instead of 1.4 s
(tests/unit/test_detector.py).

Contract for the caller: send a probe to every node :meth:`Detector.probes_due` returns
(call it at least every ``probe_interval`` while a node is SUSPECT; see
:meth:`Detector.next_wakeup`), report an answer with ``probe_result(alive=True)`` and a
probe unanswered after ``probe_timeout`` with ``probe_result(alive=False)``.

Ranks
-----
A rank is HUNG when its node is ALIVE and either

- it sent no app heartbeat for ``app_miss_threshold x app_interval``, or for three times
  that when its last heartbeat said it is blocked on a peer (a rank waiting for a peer is
  the peer's problem, but a waiting process keeps heartbeating from its own thread: one
  silent that long is stopped or stuck itself); or
- it keeps heartbeating but its step has not changed for ``progress_window`` while it was
  not waiting for a peer: a deadlocked or spinning application thread. The heartbeats
  come from a runtime thread, so only the step, which the application itself reports,
  tells a live process from a working one. A rank that never reported a step above 0 is
  not judged by progress (its program does not report any), and time spent waiting for a
  peer counts as progress (the peer is judged, not the waiter). The window is the rank's
  own time: the time its main thread waited for a CPU (reported by its agent) is added,
  up to ``MAX_STRETCH`` x the window (:mod:`raps_slurm.core.liveness`): a starved rank
  falls behind, it is not stuck.

A rank whose process is on or waiting for a CPU is reported by its agent even when its
heartbeats stop (its heartbeat thread starved), so silence means stopped or stuck.

A rank on a SUSPECT or DEAD node is never HUNG: its heartbeats travel through that
node's agent. Nor is one whose node has not been heard from since the rank's window
ended (a crashed node's ranks fall silent with it, before the node is SUSPECT). After
a DEAD node comes back, its ranks' silence counts from its return (their old silence
says nothing about them). One HUNG verdict per silence.

Cost: a heartbeat is O(1) (ALIVE nodes sit in an OrderedDict ordered by last proof of
life, so a tick looks at the oldest only); SUSPECT nodes and rank deadlines use heaps.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Literal

# re-exported: the coordinator, the simulator and the tests take these from here
from raps_slurm.core.detector_settings import PROBE_FAILURES as PROBE_FAILURES
from raps_slurm.core.detector_settings import PROGRESS_STRIKES as PROGRESS_STRIKES
from raps_slurm.core.detector_settings import DetectorSettings as DetectorSettings
from raps_slurm.core.detector_settings import probe_plan as probe_plan
from raps_slurm.core.liveness import progress_due, waited_delta

PROBE_RATE_SHARE = 0.5          # probe budget per second, as a share of watched nodes / I
MIN_PROBE_RATE = 1000.0         # probes a second allowed however few nodes are watched
PROBE_BURST_SEC = 0.1           # budget that may accumulate while no probe is due
_EPS = 1e-6  # a caller ticking every probe_interval must not miss a slot by a rounding error
_INF = math.inf

VerdictKind = Literal["DEAD", "HUNG", "ALIVE"]
BLOCKED_FACTOR = 3  # a rank blocked on a peer may be silent this many app windows
RankKey = tuple[str, int]


class NodeHealth(StrEnum):
    """What the detector thinks of a node (a str: ``NodeHealth.DEAD == "DEAD"``)."""

    ALIVE = "ALIVE"
    SUSPECT = "SUSPECT"
    DEAD = "DEAD"


def _no_evidence() -> Mapping[str, object]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Verdict:
    """A decision about a node (DEAD, ALIVE = heard from again) or a rank (HUNG)."""

    kind: VerdictKind
    node: str
    at: float
    job: str | None = None
    rank: int | None = None
    evidence: Mapping[str, object] = field(default_factory=_no_evidence, hash=False)


@dataclass(slots=True, eq=False)
class _Node:
    """Mutable per-node state (internal)."""

    name: str
    watched_at: float
    last_seen: float                  # newest proof of life: heartbeat, answer, watch
    health: NodeHealth = NodeHealth.ALIVE
    last_rx: float = -_INF            # receive time of the newest heartbeat
    last_sent: float = -_INF          # newest heartbeat send time
    last_acked: float = -_INF         # newest send time of an acked heartbeat
    heartbeats: int = 0
    episode: int = 0                  # new on every state change: stale timers are ignored
    suspect_since: float | None = None
    probes_sent: int = 0              # in the current (or last) suspicion
    probes_failed: int = 0
    next_probe: float = _INF
    wake: float = _INF                # time of this node's one valid timer entry
    dead_since: float | None = None
    recovered_at: float = -_INF       # last DEAD -> ALIVE


@dataclass(slots=True, eq=False)
class _Rank:
    """Mutable per-rank state (internal)."""

    node: str
    step: int
    blocked_on: int | None
    last_at: float
    gen: int                          # new per heartbeat: stale deadlines are ignored
    hung: bool = False
    progress_at: float = 0.0          # last step change, or last report while blocked
    stalled: float | None = None      # the progress_at a HUNG verdict was given for
    waited_ms: int | None = None      # the last run-delay counter reported (wire units)
    waited: float = 0.0               # seconds waited for a CPU since progress_at


class Detector:
    """Failure detector of one coordinator leader (see the module docstring)."""

    def __init__(self, settings: DetectorSettings, now: float) -> None:
        self.settings = settings
        self.started_at = now
        self.grace_until = now + settings.miss_window + settings.fence_margin
        self._now = now
        self._nodes: dict[str, _Node] = {}
        self._alive: OrderedDict[str, _Node] = OrderedDict()   # oldest proof of life first
        self._suspects: dict[str, _Node] = {}
        self._probe_ready: dict[str, None] = {}                # ordered set, awaiting probes_due
        self._probe_tokens = MIN_PROBE_RATE * PROBE_BURST_SEC  # the probe budget (see above)
        self._tokens_at = now
        self._timers: list[tuple[float, int, str, int]] = []    # (wake, seq, node, episode)
        self._ranks: dict[RankKey, _Rank] = {}
        self._finished: frozenset[RankKey] = frozenset()  # never watched while in it
        self._rank_timers: list[tuple[float, int, RankKey, int]] = []  # (due, seq, key, gen)
        self._parked: dict[str, set[tuple[RankKey, int]]] = {}  # overdue ranks, node not ALIVE
        self._seq = itertools.count()
        self._verdicts: list[Verdict] = []

    # ------------------------------------------------------------------ inputs

    def watch(self, node: str, now: float) -> None:
        """Start tracking ``node`` (registered); its silence counts from ``now``. Idempotent."""
        now = self._clock(now)
        if node in self._nodes:
            return
        n = _Node(node, watched_at=now, last_seen=now)
        self._nodes[node] = n
        self._alive[node] = n
        self._release(node, now)

    def forget(self, node: str) -> None:
        """Stop tracking ``node`` (deregistered); pending verdicts stay."""
        n = self._nodes.pop(node, None)
        if n is None:
            return
        n.episode = next(self._seq)
        self._alive.pop(node, None)
        self._suspects.pop(node, None)
        self._probe_ready.pop(node, None)
        self._parked.pop(node, None)

    def heartbeat(self, node: str, sent_at: float, now: float, *, acked: bool) -> None:
        """A verified heartbeat sent at ``sent_at``, received ``now``; ``acked`` if we acked it.

        Heartbeats of nodes not watched are ignored: a stray datagram from a node that
        was forgotten must not make the detector track it (and later call it dead).
        """
        n = self._nodes.get(node)
        if n is None:
            return
        if now < self._now:
            now = self._now
        else:
            self._now = now
        sent = sent_at if sent_at < now else now
        n.last_rx = n.last_seen = now
        n.heartbeats += 1
        if sent > n.last_sent:
            n.last_sent = sent
        if acked and sent > n.last_acked:
            n.last_acked = sent
        if n.health is NodeHealth.ALIVE:
            self._alive.move_to_end(node)
        else:
            self._revive(n, now, "heartbeat")

    def probe_result(self, node: str, alive: bool, now: float, *,
                     sent_at: float | None = None) -> None:
        """The outcome of one probe: answered (``alive``) or unanswered after probe_timeout.

        A failure counts only against a probe handed out in the current suspicion; pass
        the probe's ``sent_at`` so a late failure of an older probe is not counted.
        An answer is proof of life whenever the probe was sent.
        """
        n = self._nodes.get(node)
        if n is None:
            return
        now = self._clock(now)
        if alive:
            n.last_seen = now
            if n.health is NodeHealth.ALIVE:
                self._alive.move_to_end(node)
            else:
                self._revive(n, now, "probe")
            return
        if n.health is not NodeHealth.SUSPECT or n.probes_failed >= n.probes_sent:
            return
        if sent_at is not None and n.suspect_since is not None \
                and sent_at < n.suspect_since - _EPS:
            return
        n.probes_failed += 1
        self._service(n, now)

    def app_heartbeat(self, job: str, rank: int, node: str, step: int, blocked_on: int | None,
                      now: float, waited_ms: int | None = None) -> None:
        """An app heartbeat of ``(job, rank)`` running on ``node`` (relayed by its agent),
        with its main thread's run-delay counter (``RankProgress.waited_ms``) if known."""
        now = self._clock(now)
        key = (job, rank)
        if key in self._finished:
            return  # a finished rank heartbeats until it closes: not watched
        r = self._ranks.get(key)
        if r is None:
            r = self._ranks[key] = _Rank(node, step, blocked_on, now, next(self._seq),
                                         progress_at=now, waited_ms=waited_ms)
        else:
            if step != r.step or node != r.node or blocked_on is not None \
                    or r.blocked_on is not None:  # waiting, or just done waiting
                r.progress_at, r.waited = now, 0.0
            elif waited_ms is not None and r.waited_ms is not None:
                r.waited += waited_delta(r.waited_ms, waited_ms, now - r.last_at,
                                         self.settings.app_window)
            r.waited_ms = waited_ms
            r.node, r.step, r.blocked_on, r.last_at = node, step, blocked_on, now
            r.gen = next(self._seq)
            r.hung = False
        heapq.heappush(self._rank_timers, (self._rank_due(r), next(self._seq), key, r.gen))

    def _rank_due(self, r: _Rank, since: float = -_INF) -> float:
        """When ``r`` is next due for a HUNG check: the end of its silence window, or
        sooner the end of its progress window (if it reports progress at all)."""
        window = self.settings.app_window * (1 if r.blocked_on is None else BLOCKED_FACTOR)
        due = max(r.last_at, since) + window
        if self._judged_by_progress(r):
            due = min(due, progress_due(max(r.progress_at, since), r.waited,
                                        self.settings.progress_window))
        return due

    @staticmethod
    def _judged_by_progress(r: _Rank) -> bool:
        return r.step > 0 and r.blocked_on is None and r.stalled != r.progress_at

    def step_of(self, job: str, rank: int) -> int | None:
        """The last step ``(job, rank)`` reported, None if it reported none (or finished)."""
        r = self._ranks.get((job, rank))
        return None if r is None else r.step

    def ranks_finished(self, ranks: frozenset[RankKey]) -> None:
        """The ranks that finished their program in their current epoch (the whole set each
        time): one new in it stops being watched, once, and its heartbeats are ignored; one
        that left it (relaunched) is watched again from its next heartbeat."""
        if ranks is not self._finished:
            for key in ranks - self._finished:
                self._ranks.pop(key, None)
            self._finished = ranks

    # ------------------------------------------------------------------ decisions

    def probe_rate(self) -> float:
        """Probes per second the budget allows (all SUSPECT nodes together)."""
        return max(MIN_PROBE_RATE, PROBE_RATE_SHARE * len(self._nodes) / self.settings.interval)

    def probes_due(self, now: float) -> list[str]:
        """SUSPECT nodes to probe now, each at most once per probe_interval, within the
        probe budget (the longest waiting first; the others stay due)."""
        now = self._advance(now)
        rate = self.probe_rate()
        self._probe_tokens = min(max(1.0, rate * PROBE_BURST_SEC),
                                 self._probe_tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        ready = self._probe_ready
        take = min(len(ready), int(self._probe_tokens + _EPS))
        due = list(itertools.islice(ready, take))
        self._probe_tokens -= take
        for name in due:
            del ready[name]
        for name in due:
            n = self._suspects[name]
            n.probes_sent += 1
            n.next_probe = now + self.settings.probe_interval
            self._schedule(n, now)
        return due

    def tick(self, now: float) -> list[Verdict]:
        """Verdicts reached since the last tick, each exactly once."""
        now = self._advance(now)
        self._check_ranks(now)
        out, self._verdicts = self._verdicts, []
        return out

    def health(self, node: str) -> NodeHealth:
        """The node's state as of the last tick/probes_due; KeyError if not watched."""
        return self._nodes[node].health

    def next_wakeup(self) -> float | None:
        """Earliest time tick/probes_due may have work (may be early, never late); None = idle."""
        if self._probe_ready:  # at once, or when the budget allows one more
            return self._now + max(0.0, (1.0 - self._probe_tokens) / self.probe_rate())
        times = [self._timers[0][0]] if self._timers else []
        if self._rank_timers:
            times.append(self._rank_timers[0][0])
        if self._alive:
            oldest = next(iter(self._alive.values()))
            times.append(oldest.last_seen + self.settings.suspect_after)
        return min(times) if times else None

    def snapshot(self, now: float) -> dict[str, dict[str, object]]:
        """Per node: health, heartbeat ages, misses, fence deadline, probes, ranks (read only)."""
        ranks: dict[str, list[str]] = {}
        hung: dict[str, list[str]] = {}
        for (job, rank), r in self._ranks.items():
            ranks.setdefault(r.node, []).append(f"{job}.{rank}")
            if r.hung:
                hung.setdefault(r.node, []).append(f"{job}.{rank}")
        out: dict[str, dict[str, object]] = {}
        for name, n in self._nodes.items():
            entry = self._evidence(n, now)
            entry["health"] = n.health.value
            entry["last_heartbeat_age_s"] = _finite(now - n.last_rx)
            entry["heartbeats"] = n.heartbeats
            entry["ranks"] = len(ranks.get(name, ()))
            entry["hung_ranks"] = sorted(hung.get(name, ()))
            out[name] = entry
        return out

    # ------------------------------------------------------------------ internals

    def _clock(self, now: float) -> float:
        """Monotonic view of the caller's clock."""
        if now > self._now:
            self._now = now
        return self._now

    def _advance(self, now: float) -> float:
        """ALIVE -> SUSPECT transitions and due SUSPECT timers, up to ``now``."""
        now = self._clock(now)
        limit = now - self.settings.suspect_after
        alive = self._alive
        while alive:
            n = next(iter(alive.values()))
            if n.last_seen >= limit:
                break  # ordered by last_seen: every other ALIVE node is younger
            alive.popitem(last=False)
            n.health = NodeHealth.SUSPECT
            n.episode = next(self._seq)
            n.suspect_since = now
            n.probes_sent = n.probes_failed = 0
            n.next_probe = now
            n.wake = _INF
            self._suspects[n.name] = n
            self._service(n, now)
        timers = self._timers
        while timers and timers[0][0] <= now + _EPS:
            wake, _, name, episode = heapq.heappop(timers)
            s = self._suspects.get(name)
            if s is not None and s.episode == episode and s.wake == wake:
                s.wake = _INF
                self._service(s, now)
        return now

    def _dead_ready(self, n: _Node) -> float:
        """Earliest time (a), (b) and (c) all hold."""
        s = self.settings
        silent_from = max(n.last_rx, n.watched_at)
        return max(silent_from + s.miss_window, n.last_acked + s.miss_window + s.fence_margin,
                   self.grace_until)

    def _service(self, n: _Node, now: float) -> None:
        """Re-check one SUSPECT node: DEAD, probe due, or its next timer."""
        if n.probes_failed >= self.settings.probe_failures and now >= self._dead_ready(n):
            self._verdicts.append(Verdict("DEAD", n.name, now, evidence=MappingProxyType(
                self._evidence(n, now))))
            n.health = NodeHealth.DEAD
            n.dead_since = now
            n.episode = next(self._seq)
            del self._suspects[n.name]
            self._probe_ready.pop(n.name, None)
            return
        if n.next_probe <= now + _EPS:
            self._probe_ready[n.name] = None
        self._schedule(n, now)

    def _schedule(self, n: _Node, now: float) -> None:
        """Keep exactly one valid timer for a SUSPECT node (probe slot or DEAD deadline)."""
        wake = _INF if n.name in self._probe_ready else n.next_probe
        if n.probes_failed >= self.settings.probe_failures:
            # Strictly in the future, or _advance would pop it again in the same call.
            wake = min(wake, max(self._dead_ready(n), now + 2 * _EPS))
        if wake != n.wake and wake < _INF:
            n.wake = wake
            heapq.heappush(self._timers, (wake, next(self._seq), n.name, n.episode))

    def _revive(self, n: _Node, now: float, source: str) -> None:
        """A SUSPECT or DEAD node heard from: back to ALIVE (one ALIVE verdict if DEAD)."""
        if n.health is NodeHealth.DEAD:
            self._verdicts.append(Verdict("ALIVE", n.name, now, evidence=MappingProxyType({
                "source": source, "dead_since": n.dead_since,
                "down_s": now - (n.dead_since if n.dead_since is not None else now)})))
            n.recovered_at = now
        else:
            self._suspects.pop(n.name, None)
            self._probe_ready.pop(n.name, None)
        n.health = NodeHealth.ALIVE
        n.episode = next(self._seq)
        n.wake = _INF
        self._alive[n.name] = n  # last_seen == now: the newest, so the order holds
        self._release(n.name, now)

    def _release(self, node: str, now: float) -> None:
        """Overdue ranks parked while ``node`` was not ALIVE: check them at the next tick."""
        for key, gen in self._parked.pop(node, ()):
            heapq.heappush(self._rank_timers, (now, next(self._seq), key, gen))

    def _check_ranks(self, now: float) -> None:
        """HUNG verdicts for ranks whose deadline passed."""
        timers = self._rank_timers
        while timers and timers[0][0] <= now:
            _, _, key, gen = heapq.heappop(timers)
            r = self._ranks.get(key)
            if r is None or r.gen != gen or r.hung:
                continue
            n = self._nodes.get(r.node)
            since = -_INF if n is None else n.recovered_at
            due = self._rank_due(r, since)
            if due > now:
                heapq.heappush(timers, (due, next(self._seq), key, gen))
                continue
            if n is None or n.health is not NodeHealth.ALIVE:
                self._parked.setdefault(r.node, set()).add((key, gen))
                continue
            if n.last_seen < due:
                # The node has not been heard from since the rank's window ended, and its
                # agent carries the rank's heartbeats: a crashed node's ranks fall silent
                # with it, up to SUSPECT_AFTER_INTERVALS before the node is SUSPECT, and
                # were judged HUNG (relaunched on the dead node) first. Judged again once
                # the node speaks, or parked when it turns SUSPECT.
                heapq.heappush(timers, (now + self.settings.interval / 4, next(self._seq),
                                        key, gen))
                continue
            window = self.settings.app_window * (1 if r.blocked_on is None else BLOCKED_FACTOR)
            start = max(r.last_at, since)
            evidence: dict[str, object] = {"last_app_heartbeat_at": r.last_at, "step": r.step}
            if start + window <= now:
                evidence.update(silence_s=now - start, app_window_s=window)
                r.stalled = r.progress_at  # one verdict per stall, however it was found
            else:  # heartbeating, but the step stood still: the application is stuck
                evidence.update(reason="no progress", progress_at=r.progress_at,
                                stalled_s=now - max(r.progress_at, since), waited_s=r.waited,
                                progress_window_s=self.settings.progress_window)
                r.stalled = r.progress_at
            r.hung = True
            self._verdicts.append(Verdict("HUNG", r.node, now, job=key[0], rank=key[1],
                                          evidence=MappingProxyType(evidence)))

    def _evidence(self, n: _Node, now: float) -> dict[str, object]:
        """What a DEAD verdict (or a snapshot) rests on; unknown times are left out."""
        s = self.settings
        silence = max(0.0, now - max(n.last_rx, n.watched_at))
        out: dict[str, object] = {
            "silence_s": silence, "misses": int(silence // s.interval),
            "probes_sent": n.probes_sent, "probes_failed": n.probes_failed,
            "probes_required": s.probe_failures, "grace_until": self.grace_until,
            "dead_not_before": self._dead_ready(n)}
        optional = {"last_heartbeat_sent_at": n.last_sent, "last_heartbeat_received_at": n.last_rx,
                    "last_acked_sent_at": n.last_acked,
                    "fence_deadline": n.last_acked + s.miss_window + s.fence_margin}
        out.update({k: v for k, v in optional.items() if v > -_INF})
        if n.suspect_since is not None:
            out["suspect_since"] = n.suspect_since
        return out


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
