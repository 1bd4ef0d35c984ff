"""The alerting rules (slurm/prometheus/raps.rules.yml), their promtool unit tests
(raps.rules.test.yml) and the Grafana dashboard (slurm/grafana/raps-dashboard.json): valid
for promtool, each alert shown to fire, and every metric name they use one the
coordinator exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from raps_slurm.coordinator.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "slurm" / "prometheus" / "raps.rules.yml"
RULE_TESTS = REPO / "slurm" / "prometheus" / "raps.rules.test.yml"
DASHBOARD = REPO / "slurm" / "grafana" / "raps-dashboard.json"
ALERTS = {"RapsNoLeader", "RapsNodeDead", "RapsCheckpointsUnderReplicated",
          "RapsEtcdNearQuota", "RapsRecoveryEscalated"}


@pytest.fixture
def _promtool() -> None:
    # scripts/test.sh installs it (Debian package prometheus): missing fails, never skips
    assert shutil.which("promtool"), "promtool not installed: run scripts/test.sh"


needs_promtool = pytest.mark.usefixtures("_promtool")

# The series names a metric family appears under when scraped (prometheus_client).
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram":
            ("_bucket", "_sum", "_count", "_created"), "summary": ("_sum", "_count", "_created")}


def exported() -> set[str]:
    """Every series name the coordinator's metrics endpoint can serve."""
    names: set[str] = set()
    for family in Metrics(None).registry.collect():
        names |= {family.name + s for s in SUFFIXES[family.type]}
    return names


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [r for group in data["groups"] for r in group["rules"]]


def dashboard_exprs() -> Iterator[str]:
    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "expr" and isinstance(v, str):
                    yield v
                else:
                    yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)
    yield from walk(json.loads(DASHBOARD.read_text()))


def raps_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: raps_ words not inside quotes or {...}."""
    bare = re.sub(r'"[^"]*"|\{[^}]*\}', "", expr)
    return set(re.findall(r"\braps_[a-z_]+\b", bare))


def test_the_five_alerts_exist() -> None:
    assert {r["alert"] for r in rules()} == ALERTS


def test_every_metric_name_is_one_the_coordinator_exports() -> None:
    known = exported()
    assert "raps_coordinator_escalations_total" in known and "raps_etcd_quota_bytes" in known
    used: dict[str, set[str]] = {}
    for r in rules():
        used.setdefault(f"rule {r['alert']}", set()).update(raps_names(r["expr"]))
    for i, expr in enumerate(dashboard_exprs()):
        used.setdefault(f"dashboard expr {i}", set()).update(raps_names(expr))
    assert all(used.values()), [w for w, names in used.items() if not names]
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:  # ("up" alone: none)
        for s in test.get("input_series", []):
            used.setdefault(f"rule test {test['name']!r}", set()).update(raps_names(s["series"]))
    unknown = {w: names - known for w, names in used.items() if names - known}
    assert not unknown, unknown
    # The dashboard shows every family the coordinator exports.
    in_dashboard = set().union(*(raps_names(e) for e in dashboard_exprs()))
    families = {f.name for f in Metrics(None).registry.collect()}
    missing = {f for f in families if not any(n.startswith(f) for n in in_dashboard)}
    assert not missing, missing


def test_the_name_scan_sees_names_and_skips_labels() -> None:
    assert raps_names('sum by (kind) (rate(raps_a_total{x="raps_b"}[5m])) / raps_c') \
        == {"raps_a_total", "raps_c"}


@needs_promtool
def test_promtool_check_rules() -> None:
    out = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0 and f"SUCCESS: {len(ALERTS)} rules found" in out.stdout, out


@needs_promtool
def test_promtool_rule_tests_pass_and_show_each_alert_firing() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"]
             if case["exp_alerts"]}
    quiet = {case["alertname"] for t in tests for case in t["alert_rule_test"]
             if not case["exp_alerts"]}
    assert fired == ALERTS and quiet == ALERTS
    out = subprocess.run(["promtool", "test", "rules", RULE_TESTS.name], capture_output=True,
                         text=True, check=False, cwd=RULE_TESTS.parent)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


@needs_promtool
def test_promtool_rule_tests_can_fail(tmp_path: Path) -> None:
    """The check above proves something: a rule test expecting the wrong figure fails."""
    shutil.copy(RULES, tmp_path / RULES.name)
    (tmp_path / RULE_TESTS.name).write_text(
        RULE_TESTS.read_text().replace("summary: 2 node(s) DEAD", "summary: 3 node(s) DEAD"))
    out = subprocess.run(["promtool", "test", "rules", RULE_TESTS.name], capture_output=True,
                         text=True, check=False, cwd=tmp_path)
    assert out.returncode != 0 and "RapsNodeDead" in out.stdout + out.stderr


@needs_promtool
def test_dashboard_expressions_parse(tmp_path: Path) -> None:
    """Each panel query, as a recording rule, passes promtool's PromQL parser."""
    exprs = list(dashboard_exprs())
    assert len(exprs) >= 10
    group = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"raps_dashboard:q{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump(group))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
