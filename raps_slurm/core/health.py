"""Node health policy: probe samples in, level changes out; pure, no I/O.

The coordinator owns one :class:`HealthPolicy` and feeds it every node's probe samples
(:class:`raps_slurm.agent.probes.ProbeSample` or its ``to_dict()`` read back from the
store). :meth:`HealthPolicy.observe` returns a :class:`HealthVerdict` only when a node's
level changes; the caller applies it (``OK``: nothing or resume, ``DEGRADED``: a higher
Slurm ``Weight``, ``DRAIN``: ``scontrol update State=DRAIN Reason=<reason>``). Time comes
in as ``now``; a sample whose ``at`` is not newer than the last one observed for that
node is ignored, so re-reading the same sample from the store never counts twice.

Conditions (one per device, keyed like ``temp:nvme0``)
------------------------------------------------------
=================  ======================================  ===================  ================
check              DEGRADED when                           cleared below        hard (DRAIN)
=================  ======================================  ===================  ================
NVMe temperature   composite >= nvme_temp_c                threshold - 3 C      >= threshold+10C
TCP retransmits    ratio >= retransmit_ratio               threshold x 0.8      -
checkpoint disk    RAPS's data >= 90 % of it + root's room  85 %                 RAPS's >= 98 %
EDAC corrected     >= 5 per interval on one controller     threshold x 0.8      -
NIC errors         >= 10 rx+tx per interval on one NIC     threshold x 0.8      -
PCIe link          narrower than the best width seen       back to that width   width 0 (down)
device removed     a device left the inventory / udev      device seen again    always
=================  ======================================  ===================  ================

Counts and the retransmit ratio are judged only on per-interval samples
(``interval_sec`` set), and the ratio only over at least ``retransmit_min_segments``
segments: a cumulative-since-boot or near-idle figure says little about now. Counts are
scaled to one ``interval_sec`` of the settings when the sample covers longer (a missed
sample must not double them); a shorter sample is not scaled up. PCIe links are compared
with the best state this policy has seen for them (the first sample sets the baseline):
a card in a narrower slot is no fault, a link that loses lanes while we watch is. Link
speed is ignored unless ``check_pcie_speed``: GPUs and NICs lower it at idle to save power.
A reading that is not available (``None``, a device missing from a map) leaves its
condition as it was: it neither clears it nor counts towards persistence.
The checkpoint disk is judged on what RAPS needs, which no user can steer: the bytes the
checkpoint dir holds against those plus the room left for root (DEGRADED: no room for
more checkpoints), and against the whole file system (DRAIN: RAPS's own data fills it).
A user filling a file system the checkpoint dir shares takes only the room users may
have, not root's reserved blocks, and never makes RAPS's data grow; a sample without
``disk_raps_percent`` never drains, and the checkpoint disk does not drain by persistence
(on a file system without reserved blocks another user can take root's room too: the
node is then DEGRADED, no recovery target, for as long as it lasts, never drained).

Levels
------
* A condition becomes active when its value reaches the threshold and stays active until
  the value falls below threshold - margin (hysteresis): a value oscillating around the
  threshold stays one condition, never a flap.
* DRAIN when any active condition is hard, or any condition has been active for
  ``persist_samples`` (N, default 3) consecutive samples; else DEGRADED when any
  condition is active; else OK.
* The level goes down (DEGRADED or DRAIN to OK) only after ``recovery_samples``
  consecutive samples with no active condition. DRAIN never steps down to DEGRADED:
  it stays until the node is clean (a drained node resumed while still degraded would
  flap between drain and resume).
* Removed devices latch: the condition stays until the device is back in a sample's
  inventory (or :meth:`HealthPolicy.forget` after a repair).

Score (0-100, for Weight and dashboards): OK is 100; otherwise 100 minus 70 per hard
condition and 20 + 10 per extra consecutive sample (at most N-1) per soft one, kept in
31-80 for DEGRADED and 0-30 for DRAIN so that it orders like the level.

Reasons are one line, printable ASCII, start with ``raps: `` and stay under 100
characters (Slurm's node reason field): the worst condition first, e.g.
``raps: nvme0 temp 72C > 70C for 3 samples (+1 more)``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from raps_slurm.config import DetectionConfig

REASON_PREFIX = "raps: "
MAX_REASON_LEN = 99  # Slurm keeps longer reasons, but sinfo/squeue columns cut them


class HealthLevel(StrEnum):
    """A node's health level (a str: ``HealthLevel.DRAIN == "DRAIN"``)."""

    OK = "OK"
    DEGRADED = "DEGRADED"
    DRAIN = "DRAIN"


