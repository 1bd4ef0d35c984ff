"""Failure detector (raps_slurm.core.detector): node states, DEAD conditions, probes, HUNG.

A fake leader loop (``Leader``) ticks the detector every 50 ms on exact decimal times,
delivers heartbeats and probe results at their own times, sends every probe the detector
asks for and reports it answered or failed by a script. Most tests use ``FAST`` probing
(K = 3 failures) so that one DEAD condition at a time can be made the last to hold.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raps_slurm.config import DetectionConfig
from raps_slurm.core.detector import (
    PROBE_FAILURES,
    Detector,
    DetectorSettings,
    NodeHealth,
    Verdict,
    probe_plan,
)

FAST = DetectorSettings(interval=1.0, miss_threshold=3, fence_margin=0.5, app_interval=10.0,
                        app_miss_threshold=5, probe_interval=0.1, probe_timeout=0.2,
                        probe_failures=3)
STEP = 0.05
ALIVE, SUSPECT, DEAD = NodeHealth.ALIVE, NodeHealth.SUSPECT, NodeHealth.DEAD

Answer = Callable[[str, float], "bool | None"]  # True answered, False failed, None: no report


def never(node: str, t: float) -> bool | None:
    return False


class Leader:
    """A fake coordinator loop around one Detector (see the module docstring)."""

    def __init__(self, cfg: DetectorSettings = FAST, *, started: float = -100.0,
                 nodes: Iterable[str] = ("n1",), answer: Answer = never,
                 probing: bool = True) -> None:
        self.cfg = cfg
        self.det = Detector(cfg, started)
        self.k = 0
        self.answer, self.probing = answer, probing
        self.events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.verdicts: list[Verdict] = []
        self.probes: list[tuple[float, str]] = []
        self.results: list[tuple[float, str, bool, float]] = []  # delivered: at, node, ok, sent
        self.received: dict[str, list[tuple[float, float, bool]]] = {}  # node -> (rx, sent, acked)
        for n in nodes:
            self.det.watch(n, 0.0)

    @property
    def now(self) -> float:
        return round(self.k * STEP, 9)

    def _push(self, t: float, kind: str, *args: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, args))

    def beat(self, node: str, received: float, sent: float | None = None,
             acked: bool = True) -> None:
        self._push(received, "beat", node, received if sent is None else sent, acked)

    def beats(self, node: str, first: float, last: float, delay: float = 0.0,
              acked: bool = True) -> None:
        """One heartbeat a second sent at first..last, received ``delay`` later."""
        for i in range(round(last - first) + 1):
            self.beat(node, first + i + delay, first + i, acked)

    def app(self, at: float, job: str, rank: int, node: str, blocked_on: int | None = None,
            step: int = 1) -> None:
        self._push(at, "app", job, rank, node, step, blocked_on)

    def at(self, at: float, fn: Callable[[], None]) -> None:
        self._push(at, "call", fn)

    def run(self, until: float) -> list[Verdict]:
        """Advance to ``until``; returns the verdicts of this call."""
        new: list[Verdict] = []
        while self.now < until - 1e-9:
            self.k += 1
            t = self.now
            while self.events and self.events[0][0] <= t:
                at, _, kind, args = heapq.heappop(self.events)
                if kind == "beat":
                    node, sent, acked = args
                    self.received.setdefault(node, []).append((at, sent, acked))
                    self.det.heartbeat(node, sent, at, acked=acked)
                elif kind == "result":
                    node, alive, sent = args
                    self.results.append((at, node, alive, sent))
                    self.det.probe_result(node, alive, at, sent_at=sent)
                elif kind == "app":
                    self.det.app_heartbeat(*args, now=at)
                else:
                    args[0]()
            new += self.det.tick(t)
            if self.probing:
                for node in self.det.probes_due(t):
                    self.probes.append((t, node))
                    ok = self.answer(node, t)
                    if ok is not None:
                        self._push(t + (0.01 if ok else self.cfg.probe_timeout), "result",
                                   node, ok, t)
        self.verdicts += new
        return new

    def snap(self, node: str = "n1") -> dict[str, object]:
        return self.det.snapshot(self.now)[node]


def kinds(verdicts: Iterable[Verdict]) -> list[tuple[str, str, float]]:
    return [(v.kind, v.node, v.at) for v in verdicts]


# ---------------------------------------------------------------- settings


def test_settings_from_default_config_follow_the_probe_maths() -> None:
    s = DetectorSettings.from_config(DetectionConfig())
    assert (s.interval, s.miss_threshold, s.fence_margin) == (1.0, 3, 0.5)
    assert (s.app_interval, s.app_miss_threshold, s.app_window) == (10.0, 5, 50.0)
    assert s.miss_window == 3.0 and s.suspect_after == 1.5
    assert (s.probe_interval, s.probe_timeout, s.probe_failures) == (0.05, 0.6, PROBE_FAILURES)
    # The K-th failure is known exactly at the fence deadline (last receipt + W + F).
    k_th = s.suspect_after + (s.probe_failures - 1) * s.probe_interval + s.probe_timeout
    assert k_th == pytest.approx(s.miss_window + s.fence_margin)
    # 30 % loss per datagram: a probe fails with 0.51; K failures in a row are rarer than
    # 1e-8, so ~6e4 long silences per 10^6 node-minutes give < 1e-3 false DEAD.
    assert 0.51 ** s.probe_failures < 1e-8
    assert s == DetectorSettings(1.0, 3, 0.5, 10.0, 5)  # the dataclass defaults agree


def test_probe_plan_scales_with_the_interval_and_keeps_a_floor() -> None:
    assert probe_plan(2.0, 6.0, 1.0) == (0.1, 1.2)
    # A window too short for K probes: probe at I/20 and let DEAD wait for K failures.
    assert probe_plan(1.0, 1.0, 0.0) == (0.05, 0.6)
    # A long window spreads the probes out instead of sending more.
    interval, _ = probe_plan(1.0, 10.0, 0.5)
    assert interval == pytest.approx((10.5 - 1.5 - 0.6) / (PROBE_FAILURES - 1), abs=1e-6)


@pytest.mark.parametrize("field,value", [
    ("interval", 0.0), ("app_interval", -1.0), ("probe_interval", 0.0), ("probe_timeout", 0.0),
    ("miss_threshold", 0), ("app_miss_threshold", 0), ("probe_failures", 0),
    ("fence_margin", -0.1)])
def test_settings_reject_bad_values(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        replace(FAST, **{field: value})


# ---------------------------------------------------------------- node states


def test_alive_suspect_alive_without_verdicts() -> None:
    lead = Leader()
    lead.beat("n1", 0.0)
    lead.run(1.5)
    assert lead.det.health("n1") is ALIVE  # 1.5 s of silence is not yet "more than 1.5"
    lead.run(1.55)
    assert lead.det.health("n1") is SUSPECT
    assert lead.probes == [(1.55, "n1")]
    lead.beat("n1", 2.0)
    lead.run(2.0)
    assert lead.det.health("n1") is ALIVE
    assert lead.verdicts == []


def test_dead_when_every_condition_holds_once_with_evidence() -> None:
    lead = Leader()
    lead.beats("n1", 0.0, 10.0, delay=0.1)   # last: sent 10.0, received 10.1, acked
    lead.run(13.45)
    assert lead.verdicts == [] and lead.det.health("n1") is SUSPECT
    # (a) at 13.1, (b) at 10.0 + 3 + 0.5 = 13.5, K = 3 failures by ~12.05.
    assert kinds(lead.run(13.5)) == [("DEAD", "n1", 13.5)]
    v = lead.verdicts[0]
    assert v.job is None and v.rank is None
    ev = v.evidence
    assert ev["last_heartbeat_sent_at"] == 10.0 and ev["last_heartbeat_received_at"] == 10.1
    assert ev["last_acked_sent_at"] == 10.0 and ev["fence_deadline"] == 13.5
    assert ev["misses"] == 3 and ev["silence_s"] == pytest.approx(3.4)
    assert ev["probes_required"] == 3
    failed, sent = ev["probes_failed"], ev["probes_sent"]
    assert isinstance(failed, int) and isinstance(sent, int) and 3 <= failed <= sent
    assert ev["suspect_since"] == 11.65
    with pytest.raises(TypeError):
        ev["misses"] = 0  # type: ignore[index]
    lead.run(60.0)
    assert len(lead.verdicts) == 1 and lead.det.health("n1") is DEAD  # each verdict once
    assert [t for t, _ in lead.probes if t > 13.5] == []  # a DEAD node is not probed


def test_a_waits_for_the_last_heartbeat_even_unacked() -> None:
    lead = Leader()
    lead.beats("n1", 0.0, 10.0, delay=0.05)
    lead.beat("n1", 11.0, sent=10.9, acked=False)   # proves life, moves no fence deadline
    # (b) at 13.5 from the acked beat sent at 10.0, (a) at 11.0 + 3 = 14.0.
    lead.run(13.95)
    assert lead.verdicts == []
    assert lead.snap()["fence_deadline"] == 13.5
    assert kinds(lead.run(14.0)) == [("DEAD", "n1", 14.0)]


def test_b_fence_counts_from_the_send_time_of_the_last_acked_beat() -> None:
    lead = Leader()
    lead.beats("n1", 0.0, 10.0, delay=0.3)   # last sent 10.0, received 10.3
    # (a) at 13.3; the fence from the send time at 13.5 (from the receipt it would be 13.8).
    lead.run(13.45)
    assert lead.verdicts == []
    assert kinds(lead.run(13.5)) == [("DEAD", "n1", 13.5)]


def test_b_a_send_time_after_the_receipt_is_clamped() -> None:
    lead = Leader()
    lead.beats("n1", 0.0, 9.0)
    lead.beat("n1", 10.0, sent=30.0)   # agent clock ahead: the send cannot follow the receipt
    assert kinds(lead.run(20.0)) == [("DEAD", "n1", 13.5)]
    assert lead.verdicts[0].evidence["last_heartbeat_sent_at"] == 10.0


def test_c_a_new_leader_waits_a_miss_window_and_margin() -> None:
    slow = replace(FAST, fence_margin=2.0)
    old = Leader(slow, started=-100.0)
    new = Leader(slow, started=0.0)
    for lead in (old, new):
        lead.beat("n1", 0.0, acked=False)   # no ack from this leader: (b) does not apply
        lead.run(10.0)
    assert kinds(old.verdicts) == [("DEAD", "n1", 3.0)]          # (a) is the last to hold
    assert kinds(new.verdicts) == [("DEAD", "n1", 5.0)]          # 0 + 3 + 2
    assert new.verdicts[0].evidence["grace_until"] == 5.0


def test_d_never_dead_without_probes() -> None:
    lead = Leader(probing=False)
    lead.beat("n1", 0.0)
    lead.run(2.0)
    for _ in range(10):   # failure reports for probes never handed out count for nothing
        lead.det.probe_result("n1", False, 2.0)
    lead.run(100.0)
    assert lead.verdicts == [] and lead.det.health("n1") is SUSPECT
    snap = lead.snap()
    assert snap["probes_sent"] == 0 and snap["probes_failed"] == 0
    assert snap["misses"] == 100 and snap["health"] == "SUSPECT"


def test_d_never_dead_with_fewer_than_k_failures() -> None:
    reported = itertools.count()
    lead = Leader(answer=lambda n, t: False if next(reported) < 2 else None)
    lead.beat("n1", 0.0)
    lead.run(100.0)
    assert lead.verdicts == []
    assert lead.snap()["probes_failed"] == 2


def test_d_an_answered_probe_ends_the_suspicion_and_resets_the_count() -> None:
    calls = itertools.count()
    lead = Leader(answer=lambda n, t: next(calls) == 2)   # the 3rd probe is answered
    lead.beat("n1", 0.0)
    lead.run(1.8)
    assert lead.det.health("n1") is ALIVE          # answered at 1.75 + 0.01
    assert lead.snap()["probes_sent"] == 3
    lead.run(3.4)
    assert lead.det.health("n1") is SUSPECT        # again 1.5 s after the answer
    assert lead.snap()["probes_failed"] == 0
    # DEAD needs K fresh failures: probes from 3.3, third failure reported at 3.7.
    assert kinds(lead.run(10.0)) == [("DEAD", "n1", 3.7)]


def test_d_a_late_failure_from_an_earlier_suspicion_is_not_counted() -> None:
    det = Detector(FAST, -100.0)
    det.watch("n1", 0.0)
    det.tick(1.6)
    assert det.probes_due(1.6) == ["n1"]
    det.heartbeat("n1", 1.7, 1.7, acked=True)
    det.tick(3.3)
    assert det.health("n1") is SUSPECT and det.probes_due(3.3) == ["n1"]
    det.probe_result("n1", False, 3.35, sent_at=1.6)
    assert det.snapshot(3.35)["n1"]["probes_failed"] == 0
    det.probe_result("n1", False, 3.5, sent_at=3.3)
    assert det.snapshot(3.5)["n1"]["probes_failed"] == 1


def test_dead_node_heard_again_gives_one_alive_verdict() -> None:
    lead = Leader()
    lead.beats("n1", 0.0, 10.0)
    lead.run(15.0)
    lead.beat("n1", 20.0)
    assert kinds(lead.run(20.05)) == [("ALIVE", "n1", 20.0)]
    v = lead.verdicts[-1]
    assert v.evidence["source"] == "heartbeat" and v.evidence["dead_since"] == 13.5
    assert lead.det.health("n1") is ALIVE
    lead.beats("n1", 21.0, 30.0)
    assert lead.run(30.0) == []
    # Silent again: a new failure, a new DEAD verdict.
    assert kinds(lead.run(40.0)) == [("DEAD", "n1", 33.5)]


def test_an_answered_probe_also_revives_a_dead_node() -> None:
    lead = Leader()
    lead.run(5.0)
    assert lead.det.health("n1") is DEAD
    lead.det.probe_result("n1", True, 6.0)
    assert kinds(lead.det.tick(6.0)) == [("ALIVE", "n1", 6.0)]
    assert lead.det.tick(6.1) == []


def test_probes_due_only_suspects_rate_limited() -> None:
    det = Detector(FAST, -100.0)
    det.watch("n1", 0.0)
    det.watch("n2", 0.0)
    det.heartbeat("n2", 1.0, 1.0, acked=True)
    assert det.probes_due(1.5) == []
    assert det.probes_due(1.6) == ["n1"]        # n1 silent > 1.5 s, n2 is not
    assert det.probes_due(1.6) == []
    assert det.probes_due(1.65) == []
    assert det.probes_due(1.69) == []
    assert det.probes_due(1.7) == ["n1"]        # one probe_interval later
    # A missed slot gives one probe, not nine; n2 is now SUSPECT too.
    assert sorted(det.probes_due(2.6)) == ["n1", "n2"]
    det.heartbeat("n1", 2.7, 2.7, acked=True)
    assert det.probes_due(2.7) == ["n2"] and det.probes_due(2.8) == ["n2"]
    assert det.health("n1") is ALIVE


def test_next_wakeup_tells_when_to_come_back() -> None:
    det = Detector(FAST, -100.0)
    assert det.next_wakeup() is None
    det.watch("n1", 0.0)
    det.heartbeat("n1", 1.0, 1.0, acked=True)
    assert det.next_wakeup() == 2.5               # when n1 would become SUSPECT
    det.tick(2.6)
    assert det.next_wakeup() == 2.6               # a probe is waiting for probes_due
    det.probes_due(2.6)
    assert det.next_wakeup() == pytest.approx(2.7)


def test_probes_to_many_suspects_keep_to_the_budget_and_only_delay_verdicts() -> None:
    # 8,000 nodes at 1 s: a budget of 4,000 probes a second. A fifth of them go silent
    # at once (racks, or a coordinator dropping heartbeats): 1,600 suspects would ask
    # for 32,000 probes a second at the default probe interval.
    cfg = DetectorSettings.from_config(DetectionConfig())
    nodes = [f"n{i}" for i in range(8000)]
    silent = set(nodes[::5])
    lead = Leader(cfg, started=-100.0, nodes=nodes)
    assert lead.det.probe_rate() == pytest.approx(0.5 * 8000)
    for i, n in enumerate(nodes):  # spread over the second, as agents are
        phase = (i % 20) * 0.05
        lead.beats(n, phase, 4.0 + phase if n in silent else 30.0 + phase)
    lead.run(25.0)
    per_second: dict[int, int] = {}
    for t, _ in lead.probes:
        per_second[int(t)] = per_second.get(int(t), 0) + 1
    burst = 0.1 * lead.det.probe_rate()
    assert max(per_second.values()) <= lead.det.probe_rate() + burst, per_second
    # Only the silent nodes were probed, every one of them, and each is DEAD on exactly
    # K failed probes of its own: later than unhindered (about 3.5 s), never earlier.
    assert {n for _, n in lead.probes} == silent
    dead = {v.node: v for v in lead.verdicts if v.kind == "DEAD"}
    assert set(dead) == silent and len(lead.verdicts) == len(silent)
    for n, v in dead.items():
        assert v.evidence["probes_failed"] == cfg.probe_failures
        last = lead.received[n][-1][1]
        assert v.at >= last + cfg.miss_window + cfg.fence_margin
    latencies = sorted(v.at - lead.received[n][-1][1] for n, v in dead.items())
    assert latencies[-1] > cfg.miss_window + cfg.fence_margin + cfg.interval  # held back
    assert latencies[-1] < 16.0  # 29 failures at 2.5 probes a second, after 1.5 s of silence


def test_a_few_suspects_are_probed_at_full_rate_however_many_nodes() -> None:
    cfg = DetectorSettings.from_config(DetectionConfig())
    det = Detector(cfg, -100.0)
    for i in range(4):
        det.watch(f"n{i}", 0.0)
    assert det.probe_rate() == 1000.0  # the floor
    assert sorted(det.probes_due(1.6)) == ["n0", "n1", "n2", "n3"]


def test_agent_restart_within_a_second_gives_no_verdict() -> None:
    lead = Leader(FAST)
    lead.beats("n1", 0.0, 10.0, delay=0.1)
    lead.beats("n1", 11.8, 30.8, delay=0.1)    # the restarted agent's first beat is 1.8 s later
    lead.run(31.0)
    assert lead.verdicts == []
    assert lead.det.health("n1") is ALIVE
    assert lead.probes, "the gap made n1 SUSPECT for a moment"


def test_default_settings_meet_the_latency_goal_for_a_crash() -> None:
    cfg = DetectorSettings.from_config(DetectionConfig())
    lead = Leader(cfg)
    lead.beats("n1", 0.0, 10.0, delay=0.3)      # crash just after the send at 10.0
    lead.run(20.0)
    (v,) = lead.verdicts
    assert v.kind == "DEAD"
    assert v.at - 10.0 <= cfg.miss_window + cfg.fence_margin + cfg.interval
    assert v.evidence["probes_failed"] == cfg.probe_failures


def test_forget_and_unwatched_nodes() -> None:
    lead = Leader(nodes=("n1", "n2"))
    lead.det.heartbeat("stray", 0.5, 0.5, acked=True)   # not watched: ignored
    with pytest.raises(KeyError):
        lead.det.health("stray")
    lead.run(1.6)
    lead.det.forget("n1")
    lead.det.forget("n1")
    lead.run(10.0)
    assert kinds(lead.verdicts) == [("DEAD", "n2", 3.0)]
    assert set(lead.det.snapshot(10.0)) == {"n2"}
    lead.det.watch("n2", 10.0)                           # watching again changes nothing
    assert lead.det.health("n2") is DEAD


def test_a_clock_going_backwards_is_taken_as_the_latest_time() -> None:
    det = Detector(FAST, -100.0)
    det.watch("n1", 5.0)
    det.heartbeat("n1", 4.0, 4.0, acked=True)   # before the watch: counted as received at 5.0
    assert det.snapshot(5.0)["n1"]["last_heartbeat_received_at"] == 5.0
    det.tick(6.4)
    assert det.health("n1") is ALIVE
    det.tick(6.6)
    assert det.health("n1") is SUSPECT


def test_snapshot_reports_ages_and_deadlines() -> None:
    lead = Leader(nodes=("n1", "n2"))
    lead.beat("n1", 1.0, sent=0.9)
    lead.beat("n2", 1.0, acked=False)
    lead.app(1.0, "7", 0, "n1")
    lead.run(1.0)
    snap = lead.det.snapshot(2.0)
    n1, n2 = snap["n1"], snap["n2"]
    assert n1["health"] == "ALIVE" and n1["heartbeats"] == 1 and n1["ranks"] == 1
    assert n1["last_heartbeat_age_s"] == 1.0 and n1["misses"] == 1
    assert n1["fence_deadline"] == pytest.approx(4.4) and n1["hung_ranks"] == []
    assert "fence_deadline" not in n2 and n2["dead_not_before"] == 4.0


# ---------------------------------------------------------------- ranks


def steady(lead: Leader, node: str, until: float) -> None:
    lead.beats(node, 0.0, until)


def test_hung_after_the_app_window_once_per_silence() -> None:
    lead = Leader()
    steady(lead, "n1", 200.0)
    lead.app(0.0, "7", 3, "n1")
    lead.run(49.95)
    assert lead.verdicts == []
    (v,) = lead.run(50.0)
    assert (v.kind, v.node, v.job, v.rank, v.at) == ("HUNG", "n1", "7", 3, 50.0)
    assert v.evidence["step"] == 1 and v.evidence["silence_s"] == 50.0
    assert lead.snap()["hung_ranks"] == ["7.3"]
    lead.run(99.0)
    assert len(lead.verdicts) == 1
    lead.app(100.0, "7", 3, "n1", step=1)   # the same step still counts as a heartbeat
    lead.run(149.95)
    assert len(lead.verdicts) == 1 and lead.snap()["hung_ranks"] == []
    assert kinds(lead.run(200.0)) == [("HUNG", "n1", 150.0)]


def test_a_rank_blocked_on_a_peer_gets_three_windows_of_silence() -> None:
    lead = Leader()
    steady(lead, "n1", 400.0)
    lead.app(0.0, "7", 3, "n1", blocked_on=2)
    lead.app(0.0, "7", 2, "n1")
    lead.run(120.0)
    assert [(v.kind, v.rank) for v in lead.verdicts] == [("HUNG", 2)]
    lead.app(120.0, "7", 3, "n1")           # no longer blocked: one window again
    assert [(v.kind, v.rank, v.at) for v in lead.run(200.0)] == [("HUNG", 3, 170.0)]
    # a blocked rank whose process stopped (no heartbeat from its thread either)
    lead.app(200.0, "7", 4, "n1", blocked_on=2)
    assert lead.run(349.0) == []
    assert [(v.kind, v.rank, v.at) for v in lead.run(400.0)] == [("HUNG", 4, 350.0)]


def test_a_rank_on_a_suspect_node_is_not_hung_until_the_node_is_back() -> None:
    lead = Leader()
    lead.beats("n1", 0.0, 48.0)
    lead.beats("n1", 50.5, 100.5)            # n1 SUSPECT from ~49.55 to 50.5, never DEAD
    lead.app(0.0, "7", 0, "n1")
    lead.run(50.45)
    assert lead.verdicts == [] and lead.det.health("n1") is SUSPECT
    assert kinds(lead.run(100.0)) == [("HUNG", "n1", 50.5)]


def test_ranks_of_a_crashed_node_are_not_hung_before_the_node_is_suspect() -> None:
    # The rank's window ends at 50.0; the node's last heartbeat came at 49.0, and it is
    # SUSPECT only at 50.5: the silent rank is the node's crash, not a hang (judged HUNG
    # first, it was relaunched in place, on the dead node).
    lead = Leader()
    lead.beats("n1", 0.0, 49.0)
    lead.app(0.0, "7", 0, "n1")
    lead.run(100.0)
    assert kinds(lead.verdicts) == [("DEAD", "n1", 52.5)]


def test_a_silent_rank_is_hung_at_its_nodes_next_heartbeat() -> None:
    lead = Leader()
    lead.beats("n1", 0.0, 49.0)
    lead.beats("n1", 50.4, 100.4)   # late, but before the node is SUSPECT
    lead.app(0.0, "7", 0, "n1")
    lead.run(100.0)
    (v,) = lead.verdicts
    assert (v.kind, v.rank) == ("HUNG", 0) and 50.4 <= v.at <= 50.7


def test_ranks_of_a_node_back_from_dead_count_from_its_return() -> None:
    lead = Leader()
    lead.beats("n1", 0.0, 45.0)
    lead.beats("n1", 60.0, 200.0)
    lead.app(0.0, "7", 0, "n1")
    lead.run(200.0)
    assert kinds(lead.verdicts) == [("DEAD", "n1", 48.5), ("ALIVE", "n1", 60.0),
                                    ("HUNG", "n1", 110.0)]


def test_gone_ranks_and_ranks_on_unknown_nodes_are_never_hung() -> None:
    lead = Leader()
    steady(lead, "n1", 200.0)
    lead.app(0.0, "7", 0, "n1")
    lead.app(0.0, "7", 1, "elsewhere")
    lead.at(10.0, lambda: lead.det.ranks_finished(frozenset({("7", 0)})))
    lead.run(200.0)
    assert lead.verdicts == []


def test_a_rank_moved_to_another_node_follows_it() -> None:
    lead = Leader(nodes=("n1", "n2"))
    lead.beats("n1", 0.0, 10.0)
    steady(lead, "n2", 200.0)
    lead.app(0.0, "7", 0, "n1")
    lead.app(20.0, "7", 0, "n2", step=0)   # relaunched on n2, restored from an older step
    lead.run(200.0)
    assert kinds(lead.verdicts) == [("DEAD", "n1", 13.5), ("HUNG", "n2", 70.0)]


# ---------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None)
@given(gaps=st.lists(st.tuples(st.floats(0.01, 2.99), st.floats(0.0, 0.3), st.booleans()),
                     min_size=1, max_size=40),
       answers=st.lists(st.booleans(), min_size=1, max_size=20))
def test_never_dead_while_heartbeats_arrive_once_per_miss_window(
        gaps: list[tuple[float, float, bool]], answers: list[bool]) -> None:
    cfg = DetectorSettings.from_config(DetectionConfig())
    outcome = itertools.cycle(answers)
    lead = Leader(cfg, started=-100.0, answer=lambda n, t: next(outcome))
    t = 0.0
    for gap, delay, acked in gaps:
        t += gap
        lead.beat("n1", t, sent=t - delay, acked=acked)
    lead.run(t)
    assert [v for v in lead.verdicts if v.kind == "DEAD"] == []


period_fates = st.tuples(st.booleans(), st.booleans(), st.booleans(),
                         st.floats(0.0, 0.3), st.floats(0.0, 0.3))
Fate = tuple[bool, bool, bool, float, float]


@settings(max_examples=150, deadline=None)
@given(fates=st.lists(st.lists(period_fates, min_size=1, max_size=25), min_size=3, max_size=3),
       answers=st.lists(st.sampled_from([True, False, False, False, None]), min_size=1,
                        max_size=30),
       started=st.sampled_from([-100.0, -1.0, 0.0]))
def test_every_verdict_rests_on_its_conditions(fates: list[list[Fate]],
                                               answers: list[bool | None],
                                               started: float) -> None:
    """Random per-period losses (heartbeat, ack, resend) on three nodes, random probe fates.

    Checked against the test's own record at every tick: a node not DEAD is ALIVE exactly
    while it was heard from (heartbeat or answer) within 1.5 s; every DEAD verdict
    satisfies (a)-(d); no DEAD while every gap between receipts stays under the window.
    """
    cfg = FAST
    outcome = itertools.cycle(answers)
    nodes = ("a", "b", "c")
    lead = Leader(cfg, started=started, nodes=nodes, answer=lambda n, t: next(outcome))
    rx: dict[str, list[float]] = {n: [] for n in nodes}
    for node, periods in zip(nodes, fates, strict=True):
        for k, (lost, ack_lost, resend_lost, d1, d2) in enumerate(periods):
            s = float(k)
            if not lost:
                lead.beat(node, s + d1, s)
                rx[node].append(s + d1)
            if (lost or ack_lost or d1 + d2 > 1 / 3) and not resend_lost:
                lead.beat(node, s + 1 / 3 + d2, s + 1 / 3)
                rx[node].append(s + 1 / 3 + d2)
        rx[node].sort()
    end = 28.0
    answered = dict.fromkeys(nodes, 0.0)
    done = 0
    while lead.now < end:
        lead.run(lead.now + STEP)
        t = lead.now
        for at, node, ok, _ in lead.results[done:]:
            if ok:
                answered[node] = at
        done = len(lead.results)
        for node in nodes:
            i = bisect.bisect_right(rx[node], t)
            seen = max(answered[node], rx[node][i - 1] if i else 0.0)
            if lead.det.health(node) is not DEAD:
                assert (lead.det.health(node) is ALIVE) == (seen >= t - cfg.suspect_after)
    for v in lead.verdicts:
        assert v.kind in ("DEAD", "ALIVE")
        if v.kind != "DEAD":
            continue
        got = [(r, s, a) for r, s, a in lead.received.get(v.node, []) if r <= v.at]
        last_rx = max([0.0] + [r for r, _, _ in got])
        acked = [min(s, r) for r, s, a in got if a]
        assert v.at - last_rx >= cfg.miss_window                                  # (a)
        if acked:
            assert v.at >= max(acked) + cfg.miss_window + cfg.fence_margin        # (b)
        assert v.at >= started + cfg.miss_window + cfg.fence_margin               # (c)
        since = v.evidence["suspect_since"]
        assert isinstance(since, float) and since >= last_rx + cfg.suspect_after
        mine = [(r, ok) for r, n, ok, sent in lead.results
                if n == v.node and sent >= since and r <= v.at]
        assert sum(not ok for _, ok in mine) >= cfg.probe_failures                # (d)
        assert not any(ok for _, ok in mine)
    for node in nodes:
        gaps = [b - a for a, b in itertools.pairwise([0.0, *rx[node], end])]
        if max(gaps) < cfg.miss_window:
            assert not [v for v in lead.verdicts if v.node == node and v.kind == "DEAD"]


@settings(max_examples=50, deadline=None)
@given(beats=st.lists(st.tuples(st.integers(0, 19), st.integers(0, 30_000)), max_size=200))
def test_many_nodes_each_suspect_exactly_when_silent(beats: list[tuple[int, int]]) -> None:
    """The ordered ALIVE set against a brute-force check over 20 nodes (no probing)."""
    nodes = [f"n{i}" for i in range(20)]
    lead = Leader(nodes=nodes, probing=False)
    rx: dict[str, list[float]] = {n: [] for n in nodes}
    for i, ms in beats:
        lead.beat(nodes[i], ms / 1000)
        rx[nodes[i]].append(ms / 1000)
    for times in rx.values():
        times.sort()
    while lead.now < 32.0:
        lead.run(lead.now + STEP)
        t = lead.now
        for node in nodes:
            i = bisect.bisect_right(rx[node], t)
            last = rx[node][i - 1] if i else 0.0
            # Never DEAD without probes: SUSPECT exactly when silent for more than 1.5 s.
            want = ALIVE if last >= t - FAST.suspect_after else SUSPECT
            assert lead.det.health(node) is want, (node, t, last)
    assert lead.verdicts == []
    assert all(math.isfinite(float(str(s["silence_s"])))
               for s in lead.det.snapshot(lead.now).values())


def test_a_heartbeating_rank_whose_step_stands_still_is_hung_once_per_stall() -> None:
    lead = Leader()
    steady(lead, "n1", 400.0)
    for t in range(0, 400, 10):              # the runtime's thread heartbeats throughout
        lead.app(float(t), "7", 3, "n1", step=min(t, 100) // 10 + 1)
    lead.run(149.95)
    assert lead.verdicts == []               # step 11 was reported at 100
    (v,) = lead.run(200.0)
    assert (v.kind, v.rank, v.at) == ("HUNG", 3, 150.0)
    assert v.evidence["reason"] == "no progress" and v.evidence["step"] == 11
    assert v.evidence["stalled_s"] == 50.0 and "silence_s" not in v.evidence
    assert lead.run(400.0) == []             # the same stall gives no second verdict


def test_a_new_step_after_a_stall_arms_the_progress_window_again() -> None:
    lead = Leader()
    steady(lead, "n1", 300.0)
    for t in range(0, 300, 10):
        lead.app(float(t), "7", 3, "n1", step=1 if t < 120 else 2)
    assert [(v.rank, v.at) for v in lead.run(300.0)] == [(3, 50.0), (3, 170.0)]


def test_a_slow_but_progressing_rank_and_a_rank_without_steps_are_never_hung() -> None:
    lead = Leader()
    steady(lead, "n1", 600.0)
    for t in range(0, 600, 10):
        lead.app(float(t), "7", 1, "n1", step=t // 40 + 1)   # a new step every 40 s
        lead.app(float(t), "7", 2, "n1", step=0)              # never calls heartbeat(step)
    assert lead.run(600.0) == []


def test_a_rank_waiting_for_a_peer_is_not_hung_by_progress_the_stuck_peer_is() -> None:
    lead = Leader()
    steady(lead, "n1", 500.0)
    for t in range(0, 500, 10):
        if t < 400:
            lead.app(float(t), "7", 1, "n1", step=5, blocked_on=2)   # waits for rank 2
        else:
            lead.app(float(t), "7", 1, "n1", step=5)     # done waiting, then stuck itself
        lead.app(float(t), "7", 2, "n1", step=7)         # spins, heartbeating
    assert [(v.rank, v.at) for v in lead.run(449.0)] == [(2, 50.0)]
    (v,) = lead.run(500.0)                   # waiting counted as progress until 400
    assert (v.rank, v.at, v.evidence["reason"]) == (1, 450.0, "no progress")


def test_the_progress_window_comes_from_the_config_or_five_app_intervals() -> None:
    derived = DetectionConfig(app_heartbeat_interval_sec=2.0)
    assert DetectorSettings.from_config(derived).progress_window == 10.0
    assert DetectorSettings.from_config(
        DetectionConfig(app_progress_timeout_sec=3.5)).progress_window == 3.5
    with pytest.raises(ValueError, match="app_progress_timeout"):
        replace(FAST, app_progress_timeout=-1.0)


def test_a_rank_gone_after_its_last_heartbeat_gets_no_verdict() -> None:
    lead = Leader()
    steady(lead, "n1", 100.0)
    for t in range(0, 20, 1):
        lead.app(float(t), "7", 1, "n1", step=t + 1)
    lead.at(19.5, lambda: lead.det.ranks_finished(frozenset({("7", 1)})))  # finished
    assert lead.run(100.0) == []


def test_a_finished_rank_is_dropped_once_and_its_last_heartbeats_ignored() -> None:
    """The leader hands the whole finished set every tick: each rank new in it is dropped
    once; heartbeats it sends until it closes do not make it watched (nor HUNG) again."""
    lead = Leader()
    steady(lead, "n1", 200.0)
    done = frozenset({("7", 1)})
    dropped: list[tuple[str, int]] = []

    class Watched(dict):  # type: ignore[type-arg]
        def pop(self, key: Any, *default: Any) -> Any:
            dropped.append(key)
            return super().pop(key, *default)

    lead.det._ranks = Watched()
    for t in range(0, 30):
        lead.app(float(t), "7", 1, "n1", step=t + 1)
        lead.app(float(t), "7", 2, "n1", step=t + 1)
    for t in range(10, 200):
        lead.at(float(t) + 0.5, lambda: lead.det.ranks_finished(done))
    verdicts = lead.run(200.0)
    assert dropped == [("7", 1)]
    assert [(v.kind, v.rank) for v in verdicts] == [("HUNG", 2)], verdicts


def test_a_rank_that_leaves_the_finished_set_is_watched_again() -> None:
    """Relaunched under a new epoch: no longer finished, watched from its next heartbeat."""
    lead = Leader()
    steady(lead, "n1", 200.0)
    lead.app(0.0, "7", 1, "n1")
    lead.at(1.0, lambda: lead.det.ranks_finished(frozenset({("7", 1)})))
    lead.app(2.0, "7", 1, "n1")  # ignored: finished
    lead.at(3.0, lambda: lead.det.ranks_finished(frozenset()))
    lead.app(20.0, "7", 1, "n1")
    assert lead.run(69.0) == []
    (v,) = lead.run(200.0)
    assert v.kind == "HUNG" and v.at == 70.0


def test_step_of_is_the_last_step_reported_until_the_rank_finished() -> None:
    lead = Leader()
    steady(lead, "n1", 50.0)
    lead.app(1.0, "7", 3, "n1", step=5)
    lead.app(2.0, "7", 3, "n1", step=9)
    lead.run(3.0)
    assert (lead.det.step_of("7", 3), lead.det.step_of("7", 4)) == (9, None)
    lead.det.ranks_finished(frozenset({("7", 3)}))
    assert lead.det.step_of("7", 3) is None
