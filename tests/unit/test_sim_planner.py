"""The planner's choices (each strategy's own interval) and the inputs it must refuse or
warn about."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from raps_slurm.errors import ScenarioError
from raps_slurm.sim.intervals import choose, with_interval
from raps_slurm.sim.models import daly_fraction, daly_interval
from raps_slurm.sim.periodic import global_costs
from raps_slurm.sim.runner import choices, node_mtbf_h, run_report, warnings
from raps_slurm.sim.scenario import load_scenario, parse_scenario
from raps_slurm.sim.sweep import daly_curve
from raps_slurm.sim.trace import build_layout, node_timeline

SMALL = {"job": {"nodes": 16, "state_gb_per_node": 4}, "raps": {"spares": 2},
         "cluster": {"racks": 4, "idle_nodes": 2},
         "failures": {"mtbf_h": 400}, "run": {"seeds": 2, "horizon_days": 60}}


def test_global_takes_dalys_interval_and_a_pin_wins() -> None:
    s = parse_scenario(SMALL, "t")
    g = global_costs(s, 16)
    m = 400 * 3600.0 / 16
    c = choices(s)
    assert c["global"].interval_s == pytest.approx(daly_interval(g.delta, m), abs=0.1)
    assert "Daly" in c["global"].why
    pinned = choices(parse_scenario({**SMALL, "global": {"interval_s": 777}}, "t"))
    assert pinned["global"].interval_s == 777 and "global.interval_s" in pinned["global"].why
    every = choices(parse_scenario({**SMALL, "checkpoint": {"interval_s": 900}}, "t"))
    assert {c.interval_s for c in every.values()} == {900}
    assert all("checkpoint.interval_s" in c.why for c in every.values())


def test_the_search_returns_the_best_interval_it_simulated() -> None:
    s = parse_scenario(SMALL, "t")
    seen: list[float] = []

    def evaluate(scn: object, name: str) -> float:
        t = scn.checkpoint.interval_s  # type: ignore[attr-defined]
        seen.append(t)
        return -abs(math.log(t / 1234.0))  # a single peak at 1234 s

    c = choose(s, "raps", 400 * 3600.0 / 16, 16, evaluate)
    assert c.interval_s == max(seen, key=lambda t: -abs(math.log(t / 1234.0)))
    assert len(seen) == len(set(seen)) <= 7 and "best of" in c.why
    assert c.tried and max(c.tried, key=lambda x: x[2])[0] == c.interval_s


def test_scr_flush_frequency_is_chosen_unless_pinned() -> None:
    s = parse_scenario(SMALL, "t")
    got = choose(s, "scr", 90_000.0, 16,
                 lambda scn, name: -abs(scn.scr.flush_every - 20))  # type: ignore[attr-defined]
    assert got.flush_every == 20
    pin = parse_scenario({**SMALL, "scr": {"flush_every": 5}}, "t")
    assert choose(pin, "scr", 90_000.0, 16, lambda scn, name: 0.5).flush_every == 5


def test_seed_128_reports_each_strategy_at_its_own_interval() -> None:
    root = Path(__file__).resolve().parents[2]
    s = load_scenario(root / "examples" / "scenarios" / "seed-128.yaml")
    s = with_interval(s, 0.0)
    rep, _ = run_report(parse_scenario({**_data(s), "run": {"seeds": 1,
                                                              "horizon_days": 120}}, "t"))
    iv = rep["intervals"]
    assert set(iv) == {"raps", "global", "scr", "step"}
    assert iv["global"]["interval_s"] == rep["models"]["daly_interval_s"]
    assert len({iv[n]["interval_s"] for n in iv}) == 4  # their own, not one shared
    assert abs(rep["strategies"]["global"]["useful_work_fraction"]
               - rep["models"]["daly_global_fraction_at_daly"]) < 0.02


def _data(s: object) -> dict[str, object]:
    from raps_slurm.sim.scenario import to_dict
    return to_dict(s)


def test_daly_fraction_does_not_overflow_on_a_short_mtbf() -> None:
    assert 0.0 < daly_fraction(600.0, 60.0, 600.0, 2.0) < 1e-200  # no OverflowError
    assert daly_fraction(600.0, 60.0, 600.0, 0.01) == 0.0
    # and is the closed form where it is finite
    m = 40_000.0
    exact = 600.0 / (m * math.exp(600.0 / m) * math.expm1(660.0 / m))
    assert daly_fraction(600.0, 60.0, 600.0, m) == pytest.approx(exact, rel=1e-12)


def test_a_synthetic_timeline_too_long_is_refused_before_it_is_built() -> None:
    s = parse_scenario({"job": {"nodes": 16}, "raps": {"spares": 2},
                        "failures": {"mtbf_h": 0.001, "repair_h": 0},
                        "checkpoint": {"interval_s": 600}}, "t")
    with pytest.raises(ScenarioError) as exc:
        node_timeline(s, build_layout(s), 1, 365 * 86400.0)
    assert exc.value.errors[0].startswith("failures.mtbf_h: 0.001 h on 34 nodes")
    assert "at most 5000000" in exc.value.errors[0]


def test_daly_curve_uses_the_logs_mtbf(tmp_path: Path) -> None:
    log = tmp_path / "f.csv"
    log.write_text("time,node,kind\n" + "".join(
        f"2024-01-{d:02d}T00:00:00,n{d:04d},hardware\n" for d in range(1, 11)))
    scn = tmp_path / "s.yaml"
    scn.write_text(f"failures: {{log: {log}, mtbf_h: 1000000}}\njob: {{nodes: 16}}\n"
                   "raps: {spares: 2}\ncluster: {racks: 2, idle_nodes: 2}\n"
                   "checkpoint: {interval_s: 600}\n")
    s = load_scenario(scn)
    m = node_mtbf_h(s)
    assert m < 10_000  # the log's, not failures.mtbf_h
    g = global_costs(s, 16)
    ((_, f),) = daly_curve(s, [600.0])
    assert f == pytest.approx(daly_fraction(600.0, g.delta, g.restart, m * 3600.0 / 16))


def test_a_larger_machines_log_is_folded_with_a_warning(tmp_path: Path) -> None:
    log = tmp_path / "f.csv"
    log.write_text("time,node,kind\n" + "".join(
        f"2024-01-{d:02d}T00:00:00,cn{1000 + d},hardware\n" for d in range(1, 11)))
    scn = tmp_path / "s.yaml"
    scn.write_text(f"failures: {{log: {log}}}\njob: {{nodes: 16}}\nraps: {{spares: 2}}\n"
                   "cluster: {racks: 2, idle_nodes: 2}\ncheckpoint: {interval_s: 600}\n")
    w = [x for x in warnings(load_scenario(scn)) if x.startswith("failures.log")]
    assert len(w) == 1 and "folded onto the first 10 nodes" in w[0]
    fits = tmp_path / "g.csv"
    fits.write_text(log.read_text().replace("cn10", "cn00"))
    scn.write_text(scn.read_text().replace(str(log), str(fits)))
    assert not [x for x in warnings(load_scenario(scn)) if x.startswith("failures.log")]


def test_a_rack_list_does_not_silently_replace_idle_nodes() -> None:
    with pytest.raises(ScenarioError) as exc:
        parse_scenario({"cluster": {"racks": [10, 10], "idle_nodes": 5},
                        "job": {"nodes": 12}, "raps": {"spares": 2}}, "t")
    assert exc.value.errors == ["t: cluster.idle_nodes: not with a list of rack sizes (the "
                                "idle nodes are what the racks hold beyond job.nodes and "
                                "raps.spares); leave it out or give a rack count"]
    ok = parse_scenario({"cluster": {"racks": [10, 10]}, "job": {"nodes": 12},
                         "raps": {"spares": 2}}, "t")
    assert ok.cluster.idle_nodes == 6


def test_a_cluster_that_cannot_run_the_job_says_so() -> None:
    s = parse_scenario({"job": {"nodes": 64, "state_gb_per_node": 100},
                        "raps": {"spares": 2}, "failures": {"mtbf_h": 1, "repair_h": 1},
                        "checkpoint": {"interval_s": 3600},
                        "run": {"seeds": 1, "horizon_days": 2,
                                "strategies": ["global"]}}, "t")
    rep, _ = run_report(s)
    assert rep["strategies"]["global"]["useful_work_fraction"] == 0.0
    assert any(w.startswith("global: no useful work in any seed checkpointing every 3600 s")
               for w in rep["warnings"]), rep["warnings"]


def test_advise_names_the_strategy_with_the_most_work_per_node() -> None:
    from raps_slurm.sim.advise import advise

    out = advise(parse_scenario({**SMALL, "run": {"seeds": 2, "horizon_days": 30}}, "t"))
    eff = {n: r["node_efficiency"] for n, r in out["strategies"].items()}
    assert out["best"] == max(eff, key=lambda n: eff[n])
    assert out["strategies"]["global"]["spares"] == 0
    assert out["strategies"]["scr"]["flush_every"] in (2, 5, 10, 20, 50)
    assert all(out["strategies"][n]["interval_s"] > 0 for n in eff)


def test_advise_takes_the_messaging_cost_from_bench_mpi(tmp_path: Path) -> None:
    from raps_slurm.sim.advise import messaging_cost

    root = Path(__file__).resolve().parents[2]
    runs = sorted((root / "docs" / "runs").glob("bench-mpi-*.json"))
    assert runs, "docs/runs holds the bench mpi outputs"
    s = parse_scenario(SMALL, "t")
    none, _ = messaging_cost(s, str(runs[0]), 0.0)
    quarter, how = messaging_cost(s, str(runs[0]), 0.25)
    assert none.raps.log_overhead == 0.0 < quarter.raps.log_overhead
    assert "Open MPI" in how
    bad = tmp_path / "m.json"
    bad.write_text((root / "examples" / "calibration" / "detect.json").read_text())
    with pytest.raises(ScenarioError, match="expected the output of rapsctl bench mpi"):
        messaging_cost(s, str(bad), 0.25)


def test_the_map_scales_the_cluster_and_draws_the_winners(tmp_path: Path) -> None:
    from raps_slurm.sim.advise import advice_map, scaled
    from raps_slurm.sim.plots import plot_advice_map

    s = parse_scenario({**SMALL, "run": {"seeds": 1, "horizon_days": 10}}, "t")
    big = scaled(s, 64, 1000.0)
    assert (big.job.nodes, big.raps.spares, big.cluster.idle_nodes) == (64, 8, 8)
    assert big.failures.mtbf_h == 1000.0 and big.cluster.racks == 16  # 5 nodes per rack
    rows = advice_map(s, (16, 64), (500.0, 5000.0))
    assert [(r["nodes"], r["node_mtbf_h"]) for r in rows] == [
        (16, 500.0), (16, 5000.0), (64, 500.0), (64, 5000.0)]
    for r in rows:
        eff = {n: r[f"{n}_node_efficiency"] for n in ("raps", "global", "scr")}
        assert r["best"] == max(eff, key=lambda n: eff[n])
    png = plot_advice_map(rows, tmp_path / "m.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