@dataclass(frozen=True)
class HealthSettings:
    """Thresholds; build them with :meth:`from_config`."""

    nvme_temp_c: float = 70.0
    temp_margin_c: float = 3.0            # leave DEGRADED below threshold - this
    temp_hard_margin_c: float = 10.0      # threshold + this drains at once
    retransmit_ratio: float = 0.05
    retransmit_min_segments: int = 1000   # fewer segments in an interval: no judgement
    ratio_margin: float = 0.2             # relative margin for ratios and counts
    disk_full_percent: float = 90.0
    disk_margin_percent: float = 5.0
    disk_hard_percent: float = 98.0
    edac_ce_per_interval: float = 5.0
    nic_errors_per_interval: float = 10.0
    interval_sec: float = 30.0            # the interval the per-interval counts mean
    check_pcie_speed: bool = False
    persist_samples: int = 3              # N: a condition this long drains the node
    recovery_samples: int = 3             # clean samples before the level goes down

    def __post_init__(self) -> None:
        positive = {"retransmit_ratio": self.retransmit_ratio, "interval_sec": self.interval_sec,
                    "edac_ce_per_interval": self.edac_ce_per_interval,
                    "nic_errors_per_interval": self.nic_errors_per_interval}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"HealthSettings.{name}: must be > 0, got {value!r}")
        if not 0 <= self.ratio_margin < 1:
            raise ValueError(f"HealthSettings.ratio_margin: must be in [0, 1), "
                             f"got {self.ratio_margin!r}")
        for name in ("temp_margin_c", "temp_hard_margin_c", "disk_margin_percent",
                     "retransmit_min_segments"):
            if getattr(self, name) < 0:
                raise ValueError(f"HealthSettings.{name}: must be >= 0")
        if not self.disk_full_percent <= self.disk_hard_percent <= 100:
            raise ValueError("HealthSettings: need disk_full_percent <= disk_hard_percent <= 100")
        for name in ("persist_samples", "recovery_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"HealthSettings.{name}: must be >= 1")

    @classmethod
    def from_config(cls, detection_cfg: DetectionConfig) -> HealthSettings:
        """Settings from ``config.detection``; the other thresholds are built in."""
        d = detection_cfg
        return cls(nvme_temp_c=d.smart_temperature_c,
                   retransmit_ratio=d.retransmit_ratio_threshold,
                   interval_sec=d.telemetry_interval_sec)


@dataclass(frozen=True)
class HealthVerdict:
    """A node's level, score and reason (returned when the level changes)."""

    node: str
    level: HealthLevel
    previous: HealthLevel
    score: int
    reason: str
    at: float
    conditions: tuple[str, ...] = ()


class SampleLike(Protocol):
    """Anything with ``to_dict()`` giving the probe sample fields (a ProbeSample)."""

    def to_dict(self) -> dict[str, Any]: ...


State = Literal["over", "band", "clear"]


@dataclass(frozen=True)
class _Reading:
    key: str
    state: State
    text: str = ""
    hard: bool = False
    persists: bool = True  # drains once active persist_samples samples in a row


@dataclass(slots=True)
class _Cond:
    count: int       # consecutive samples active
    hard: bool
    text: str        # from the last reading at or over the threshold
    persists: bool = True


@dataclass(slots=True)
class _NodeState:
    level: HealthLevel = HealthLevel.OK
    last_at: float | None = None
    clean: int = 0                     # consecutive samples without active conditions
    conds: dict[str, _Cond] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    pcie_base: dict[str, tuple[int, float | None]] | None = None  # None: no baseline yet


def _num(value: Any) -> float | None:
    """A finite number, else None (bools and strings from a bad record included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _nums(value: Any) -> dict[str, float] | None:
    """A name -> number map; bad entries dropped, a non-map is None."""
    if not isinstance(value, Mapping):
        return None
    return {str(k): v for k, raw in value.items() if (v := _num(raw)) is not None}


def _strs(value: Any) -> list[str] | None:
    if not isinstance(value, (list, tuple)):
        return None
    return [v for v in value if isinstance(v, str)]


def _g(value: float) -> str:
    """A short number for reasons: 72.0 -> '72', 70.44 -> '70.4'."""
    return f"{round(value, 1):g}"


def _band(value: float, threshold: float, clear_below: float) -> State:
    if value >= threshold:
        return "over"
    return "band" if value >= clear_below else "clear"


def _clean_text(text: str) -> str:
    """Printable ASCII only: reasons end up in Slurm and in terminals."""
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in text)


class HealthPolicy:
    """Per-node health levels with hysteresis; see the module docstring for the rules."""

    def __init__(self, settings: HealthSettings | None = None) -> None:
        self.settings = settings or HealthSettings()
        self._nodes: dict[str, _NodeState] = {}

    def observe(self, node: str, sample: Mapping[str, Any] | SampleLike,
                now: float) -> HealthVerdict | None:
        """Take one sample of ``node``; a verdict when its level changes, else None."""
        data = sample if isinstance(sample, Mapping) else sample.to_dict()
        st = self._nodes.setdefault(node, _NodeState())
        at = _num(data.get("at"))
        if at is None:
            at = now  # a record without a time cannot be de-duplicated; take it as new
        elif st.last_at is not None and at <= st.last_at:
            return None
        st.last_at = at
        self._apply(st, self._readings(st, data))
        previous, st.level = st.level, self._next_level(st)
        if st.level == previous:
            return None
        return self._verdict(node, st, previous, now)

    def status(self, node: str, now: float) -> HealthVerdict | None:
        """The node's current level, score and reason (None if never observed)."""
        st = self._nodes.get(node)
        return None if st is None else self._verdict(node, st, st.level, now)

    def nodes(self) -> list[str]:
        """Every node observed, sorted."""
        return sorted(self._nodes)

    def forget(self, node: str) -> None:
        """Drop a node's state (left the cluster, or repaired: latches and baseline go)."""
        self._nodes.pop(node, None)

    # -- readings -------------------------------------------------------------------

    def _readings(self, st: _NodeState, data: Mapping[str, Any]) -> list[_Reading]:
        out = list(self._temps(data))
        out += self._retransmits(data)
        out += self._disk(data)
        interval = _num(data.get("interval_sec"))
        if interval is not None and interval > 0:
            s = self.settings
            # Scale down a long interval (missed samples), never scale up a short one.
            scale = s.interval_sec / max(interval, s.interval_sec)
            out += self._counts(data.get("edac_ce"), "edac", "memory CE",
                                s.edac_ce_per_interval, scale)
            out += self._counts(data.get("nic_errors"), "nic", "errors",
                                s.nic_errors_per_interval, scale)
        out += self._pcie(st, data.get("pcie_degraded"))
        out += self._removed(st, data)
        return out

    def _temps(self, data: Mapping[str, Any]) -> Iterator[_Reading]:
        s = self.settings
        hard_at = s.nvme_temp_c + s.temp_hard_margin_c
        for dev, t in sorted((_nums(data.get("nvme_temps_c")) or {}).items()):
            state = _band(t, s.nvme_temp_c, s.nvme_temp_c - s.temp_margin_c)
            if t >= hard_at:
                text = f"{dev} temp {_g(t)}C >= {_g(hard_at)}C"
            else:
                text = f"{dev} temp {_g(t)}C {'>' if t > s.nvme_temp_c else '>='} " \
                       f"{_g(s.nvme_temp_c)}C"
            yield _Reading(f"temp:{dev}", state, text, hard=t >= hard_at)

    def _retransmits(self, data: Mapping[str, Any]) -> list[_Reading]:
        s = self.settings
        ratio, segs = _num(data.get("tcp_retransmit_ratio")), _num(data.get("tcp_out_segs"))
        if (_num(data.get("interval_sec")) is None or ratio is None or segs is None
                or segs < s.retransmit_min_segments):
            return []
        state = _band(ratio, s.retransmit_ratio, s.retransmit_ratio * (1 - s.ratio_margin))
        return [_Reading("tcp:retransmit", state,
                         f"tcp retransmit {ratio:.1%} >= {s.retransmit_ratio:.1%}")]

    def _disk(self, data: Mapping[str, Any]) -> list[_Reading]:
        """``disk_used_percent``: RAPS's data against the room left for root (DEGRADED:
        no room for more checkpoints); ``disk_raps_percent``: RAPS's data against the
        whole file system (DRAIN). Neither moves when another user fills a file system
        the checkpoint dir shares, but for the room root has left (see the probes)."""
        s = self.settings
        used = _num(data.get("disk_used_percent"))
        if used is None:
            return []
        raps = _num(data.get("disk_raps_percent"))
        hard = raps is not None and raps >= s.disk_hard_percent
        shown, limit = (used, s.disk_full_percent)
        if raps is not None and hard:
            shown, limit = raps, s.disk_hard_percent
        state = _band(used, s.disk_full_percent, s.disk_full_percent - s.disk_margin_percent)
        # No room left drains nothing however long it lasts: others' files may fill what
        # root has (a file system without reserved blocks), and the node still runs ranks.
        return [_Reading("disk:ckpt", state, f"ckpt disk {_g(shown)}% full >= {_g(limit)}%",
                         hard=hard, persists=False)]

    def _counts(self, value: Any, kind: str, what: str, threshold: float,
                scale: float) -> Iterator[_Reading]:
        s = self.settings
        for dev, count in sorted((_nums(value) or {}).items()):
            state = _band(count * scale, threshold, threshold * (1 - s.ratio_margin))
            yield _Reading(f"{kind}:{dev}", state,
                           f"{dev} {_g(count * scale)} {what}/{_g(s.interval_sec)}s "
                           f">= {_g(threshold)}")

    def _pcie(self, st: _NodeState, value: Any) -> list[_Reading]:
        if not isinstance(value, (list, tuple)):
            return []
        links: dict[str, tuple[int, int, float | None, float | None]] = {}
        for item in value:
            if not isinstance(item, Mapping) or not isinstance(item.get("address"), str):
                continue
            width, max_width = _num(item.get("width")), _num(item.get("max_width"))
            if width is None or max_width is None:
                continue
            links[item["address"]] = (int(width), int(max_width),
                                      _num(item.get("speed_gts")), _num(item.get("max_speed_gts")))
        if st.pcie_base is None:
            # First look: whatever is below max now is how this node was built.
            st.pcie_base = {a: (w, sp) for a, (w, _, sp, _) in links.items()}
            return []
        for addr in set(st.pcie_base) - set(links):
            del st.pcie_base[addr]  # at full width and speed now: the best is the max
        out: list[_Reading] = []
        for addr in sorted(set(links) | {k[5:] for k in st.conds if k.startswith("pcie:")}):
            if addr not in links:
                out.append(_Reading(f"pcie:{addr}", "clear"))
                continue
            width, max_width, speed, max_speed = links[addr]
            base_w, base_sp = st.pcie_base.get(addr, (max_width, max_speed))
            slower = (self.settings.check_pcie_speed and base_sp is not None
                      and (speed is None or speed < base_sp))
            if width == 0 and base_w > 0:
                out.append(_Reading(f"pcie:{addr}", "over", f"pcie {addr} link down "
                                    f"(was x{base_w})", hard=True))
            elif width < base_w:
                out.append(_Reading(f"pcie:{addr}", "over", f"pcie {addr} x{width} < x{base_w}"))
            elif slower:
                out.append(_Reading(f"pcie:{addr}", "over", f"pcie {addr} "
                                    f"{_g(speed or 0)}GT/s < {_g(base_sp or 0)}GT/s"))
            else:
                # As good as the best seen (or better, which becomes the new best).
                best_sp = base_sp if speed is None or (base_sp or 0) > speed else speed
                st.pcie_base[addr] = (max(width, base_w), best_sp)
                out.append(_Reading(f"pcie:{addr}", "clear"))
        return out

    def _removed(self, st: _NodeState, data: Mapping[str, Any]) -> list[_Reading]:
        st.missing |= set(_strs(data.get("removed")) or ())
        inventory = _strs(data.get("devices"))
        out: list[_Reading] = []
        for dev in sorted(st.missing):
            if inventory is not None and dev in inventory:
                st.missing.discard(dev)
                out.append(_Reading(f"removed:{dev}", "clear"))
            else:
                out.append(_Reading(f"removed:{dev}", "over", f"device removed: {dev}",
                                    hard=True))
        return out

    # -- state ----------------------------------------------------------------------

    @staticmethod
    def _apply(st: _NodeState, readings: list[_Reading]) -> None:
        """Move each condition by its reading; keys without a reading are left alone."""
        for r in readings:
            cond = st.conds.get(r.key)
            if r.state == "clear":
                st.conds.pop(r.key, None)
            elif cond is None:
                if r.state == "over":
                    st.conds[r.key] = _Cond(1, r.hard, r.text, r.persists)
            else:
                cond.count += 1
                cond.hard, cond.persists = r.hard, r.persists
                if r.state == "over":
                    cond.text = r.text

    def _next_level(self, st: _NodeState) -> HealthLevel:
        s = self.settings
        conds = st.conds.values()
        if any(c.hard or (c.persists and c.count >= s.persist_samples) for c in conds):
            target = HealthLevel.DRAIN
        elif conds:
            target = HealthLevel.DEGRADED
        else:
            target = HealthLevel.OK
        if st.conds:
            st.clean = 0
        else:
            st.clean += 1
        if st.level == HealthLevel.DRAIN and target == HealthLevel.DEGRADED:
            return HealthLevel.DRAIN
        if target == HealthLevel.OK and st.level != HealthLevel.OK:
            return HealthLevel.OK if st.clean >= s.recovery_samples else st.level
        return target

    def _ranked(self, st: _NodeState) -> list[tuple[str, _Cond]]:
        """Active conditions, worst first: hard, then longest active, then by key."""
        return sorted(st.conds.items(), key=lambda kv: (not kv[1].hard, -kv[1].count, kv[0]))

    def _text(self, cond: _Cond) -> str:
        if cond.hard or not cond.persists or cond.count < self.settings.persist_samples:
            return cond.text
        return f"{cond.text} for {cond.count} samples"

    def _verdict(self, node: str, st: _NodeState, previous: HealthLevel,
                 now: float) -> HealthVerdict:
        ranked = self._ranked(st)
        texts = tuple(_clean_text(self._text(c)) for _, c in ranked)
        if texts:
            more = f" (+{len(texts) - 1} more)" if len(texts) > 1 else ""
            body = texts[0]
            room = MAX_REASON_LEN - len(REASON_PREFIX) - len(more)
            if len(body) > room:
                body = body[:room - 3] + "..."
            reason = REASON_PREFIX + body + more
        elif st.level == HealthLevel.OK:
            reason = REASON_PREFIX + "healthy"
        else:
            reason = (f"{REASON_PREFIX}recovering, {st.clean}/"
                      f"{self.settings.recovery_samples} clean samples")
        return HealthVerdict(node=node, level=st.level, previous=previous,
                             score=self._score(st, ranked), reason=reason, at=now,
                             conditions=texts)

    def _score(self, st: _NodeState, ranked: list[tuple[str, _Cond]]) -> int:
        if st.level == HealthLevel.OK:
            return 100
        extra = self.settings.persist_samples - 1
        penalty = sum(70 if c.hard else 20 + 10 * min(c.count - 1, extra) for _, c in ranked)
        raw = max(0, 100 - penalty)
        if st.level == HealthLevel.DRAIN:
            return min(raw, 30)
        return max(31, min(raw, 80))


_LABEL = re.compile(r"[a-z][a-z0-9_-]{0,31}")
MAX_REJECTION_LABELS = 64  # (door, kind) pairs kept per node: a metric label set stays small


def door_rejections(sample: Mapping[str, Any]) -> tuple[dict[tuple[str, str], int], list[str]]:
    """The sample's ``rejected`` counts (door -> kind -> count) as ``{(door, kind): count}``,
    and one line per entry dropped (a bad label or count); no ``rejected``: nothing."""
    raw = sample.get("rejected")
    if raw is None:
        return {}, []
    if not isinstance(raw, Mapping):
        return {}, [f"rejected: expected an object of doors, got {type(raw).__name__}"]
    out: dict[tuple[str, str], int] = {}
    problems: list[str] = []
    for door, kinds in raw.items():
        if not (isinstance(door, str) and _LABEL.fullmatch(door)) or not isinstance(
                kinds, Mapping):
            problems.append(f"rejected: door {str(door)[:40]!r} dropped (expected a name "
                            "like transfer and an object of kind -> count)")
            continue
        for kind, count in kinds.items():
            ok_kind = isinstance(kind, str) and _LABEL.fullmatch(kind)
            ok_count = isinstance(count, int) and not isinstance(count, bool) and count >= 0
            if not (ok_kind and ok_count) or len(out) >= MAX_REJECTION_LABELS:
                problems.append(f"rejected.{door}: {str(kind)[:40]!r}={str(count)[:20]} dropped "
                                f"(expected a lower-case name and a count >= 0, at most "
                                f"{MAX_REJECTION_LABELS} in all)")
                continue
            out[(door, str(kind))] = int(count)
    return out, problems
