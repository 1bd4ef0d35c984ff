"""``rapsctl config check`` as a user runs it: real process, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def rapsctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "RAPS_CONFIG"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "raps_slurm.cli", *args], capture_output=True,
                          text=True, env=full_env, cwd=ROOT, timeout=60, check=False)


def test_shipped_config_checks_clean() -> None:
    r = rapsctl("config", "check", "configs/raps.yaml")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["checkpoint"]["interval_sec"] == 600


def test_json_output() -> None:
    r = rapsctl("config", "check", "configs/test.yaml", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["detection"]["kernel_heartbeat_interval_sec"] == 0.2


def test_typo_exits_2_and_suggests(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpoint:\n  intervl_sec: 5\n")
    r = rapsctl("config", "check", str(bad))
    assert r.returncode == 2
    assert "checkpoint.intervl_sec" in r.stderr and "interval_sec" in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1


def test_every_error_printed(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpoint: {intervl_sec: 5, replica_count: 99}\nlogging: {level: LOUD}\n")
    r = rapsctl("config", "check", str(bad))
    assert r.returncode == 2 and r.stderr.count("\n") == 3, r.stderr


def test_field_and_cross_field_errors_in_one_run(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpoint: {replica_count: 99}\n"
                   "logging: {level: LOUD}\n"
                   "messagelog: {buffer_size_mb: 128, buffer_high_watermark_mb: 200}\n")
    r = rapsctl("config", "check", str(bad))
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 3, r.stderr
    assert any("checkpoint.replica_count: 99 is out of range" in x for x in lines), r.stderr
    assert any("logging.level: 'LOUD' is not allowed" in x for x in lines), r.stderr
    assert any("messagelog.buffer_high_watermark_mb: 200 must be below "
               "messagelog.buffer_size_mb = 128" in x for x in lines), r.stderr
    assert all(x.startswith(f"rapsctl: {bad}: ") for x in lines), r.stderr


def test_env_var_is_used(tmp_path: Path) -> None:
    f = tmp_path / "env.yaml"
    f.write_text("checkpoint: {interval_sec: 42}\n")
    r = rapsctl("config", "check", "--json", env={"RAPS_CONFIG": str(f)})
    assert r.returncode == 0 and json.loads(r.stdout)["checkpoint"]["interval_sec"] == 42


def test_global_config_option(tmp_path: Path) -> None:
    f = tmp_path / "g.yaml"
    f.write_text("checkpoint: {interval_sec: 43}\n")
    r = rapsctl("--config", str(f), "config", "check", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["checkpoint"]["interval_sec"] == 43


def test_missing_file_and_bad_usage_are_one_line() -> None:
    r = rapsctl("config", "check", "/nonexistent/raps.yaml")
    assert r.returncode == 2 and "cannot read" in r.stderr and r.stderr.count("\n") == 1
    r = rapsctl("config", "check", "--bogus")
    assert r.returncode == 2 and "No such option" in r.stderr and "--bogus" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    r = rapsctl("frobnicate")
    assert r.returncode == 2 and "No such command 'frobnicate'" in r.stderr


def test_raps_run_refuses_bad_command_lines_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    cases = [([], "'--' is missing"), (["--mem=1G", "--"], "no program after '--'"),
             (["-N2", "--", "true"], "raps-run sets --nodes itself"),
             (["--nodelist=n1", "--", "true"], "raps-run sets --nodelist itself"),
             (["--", "true"], "SLURM_JOB_ID is not set")]
    for args, message in cases:
        r = subprocess.run([sys.executable, "-c", "from raps_slurm.launcher import main; main()",
                            *args], capture_output=True, text=True, timeout=60, check=False,
                           env=env)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
