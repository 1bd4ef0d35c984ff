"""How long the production detector takes to call a crashed node DEAD.

The simulator does not send every heartbeat of every node: a crash's detection depends
only on where in its heartbeat period the node died. :func:`detection_delays` runs the
coordinator's own :class:`~raps_slurm.core.detector.Detector` once per phase (heartbeats
with their network delay, acks, then the probes it asks for, each failing after the probe
timeout) and returns the delays; a simulated crash draws one of them.
"""

from __future__ import annotations

import heapq
import math

from raps_slurm.core.detector import Detector, DetectorSettings, probe_plan
from raps_slurm.sim.scenario import RapsSpec


def settings_for(spec: RapsSpec) -> DetectorSettings:
    """Detector settings as the coordinator derives them from the detection config."""
    i = spec.heartbeat_interval_s
    probe_interval, probe_timeout = probe_plan(i, i * spec.miss_threshold, spec.fence_margin_s)
    return DetectorSettings(interval=i, miss_threshold=spec.miss_threshold,
                            fence_margin=spec.fence_margin_s, app_interval=10.0,
                            app_miss_threshold=5, probe_interval=probe_interval,
                            probe_timeout=probe_timeout)


def crash_delay(settings: DetectorSettings, phase: float, net_delay: float) -> float:
    """Seconds from a crash ``phase`` (0-1) of a period after a heartbeat to the DEAD verdict."""
    i = settings.interval
    det = Detector(settings, now=0.0)
    det.watch("node", 0.0)
    # Heartbeats long enough for the new-leader grace to have passed.
    sends = math.ceil((settings.miss_window + settings.fence_margin) / i) + 2
    for k in range(sends + 1):
        det.tick(k * i + net_delay)
        det.heartbeat("node", k * i, k * i + net_delay, acked=True)
    crash = sends * i + phase * i
    now = max(crash, sends * i + net_delay)
    pending: list[tuple[float, float]] = []  # (fails at, sent at)
    for _ in range(100_000):
        while pending and pending[0][0] <= now + 1e-9:
            _, sent = heapq.heappop(pending)
            det.probe_result("node", False, now, sent_at=sent)
        for _node in det.probes_due(now):
            heapq.heappush(pending, (now + settings.probe_timeout, now))
        for v in det.tick(now):
            if v.kind == "DEAD":
                return v.at - crash
        wake = det.next_wakeup()
        nxt = min(wake if wake is not None else math.inf,
                  pending[0][0] if pending else math.inf)
        if math.isinf(nxt):
            break
        # next_wakeup may be early, never late: step past a boundary it names again.
        now = nxt if nxt > now + 1e-9 else now + 1e-3
    raise RuntimeError("the detector gave no DEAD verdict for a silent node")


def detection_delays(spec: RapsSpec, samples: int = 64) -> list[float]:
    """DEAD-verdict delays at ``samples`` evenly spaced crash phases."""
    s = settings_for(spec)
    return [crash_delay(s, (j + 0.5) / samples, spec.network_delay_s) for j in range(samples)]
