"""LANL's failure data as a failure log, and what a log's statistics do to a scenario:
the MTBF's interval in the report, and ``failures.log_mode: fit`` (Weibull draws)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.inputs import load_failure_log, parse_failure_log, read_failure_log
from raps_slurm.sim.lanl import convert, parse_lanl, systems, target_node
from raps_slurm.sim.logfit import log_statistics, mtbf_uncertainty, with_log_fit
from raps_slurm.sim.runner import run_report
from raps_slurm.sim.scenario import load_scenario, override
from raps_slurm.sim.trace import NodeStream, by_number

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "examples" / "scenarios" / "lanl-sample.csv"
LANL_YAML = ROOT / "examples" / "scenarios" / "lanl.yaml"
HEADER = ("System,machine type,nodes,procstot,procsinnode,nodenum,nodenumz,node install,"
          "node prod,node decom,fru type,mem,cputype,memtype,num intercon,purpose,"
          "Prob Started,Prob Fixed,Down Time,Facilities,Hardware,Human Error,Network,"
          "Undetermined,Software,Same Event")


def row(system: str, nodes: str, z: str, start: str, end: str, column: int = 1,
        cause: str = "CPU") -> str:
    causes = [""] * 6
    if column >= 0:
        causes[column] = cause
    return ",".join([system, "cluster", nodes, "64", "4", z, z, "3-Jun", "3-Dec", "current",
                     "part", "8", "3", "3", "1", "compute", start, end, "10", *causes, "No"])


def test_the_sample_holds_two_systems_in_lanls_layout() -> None:
    records = parse_lanl(SAMPLE.read_text(), "sample")
    assert systems(records) == {"31": (32, 109), "32": (4, 37)}
    assert {r.kind for r in records} <= {"hardware", "software", "undetermined", "network",
                                         "facilities", "human", "unknown"}


@pytest.mark.parametrize(("z", "source", "nodes", "rule", "expected"), [
    (0, 512, 128, "block", 1), (3, 512, 128, "block", 1), (4, 512, 128, "block", 2),
    (511, 512, 128, "block", 128), (5, 16, 64, "block", 6), (5, 16, 16, "block", 6),
    (127, 512, 128, "first", 128), (128, 512, 128, "first", None),
])
def test_the_mapping_rule(z: int, source: int, nodes: int, rule: str,
                          expected: int | None) -> None:
    assert target_node(z, source, nodes, rule) == expected


def test_a_system_on_its_own_size_keeps_its_nodes_and_reads_back() -> None:
    conv = convert(parse_lanl(SAMPLE.read_text()), "31", None)
    assert (conv.nodes, conv.per_node, conv.failures, conv.warnings) == (32, 1, 109, ())
    log = parse_failure_log(conv.text)
    assert len(log) == 109
    names = sorted({f.node for f in log})
    cluster = tuple(f"n{i:04d}" for i in range(1, 33))
    assert by_number(names, cluster) is not None  # each source node is its own cluster node
    low, high = conv.node_mtbf_h_ci95
    assert low < conv.node_mtbf_h < high
    assert conv.fit is not None and conv.fit.better == "weibull"


def test_folding_onto_fewer_nodes_warns_and_keeps_every_outage() -> None:
    records = parse_lanl(SAMPLE.read_text())
    conv = convert(records, "31", 8)
    assert conv.per_node == 4 and conv.failures == 109
    assert any("folded onto 8" in w and "4 times as often" in w for w in conv.warnings)
    assert len({f.node for f in parse_failure_log(conv.text)}) <= 8
    first = convert(records, "31", 8, "first")
    assert first.per_node == 1 and first.failures + first.dropped == 109 and first.dropped > 0
    assert any(f"{first.dropped} outages" in w for w in first.warnings)
    assert first.node_mtbf_h == conv.node_mtbf_h  # the system's own, whatever is kept


def test_causes_two_digit_years_and_rows_without_a_node() -> None:
    text = "\n".join([HEADER,
                      row("7", "4", "0", "1/2/04 3:04", "1/2/04 5:00", column=2, cause="oops"),
                      row("7", "4", "1", "2/2/2004 3:04", "2/2/2004 3:40", column=-1),
                      row("7", "4", "1", "3/9/2004 10:00", "3/9/2004 11:00", column=5),
                      row("7", "", "", "3/9/2004 12:00", "3/9/2004 12:30")]) + "\n"
    records = parse_lanl(text)
    assert [r.kind for r in records] == ["human", "unknown", "software", "unknown"]
    conv = convert(records, None, None)
    assert conv.failures == 3
    assert any("1 rows of system 7 name no node" in w for w in conv.warnings)
    log = parse_failure_log(conv.text)
    assert log[0].down_s == pytest.approx(116 * 60.0)


@pytest.mark.parametrize(("lines", "message"), [
    ([], "empty file"),
    (["System,nodes\n"], "header lacks nodenumz, Prob Started, Prob Fixed"),
    ([HEADER, row("1", "4", "0", "2004-01-01 3:00", "1/1/2004 4:00")],
     "line 2: Prob Started: expected m/d/yyyy h:mm"),
    ([HEADER, row("1", "4", "x", "1/1/2004 3:00", "1/1/2004 4:00")], "line 2: nodenumz"),
    ([HEADER, row("1", "4", "0", "1/1/2004 3:00", "1/1/2004 2:00")], "line 2: Prob Fixed"),
])
def test_bad_lanl_files_are_one_line_each(lines: list[str], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_lanl("\n".join(lines))


def test_the_system_must_be_named_when_there_are_several() -> None:
    records = parse_lanl(SAMPLE.read_text(), "sample")
    with pytest.raises(ScenarioError, match=r"holds several systems.*31 \(32 nodes, 109"):
        convert(records, None, None, source="sample")
    with pytest.raises(ScenarioError, match="'99' is not in sample"):
        convert(records, "99", None, source="sample")


def test_the_report_states_the_mtbf_interval_and_the_fit() -> None:
    s = override(load_scenario(LANL_YAML), "failures.log_mode", "replay")
    stats = log_statistics(s)
    assert stats is not None and stats["failures"] == 109
    low, high = stats["node_mtbf_h_ci95"]
    assert low < stats["node_mtbf_h"] < high
    assert stats["fit"]["better"] == "weibull"
    s = override(override(s, "run.seeds", 1), "run.horizon_days", 20)
    report, _ = run_report(s)
    unc = mtbf_uncertainty(report, stats)
    for name, r in unc["strategies"].items():
        at_low, at_high = r["useful_work_fraction_at_ends"]
        assert at_low <= r["useful_work_fraction"] <= at_high, name
        i_low, i_high = r["interval_s_at_ends"]
        assert i_low < r["interval_s"] < i_high, name
    for end in unc["global_daly_at_ends"]:
        assert end["fraction_at_own_interval"] >= end["fraction_at_interval"]


def test_fit_mode_draws_weibull_times_with_the_logs_mtbf() -> None:
    s = load_scenario(LANL_YAML)
    assert s.failures.log_mode == "fit"
    assert load_failure_log(s) is None and read_failure_log(s) is not None  # not replayed
    fitted = with_log_fit(s)
    stats = log_statistics(s)
    assert stats is not None
    assert fitted.failures.distribution == "weibull"
    assert fitted.failures.weibull_shape == pytest.approx(stats["fit"]["weibull"]["shape"])
    assert fitted.failures.mtbf_h == pytest.approx(stats["node_mtbf_h"])
    stream = NodeStream(1, "n0001", fitted)
    draws = [stream.uptime() / 3600.0 for _ in range(4000)]
    assert sum(draws) / len(draws) == pytest.approx(fitted.failures.mtbf_h, rel=0.1)
    replay = override(s, "failures.log_mode", "replay")
    assert with_log_fit(replay) == replay  # the default changes nothing


def test_fit_mode_keeps_exponential_for_an_exponential_log(tmp_path: Path) -> None:
    rng = random.Random(5)
    lines = ["time,node,kind,end"]
    for node in range(1, 9):
        t = rng.expovariate(1 / 300.0)
        while t < 8000.0:
            lines.append(f"{t * 3600:.0f},cn{node:03d},hardware,{(t + 1) * 3600:.0f}")
            t += 1 + rng.expovariate(1 / 300.0)
    (tmp_path / "log.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "s.yaml").write_text("cluster: {racks: [4, 4]}\njob: {nodes: 6}\n"
                                     "raps: {spares: 2}\nfailures: {log: log.csv, "
                                     "log_mode: fit, distribution: weibull}\n")
    s = with_log_fit(load_scenario(tmp_path / "s.yaml"))
    assert s.failures.distribution == "exponential"
    assert 200.0 < s.failures.mtbf_h < 450.0


def test_fit_mode_needs_a_log(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("failures: {log_mode: fit}\n")
    with pytest.raises(ScenarioError, match=r"failures\.log_mode: 'fit' needs a failures\.log"):
        load_scenario(tmp_path / "s.yaml")


def test_convert_lanl_command(tmp_path: Path) -> None:
    out = tmp_path / "log.csv"
    r = subprocess.run([sys.executable, "-m", "raps_slurm.cli", "simulate", "convert-lanl",
                        str(SAMPLE), str(out), "--system", "31", "--nodes", "16", "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert (summary["failures"], summary["nodes"], summary["source_nodes_per_node"]) == \
        (109, 16, 2)
    assert "warning: --map block" in r.stderr
    assert len(parse_failure_log(out.read_text())) == 109


def test_weibull_nodes_start_in_service() -> None:
    # From an equilibrium start a renewal process fails T / mean times in [0, T] whatever
    # its shape; nodes started new with k < 1 would fail far more often early on.
    from raps_slurm.sim.scenario import parse_scenario

    s = parse_scenario({"failures": {"mtbf_h": 100.0, "distribution": "weibull",
                                     "weibull_shape": 0.5, "repair_h": 0.0}}, "t")
    horizon = 50.0 * 3600.0
    counts = []
    for seed in range(4000):
        stream, t, n = NodeStream(seed, "n1", s), 0.0, 0
        t = stream.first_uptime()
        while t < horizon:
            n += 1
            t += stream.uptime()
        counts.append(n)
    assert sum(counts) / len(counts) == pytest.approx(0.5, rel=0.08)


def test_a_sweep_cannot_vary_the_fit() -> None:
    r = subprocess.run([sys.executable, "-m", "raps_slurm.cli", "simulate", "sweep",
                        str(LANL_YAML), "--vary", "failures.log_mode=replay,fit"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert r.returncode == 2
    assert "--vary failures.log_mode: the log's fit" in r.stderr
