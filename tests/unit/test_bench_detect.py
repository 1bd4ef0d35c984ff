"""``rapsctl bench detect`` without a cluster: SlurmdTimeout as the cluster reports it."""

from __future__ import annotations

import pytest

from raps_slurm.bench.detect import slurmd_timeout_s
from raps_slurm.errors import BenchError
from raps_slurm.slurm.parsers import parse_show_config

SHOW_CONFIG = """Configuration data as of 2026-12-05T03:00:00
SlurmUser               = slurm(64030)
SlurmctldTimeout        = 120 sec
SlurmdTimeout           = {}
SlurmdUser              = root(0)
"""


def test_the_timeout_is_read_from_show_config() -> None:
    assert slurmd_timeout_s(parse_show_config(SHOW_CONFIG.format("10 sec"))) == 10
    assert slurmd_timeout_s(parse_show_config(SHOW_CONFIG.format("300 sec"))) == 300
    assert slurmd_timeout_s({"SlurmdTimeout": "0"}) == 0


@pytest.mark.parametrize("value", ["", "ten sec", "10 min", "10.5 sec"])
def test_anything_else_is_one_line(value: str) -> None:
    with pytest.raises(BenchError, match=r"^bench detect: .*SlurmdTimeout .*not seconds$"):
        slurmd_timeout_s(parse_show_config(SHOW_CONFIG.format(value)))


def test_a_missing_timeout_is_one_line() -> None:
    with pytest.raises(BenchError, match="SlurmdTimeout None"):
        slurmd_timeout_s({"SlurmUser": "slurm(64030)"})
