"""``rapsctl simulate advise --map``: the map's JSON and title give the messaging cost the
raps strategy is charged (per message size when the job's messages are given), not the
raw ``raps.log_overhead`` key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raps_slurm.cli import main
from raps_slurm.sim.advise import map_title, messaging_used
from raps_slurm.sim.raps import log_share
from raps_slurm.sim.scenario import parse_scenario

SMALL = {"job": {"nodes": 16}, "raps": {"spares": 2, "log_overhead": 0.0943},
         "cluster": {"racks": 4, "idle_nodes": 2}}
# a latency-bound step: 200 8-byte messages in 0.01 s of computation
MESSAGES = {"step_s": 0.01, "msg_bytes": [8], "msg_per_step": [200]}


def test_the_cost_is_the_per_size_one_when_the_messages_are_given() -> None:
    s = parse_scenario({**SMALL, "job": {**SMALL["job"], **MESSAGES}}, "t")
    share, how = messaging_used(s)
    assert share == log_share(s) and abs(share - 0.0943) > 0.05
    assert "job.msg_bytes" in how
    assert f"{share:.3g}" in map_title(s) and "0.0943" not in map_title(s)
    plain = parse_scenario(SMALL, "t")
    assert messaging_used(plain) == (0.0943, "raps.log_overhead")
    assert "0.0943" in map_title(plain)


def test_the_map_json_holds_the_cost_used(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(json.dumps({**SMALL, "job": {**SMALL["job"], **MESSAGES},
                                    "run": {"strategies": ["raps", "global"]}}))
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "advise", "--scenario", str(scenario), "--seeds", "1", "--days",
              "2", "--map", str(tmp_path / "map"), "--map-nodes", "16", "--map-mtbf-h",
              "5000"])
    assert exc.value.code == 0, capsys.readouterr().err
    out = json.loads((tmp_path / "map" / "advise-map.json").read_text())
    share = log_share(parse_scenario({**SMALL, "job": {**SMALL["job"], **MESSAGES}}, "t"))
    assert out["log_overhead"] == round(share, 4)
    assert "job.msg_bytes" in out["log_overhead_from"]
