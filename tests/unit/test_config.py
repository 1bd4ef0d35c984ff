"""Strict config loading: every key, every kind of bad value, one line each."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from raps_slurm import config as cfgmod
from raps_slurm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def errors_of(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        cfgmod.parse_config(data)
    return info.value.errors


def test_shipped_reference_is_what_rapsctl_config_defaults_prints() -> None:
    from raps_slurm.cli.config_cmd import reference
    assert (ROOT / "configs" / "raps.yaml").read_text() == reference(), (
        "configs/raps.yaml is stale: rapsctl config defaults > configs/raps.yaml")


def test_shipped_reference_carries_every_key_with_its_default_and_a_comment() -> None:
    text = (ROOT / "configs" / "raps.yaml").read_text()
    data = yaml.safe_load(text)
    assert cfgmod.to_dict(cfgmod.parse_config(data)) == cfgmod.to_dict(cfgmod.Config())
    assert data == cfgmod.to_dict(cfgmod.Config())  # every key written out, none missing
    for path, _default, _doc in cfgmod.describe():
        key = path.split(".")[1]
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"{key}:"))
        assert "# " in line, f"{path} has no comment in configs/raps.yaml"


def test_seed_defaults() -> None:
    c = cfgmod.Config()
    assert (c.checkpoint.interval_sec, c.checkpoint.replica_count, c.checkpoint.max_generations,
            c.checkpoint.large_message_threshold_kb) == (600, 2, 5, 4096)
    assert (c.messagelog.batch_flush_ms, c.messagelog.buffer_size_mb,
            c.messagelog.buffer_high_watermark_mb) == (100, 256, 192)
    d = c.detection
    assert (d.kernel_heartbeat_interval_sec, d.app_heartbeat_interval_sec,
            d.telemetry_interval_sec, d.miss_threshold, d.app_miss_threshold,
            d.lease_duration_sec, d.smart_temperature_c,
            d.retransmit_ratio_threshold) == (1, 10, 30, 3, 5, 15, 70, 0.05)
    r = c.recovery
    assert (r.prefer_original_rack, r.max_concurrent_recoveries, r.recovery_timeout_sec,
            r.use_delta_transfer) == (True, 4, 300, True)


def test_test_profile_is_valid_and_short() -> None:
    c = cfgmod.load_file(ROOT / "configs" / "test.yaml")
    d = c.detection
    assert d.kernel_heartbeat_interval_sec <= 0.2 and d.app_heartbeat_interval_sec <= 1
    assert d.app_heartbeat_interval_sec * d.app_miss_threshold <= 5  # hung verdict in seconds


def test_config_is_frozen() -> None:
    c = cfgmod.Config()
    with pytest.raises(AttributeError):
        c.checkpoint.interval_sec = 5  # type: ignore[misc]


def test_unknown_key_suggests_the_close_one() -> None:
    [err] = errors_of({"checkpoint": {"intervl_sec": 5}})
    assert "checkpoint.intervl_sec" in err and "did you mean 'interval_sec'" in err


def test_unknown_section() -> None:
    [err] = errors_of({"checkpiont": {}})
    assert err.startswith("config: checkpiont: unknown key; did you mean 'checkpoint'?")


@pytest.mark.parametrize(("data", "needle"), [
    ({"checkpoint": {"interval_sec": "600"}}, "checkpoint.interval_sec: expected an integer, got '600'"),
    ({"checkpoint": {"interval_sec": 1.5}}, "checkpoint.interval_sec: expected an integer"),
    ({"checkpoint": {"interval_sec": True}}, "checkpoint.interval_sec: expected an integer, got True"),
    ({"checkpoint": {"replica_count": 9}}, "checkpoint.replica_count: 9 is out of range, allowed 0 to 8"),
    ({"checkpoint": {"interval_sec": 0}}, "checkpoint.interval_sec: 0 is out of range"),
    ({"recovery": {"prefer_original_rack": "yes"}},
     "recovery.prefer_original_rack: expected true or false, got 'yes'"),
    ({"detection": {"retransmit_ratio_threshold": 2}},
     "detection.retransmit_ratio_threshold: 2 is out of range, allowed 0 to 1"),
    ({"store": {"endpoints": "http://x:2379"}}, "store.endpoints: expected a list of strings"),
    ({"store": {"endpoints": ["x:2379"]}}, "store.endpoints: 'x:2379' is not an http:// or https:// URL"),
    ({"store": {"prefix": "raps"}}, "store.prefix: 'raps' must start and end with '/'"),
    ({"store": {"cert_file": "/c.pem"}}, "cert_file and key_file must be set together"),
    ({"coordinator": {"addresses": ["host"]}}, "coordinator.addresses: 'host' is not host:port"),
    ({"coordinator": {"heartbeat_source_burst": 0}},
     "coordinator.heartbeat_source_burst: 0 is out of range, allowed 1 to"),
    ({"coordinator": {"heartbeat_source_rate": 0}},
     "coordinator.heartbeat_source_rate: 0 is out of range"),
    ({"logging": {"level": "LOUD"}}, "logging.level: 'LOUD' is not allowed, expected one of DEBUG"),
    ({"topology": {"power_domains": {"pdu1": 3}}}, "topology.power_domains: expected a mapping"),
    ({"checkpoint": 5}, "checkpoint: expected a mapping of keys, got 5"),
    ([1, 2], "config: expected a mapping of keys"),
])
def test_bad_values_name_key_value_and_allowed(data: object, needle: str) -> None:
    errs = errors_of(data)
    assert any(needle in e for e in errs), errs
    assert all("\n" not in e for e in errs)


def test_inconsistent_pairs() -> None:
    [err] = errors_of({"detection": {"lease_duration_sec": 3, "miss_threshold": 3,
                                     "kernel_heartbeat_interval_sec": 1}})
    assert "detection.lease_duration_sec: 3 must exceed" in err and "= 3" in err
    [err] = errors_of({"messagelog": {"buffer_high_watermark_mb": 256}})
    assert "buffer_high_watermark_mb: 256 must be below messagelog.buffer_size_mb = 256" in err
    three = ["http://e1:2379", "http://e2:2379", "http://e3:2379"]
    [err] = errors_of({"store": {"endpoints": three, "timeout_sec": 5},
                       "coordinator": {"leader_lease_sec": 3}})
    assert err.startswith("config: store.timeout_sec: 5 must be under 2/3 of "
                          "coordinator.leader_lease_sec = 3 (so under 2)"), err
    # one endpoint: nothing to fail over to; the defaults (5 s, 10 s lease) fit
    cfgmod.parse_config({"store": {"timeout_sec": 5}, "coordinator": {"leader_lease_sec": 3}})
    cfgmod.parse_config({"store": {"endpoints": three}})


def test_every_error_is_reported_at_once() -> None:
    errs = errors_of({"checkpoint": {"intervl_sec": 5, "replica_count": -1},
                      "recovery": {"max_concurrent_recoveries": "4"}})
    assert len(errs) == 3


def test_cross_key_rules_run_beside_field_errors() -> None:
    errs = errors_of({"checkpoint": {"replica_count": 99},
                      "detection": {"lease_duration_sec": 2, "miss_threshold": 3,
                                    "kernel_heartbeat_interval_sec": 1},
                      "store": {"cert_file": "/etc/raps/c.pem"}})
    assert len(errs) == 3, errs
    assert any("checkpoint.replica_count" in e for e in errs)
    assert any("detection.lease_duration_sec: 2 must exceed" in e for e in errs)
    assert any("cert_file and key_file must be set together" in e for e in errs)


def test_a_rule_whose_key_failed_is_skipped() -> None:
    # lease 2 would be below 3 x 1 s, but the interval itself is wrong: one error, its own
    [err] = errors_of({"detection": {"lease_duration_sec": 2, "miss_threshold": 3,
                                     "kernel_heartbeat_interval_sec": "fast"}})
    assert "kernel_heartbeat_interval_sec: expected a number, got 'fast'" in err
    [err] = errors_of({"messagelog": {"buffer_high_watermark_mb": 999999999}})
    assert "buffer_high_watermark_mb" in err and "out of range" in err
    errs = errors_of({"messagelog": 7, "system": {"boost_below_score": 0.9}})
    assert errs[0] == "config: messagelog: expected a mapping of keys, got 7"
    assert "system.boost_recover_score: 0.8 must be at least" in errs[1] and len(errs) == 2
    [err] = errors_of([1, 2])
    assert "expected a mapping of keys" in err


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    p = tmp_path / "empty.yaml"
    p.write_text("")
    assert cfgmod.load_file(p) == cfgmod.Config()


def test_partial_file_overrides_only_its_keys(tmp_path: Path) -> None:
    p = tmp_path / "raps.yaml"
    p.write_text("checkpoint:\n  interval_sec: 120\n")
    c = cfgmod.load_file(p)
    assert c.checkpoint.interval_sec == 120 and c.checkpoint.replica_count == 2


def test_broken_yaml_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("checkpoint:\n  interval_sec: [1,\n")
    with pytest.raises(ConfigError) as info:
        cfgmod.load_file(p)
    assert re.search(r"bad\.yaml: line \d+ invalid YAML", str(info.value))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        cfgmod.load_file(tmp_path / "nope.yaml")


def test_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = tmp_path / "env.yaml"
    env_file.write_text("checkpoint: {interval_sec: 7}\n")
    cli_file = tmp_path / "cli.yaml"
    cli_file.write_text("checkpoint: {interval_sec: 9}\n")
    monkeypatch.setattr(cfgmod, "SYSTEM_CONFIG", tmp_path / "absent.yaml")
    monkeypatch.delenv("RAPS_CONFIG", raising=False)
    assert cfgmod.load_config() == cfgmod.Config()
    system = tmp_path / "system.yaml"
    system.write_text("checkpoint: {interval_sec: 5}\n")
    monkeypatch.setattr(cfgmod, "SYSTEM_CONFIG", system)
    assert cfgmod.load_config().checkpoint.interval_sec == 5
    monkeypatch.setenv("RAPS_CONFIG", str(env_file))
    assert cfgmod.load_config().checkpoint.interval_sec == 7
    assert cfgmod.load_config(str(cli_file)).checkpoint.interval_sec == 9


def test_bad_power_domain_hostlist() -> None:
    [err] = errors_of({"topology": {"power_domains": {"pdu1": "n[1-"}}})
    assert "topology.power_domains.pdu1: 'n[1-' is not a hostlist" in err


def test_docs_document_every_key() -> None:
    """docs/configuration.md's table names every key in its first column, and no key
    that does not exist."""
    rows = [line.split("|")[1] for line in
            (ROOT / "docs" / "configuration.md").read_text().splitlines()
            if line.startswith("| `")]
    documented = {k for cell in rows for k in re.findall(r"`([a-z_]+\.[a-z_]+)`", cell)}
    keys = {path for path, _default, _doc in cfgmod.describe()}
    assert not keys - documented, f"docs/configuration.md's table lacks {sorted(keys - documented)}"
    assert not documented - keys, f"docs/configuration.md names unknown keys {sorted(documented - keys)}"


def test_a_receive_limit_that_a_lost_peers_relaunch_cannot_meet_is_refused() -> None:
    """A waiter that gives up before its lost peer runs again requeues a job a recovery
    would have saved: recv_timeout_sec must exceed recovery_timeout_sec + the hang window."""
    [err] = errors_of({"messagelog": {"recv_timeout_sec": 60},
                       "recovery": {"recovery_timeout_sec": 60},
                       "detection": {"app_progress_timeout_sec": 10}})
    assert "messagelog.recv_timeout_sec: 60 must exceed" in err and "= 70" in err
    # the hang window defaults to 5 app heartbeats
    [err] = errors_of({"messagelog": {"recv_timeout_sec": 340}})
    assert "= 350" in err
    cfg = cfgmod.parse_config({"messagelog": {"recv_timeout_sec": 71},
                               "recovery": {"recovery_timeout_sec": 60},
                               "detection": {"app_progress_timeout_sec": 10}})
    assert cfg.messagelog.recv_timeout_sec == 71
    assert cfgmod.parse_config({}).messagelog.recv_timeout_sec == 600  # > 300 + 50
