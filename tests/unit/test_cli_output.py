"""rapsctl's table printer: aligned columns, ``-`` for missing values, JSON untouched;
control characters a user put in a job name or a reason shown escaped, never sent to the
terminal."""

from __future__ import annotations

import json

import pytest

from raps_slurm.cli import main
from raps_slurm.cli.output import printable, records, table

ESC = "\x1b"


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


@pytest.mark.parametrize(("raw", "shown"), [
    ("plain name-1_ok", "plain name-1_ok"),          # unchanged, backslashes too
    ("C:\\dir", "C:\\dir"),
    (f"{ESC}[2Jwiped", "\\x1b[2Jwiped"),
    ("two\nlines\r\tx", "two\\nlines\\r\\tx"),
    ("bell\x07del\x7fcsi\x9b", "bell\\x07del\\x7fcsi\\x9b"),
    ("evil\u202etxt.exe", "evil\\u202etxt.exe"),   # right-to-left override
    ("line\u2028sep", "line\\u2028sep"),
    ("a\\x1b and \x1b", "a\\\\x1b and \\x1b"),      # a literal escape stays tellable
    ("snow ☃ é", "snow ☃ é"),
])
def test_printable_escapes_what_a_terminal_acts_on(raw: str, shown: str) -> None:
    assert printable(raw) == shown
    assert all(ch.isprintable() for ch in printable(raw))


def test_tables_and_records_escape_user_text(capsys: pytest.CaptureFixture[str]) -> None:
    name = f"job{ESC}]0;owned{chr(7)}{ESC}[2K"
    table([{"job": "5", "name": name}], False, ["job", "name"])
    records([[[("JobId", "5"), ("Name", name)], [("Reason", ["a\nb", "c"])]]], False)
    out = capsys.readouterr().out
    assert ESC not in out and chr(7) not in out
    assert "job\\x1b]0;owned\\x07\\x1b[2K" in out
    assert "Reason=a\\nb,c" in out
    lines = out.splitlines()
    assert lines[1].split() == ["5", printable(name)] and len(lines) == 5  # nothing forged
    table([{"job": "5", "name": name}], True, ["job", "name"])  # JSON: json.dumps escapes
    assert json.loads(capsys.readouterr().out) == [{"job": "5", "name": name}]


def test_an_error_line_is_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["config", "check", f"/nonexistent/{ESC}[31mred"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == "rapsctl: /nonexistent/\\x1b[31mred: cannot read: No such file or directory\n"
