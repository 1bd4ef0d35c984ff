"""rapsctl's table printer: aligned columns, ``-`` for missing values, JSON untouched."""

from __future__ import annotations

import json

import pytest

from raps_slurm.cli.output import table


def test_missing_values_print_a_dash(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"domain": "rack1", "score": 1.0, "last_failure_age_s": None, "weights": ""},
            {"domain": "rack2", "score": 0.25, "last_failure_age_s": 40, "weights": []},
            {"domain": "rack3", "score": 0}]  # a row without some keys
    table(rows, False, ["domain", "score", "last_failure_age_s", "weights"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["domain", "score", "last_failure_age_s", "weights"]
    assert lines[1].split() == ["rack1", "1.0", "-", "-"]
    assert lines[2].split() == ["rack2", "0.25", "40", "-"]
    assert lines[3].split() == ["rack3", "0", "-", "-"]  # 0 is a value, not missing
    assert "None" not in "\n".join(lines)
    # columns stay aligned: each header starts where its cells start
    at = lines[0].index("last_failure_age_s")
    assert lines[1][at] == "-" and lines[2][at:at + 2] == "40"


def test_json_keeps_null(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"domain": "rack1", "last_failure_age_s": None}]
    table(rows, True, ["domain", "last_failure_age_s"])
    assert json.loads(capsys.readouterr().out) == rows
