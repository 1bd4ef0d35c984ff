"""``rapsctl bench busy`` without a cluster: what counts as a false verdict or a needless
restart (negative controls: each kind is counted), the goals, the production profile
and where a hog's cgroups are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from raps_slurm.bench.busy import (
    CLUSTER_WRITES,
    WIRING,
    cgroup_dirs,
    judge,
    key_source,
    production_profile,
    summary,
    verdict_window,
)
from raps_slurm.config import parse_config
from raps_slurm.core.history import FailureEvent
from raps_slurm.core.planner import Plan

ROOT = Path(__file__).resolve().parents[2]
JOB = "7"
EPOCHS = {0: 1, 1: 1, 2: 1, 3: 1}


def plan(rank: int, source: str, target: str, at: float, epoch: int = 2,
         job: str = JOB) -> Plan:
    return Plan(f"p{rank}-{at}", job, rank, source, target, epoch, "rank is hung", 0,
                state="done", created_at=at)


def hung(rank: int, at: float, node: str = "n6", job: str = JOB) -> FailureEvent:
    return FailureEvent("HUNG", node, at, f"{job}.{rank}")


def counts(row: dict[str, Any]) -> tuple[int, int, int, int, int]:
    return (row["false_hung"], row["false_dead"], row["healthy_restarted"],
            row["healthy_moved"], row["unexplained_epochs"])


def test_a_clean_run_counts_nothing() -> None:
    row = judge(JOB, [], [], EPOCHS, 100.0, 200.0)
    assert counts(row) == (0, 0, 0, 0, 0)
    assert not row["hang_found"] and row["hang_recovery"] is None


def test_the_real_hang_and_its_restart_are_expected_not_false() -> None:
    row = judge(JOB, [hung(3, 150.0)], [plan(3, "n6", "n6", 150.5)], {**EPOCHS, 3: 2},
                100.0, 200.0, hung_rank=3, hang_from=140.0)
    assert counts(row) == (0, 0, 0, 0, 0)
    assert row["hang_found"] and row["hang_recovery"] == "in place"


def test_every_false_verdict_and_needless_restart_is_counted() -> None:
    events = [hung(1, 120.0, "n2"),                   # a healthy rank judged HUNG
              hung(3, 130.0),                          # the hung rank, before its hang
              FailureEvent("DEAD", "n4", 160.0, ""),   # a node that did not fail
              hung(3, 150.0)]                          # the real one
    plans = [plan(1, "n2", "n2", 120.5),               # restarted in place
             plan(3, "n6", "n6", 150.5),               # the expected one
             plan(3, "n6", "n6", 170.0, epoch=3),      # the relaunched rank again
             plan(2, "n4", "n5", 160.5)]               # moved off a live node
    row = judge(JOB, events, plans, {0: 1, 1: 2, 2: 2, 3: 3}, 100.0, 200.0, 3, 140.0)
    assert counts(row) == (2, 1, 2, 1, 0)
    assert row["hang_found"] and row["hang_recovery"] == "in place"


def test_a_hang_never_found_leaves_its_restart_counted() -> None:
    row = judge(JOB, [], [plan(3, "n6", "n5", 150.0)], {**EPOCHS, 3: 2}, 100.0, 200.0,
                3, 140.0)
    assert not row["hang_found"] and counts(row) == (0, 0, 0, 1, 0)


def test_a_hung_rank_moved_is_the_expected_plan_but_said_so() -> None:
    row = judge(JOB, [hung(3, 150.0)], [plan(3, "n6", "n5", 151.0)], {**EPOCHS, 3: 2},
                100.0, 200.0, 3, 140.0)
    assert counts(row) == (0, 0, 0, 0, 0) and row["hang_recovery"] == "moved"


def test_an_epoch_no_plan_explains_is_counted() -> None:
    row = judge(JOB, [], [], {**EPOCHS, 2: 3}, 100.0, 200.0)
    assert counts(row) == (0, 0, 0, 0, 2)


def test_outside_the_window_or_another_job_does_not_count() -> None:
    events = [FailureEvent("DEAD", "n1", 99.0, ""), FailureEvent("DEAD", "n1", 201.0, ""),
              FailureEvent("DRAIN", "n2", 150.0, "hot")]
    row = judge(JOB, events, [plan(0, "n1", "n1", 150.0, job="8")], EPOCHS, 100.0, 200.0)
    assert counts(row) == (0, 0, 0, 0, 0) and row["plans"] == []
    # the same DEAD inside the window is counted (the control)
    assert judge(JOB, [FailureEvent("DEAD", "n1", 150.0, "")], [], EPOCHS, 100.0,
                 200.0)["false_dead"] == 1


def run(kind: str, detect: float | None = None, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"kind": kind, "hogs": 0 if kind == "idle_hang" else 4,
                           "state": "COMPLETED", "restart_count": 0, "result": "same",
                           "false_hung": 0, "false_dead": 0, "healthy_restarted": 0,
                           "healthy_moved": 0, "unexplained_epochs": 0}
    if kind != "idle_hang":
        row["hogs_like_ranks"] = {"matched": 4, "same_cgroups": True}
    if kind != "loaded":
        row["hang_detect_s"] = detect
    return {**row, **extra}


def good() -> list[dict[str, Any]]:
    return [run("idle_hang", 10.0), run("loaded"), run("loaded_hang", 15.0)]


def test_goals_met_when_nothing_false_and_the_hang_within_twice_idle() -> None:
    s = summary(good())
    assert s["goals_met"] and s["hang_ratio"] == 1.5
    assert (s["hang_detect_s"], s["hang_detect_idle_s"]) == (15.0, 10.0)


def test_each_missed_goal_fails_goals_met() -> None:
    cases: list[tuple[str, list[dict[str, Any]]]] = [
        ("no_false_verdict", [run("idle_hang", 10.0), run("loaded", false_hung=1),
                              run("loaded_hang", 15.0)]),
        ("no_false_verdict", [run("idle_hang", 10.0), run("loaded"),
                              run("loaded_hang", 15.0, false_dead=1)]),
        ("no_healthy_restart", [run("idle_hang", 10.0), run("loaded", healthy_restarted=1),
                                run("loaded_hang", 15.0)]),
        ("no_healthy_restart", [run("idle_hang", 10.0), run("loaded", healthy_moved=1),
                                run("loaded_hang", 15.0)]),
        ("no_healthy_restart", [run("idle_hang", 10.0), run("loaded", unexplained_epochs=1),
                                run("loaded_hang", 15.0)]),
        ("hang_within_2x_idle", [run("idle_hang", 10.0), run("loaded"),
                                 run("loaded_hang", 20.5)]),
        ("hang_within_2x_idle", [run("idle_hang", 10.0), run("loaded"),
                                 run("loaded_hang", None)]),
        ("hang_within_2x_idle", [run("idle_hang", None), run("loaded"),
                                 run("loaded_hang", 15.0)]),
        ("results_ok", [run("idle_hang", 10.0), run("loaded", result="differs"),
                        run("loaded_hang", 15.0)]),
        ("results_ok", [run("idle_hang", 10.0, state="FAILED"), run("loaded"),
                        run("loaded_hang", 15.0)]),
        ("results_ok", [run("idle_hang", 10.0), run("loaded", restart_count=1),
                        run("loaded_hang", 15.0)]),
        ("results_ok", [run("idle_hang", 10.0), run("loaded", error="boom"),
                        run("loaded_hang", 15.0)]),
        ("load_as_asked", [run("idle_hang", 10.0),
                           run("loaded", hogs_like_ranks={"matched": 3, "same_cgroups": True}),
                           run("loaded_hang", 15.0)]),
        ("load_as_asked", [run("idle_hang", 10.0), run("loaded"),
                           run("loaded_hang", 15.0, hogs_like_ranks=None)]),
    ]
    for goal, runs in cases:
        s = summary(runs)
        assert not s["goals_met"] and not s["goals"][goal], (goal, runs, s["goals"])
        assert sum(not v for v in s["goals"].values()) == 1, (goal, s["goals"])


def test_idle_false_verdicts_are_reported_apart_from_the_loaded_goal() -> None:
    s = summary([run("idle_hang", 10.0, false_hung=2), run("loaded"),
                 run("loaded_hang", 15.0)])
    assert s["idle_false"]["false_hung"] == 2 and s["false_hung"] == 0


def test_the_production_profile_is_raps_yaml_with_the_wiring_only() -> None:
    raps = yaml.safe_load((ROOT / "configs" / "raps.yaml").read_text())
    test = yaml.safe_load((ROOT / "configs" / "test.yaml").read_text())
    data, sources = production_profile(raps, test)
    assert "store" not in data
    for section, key in CLUSTER_WRITES:
        assert key not in data.get(section, {}), (section, key)
    changed = {f"{s}.{k}" for s in data for k in data[s] if data[s][k] != raps[s][k]}
    assert changed <= set(sources) == {f"{s}.{k}" for s, k in WIRING}
    cfg = parse_config(data)
    assert cfg.detection.app_heartbeat_interval_sec == \
        raps["detection"]["app_heartbeat_interval_sec"]
    assert cfg.checkpoint.interval_sec == raps["checkpoint"]["interval_sec"]
    # what scripts/cluster.sh appends after these lines needs them in block style
    text = yaml.safe_dump(data, sort_keys=False)
    for section in ("detection:", "agent:", "coordinator:"):
        assert f"\n{section}\n" in text
    assert "\n  local_dir: " in text and "\n  log_dir: " in text


def test_the_verdict_window_is_the_longest_of_rank_and_node_windows() -> None:
    raps = yaml.safe_load((ROOT / "configs" / "raps.yaml").read_text())
    assert verdict_window(parse_config(raps)) == 50.0  # 5 x 10 s, both for ranks
    assert verdict_window(parse_config({"detection": {
        "app_heartbeat_interval_sec": 1.0, "app_miss_threshold": 3,
        "app_progress_timeout_sec": 10}})) == 10.0
    assert verdict_window(parse_config({"detection": {
        "app_heartbeat_interval_sec": 1.0, "app_miss_threshold": 3,
        "app_progress_timeout_sec": 2, "kernel_heartbeat_interval_sec": 2.0,
        "lease_duration_sec": 30}})) == 6.5  # 3 x 2 s + 0.5 s: the node's


def test_key_sources() -> None:
    test = {"detection": {"app_heartbeat_interval_sec": 1.0}}
    assert key_source("production", "detection", "app_heartbeat_interval_sec", test) == \
        "configs/raps.yaml"
    assert key_source("production", "messagelog", "listen_address", test).startswith(
        "configs/test.yaml")
    assert key_source("test", "detection", "app_heartbeat_interval_sec", test) == \
        "configs/test.yaml"
    assert key_source("test", "detection", "miss_threshold", test).startswith(
        "configs/raps.yaml (default")


MOUNTINFO = """\
30 25 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:4 - cgroup2 cgroup2 rw
31 25 0:28 / /sys/fs/cgroup/cpu rw,nosuid shared:5 - cgroup cgroup rw,cpu
32 25 0:29 / /sys/fs/cgroup/memory rw,nosuid shared:6 - cgroup cgroup rw,memory
33 25 0:30 /sub /sys/fs/cgroup/cpuset rw,nosuid shared:7 - cgroup cgroup rw,cpuset
40 25 8:1 / / rw,relatime - ext4 /dev/sda1 rw
"""


def test_cgroup_dirs_are_the_cpu_deciding_ones() -> None:
    proc = "4:memory:/limited\n3:cpuset:/sub/a\n2:cpu:/jobs\n1:name=systemd:/\n0::/n3\n"
    assert cgroup_dirs(proc, MOUNTINFO) == [Path("/sys/fs/cgroup/cpuset/a"),
                                            Path("/sys/fs/cgroup/cpu/jobs"),
                                            Path("/sys/fs/cgroup/unified/n3")]
    # a hierarchy that is not mounted here, or a path outside the mount's root, is left
    assert cgroup_dirs("5:cpuacct:/x\n3:cpuset:/other\n", MOUNTINFO) == []
