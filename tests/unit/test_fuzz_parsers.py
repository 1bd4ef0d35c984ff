"""Every parser of untrusted bytes (``raps_slurm.testing.fuzz_targets.TARGETS``), fed random and
mutated input: it returns a value or raises its own documented error, never anything else
(no IndexError, no struct.error, no UnicodeDecodeError, no hang). Heartbeat datagrams and
agent requests also have their own property tests (test_heartbeat.py, test_local_api.py);
test_atheris.py runs the same targets coverage-guided.

Bounded for CI; ``RAPS_FUZZ_EXAMPLES=100000 pytest tests/unit/test_fuzz_parsers.py``
runs longer on demand.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raps_slurm.testing.fuzz_targets import TARGETS, VALUES

EXAMPLES = int(os.environ.get("RAPS_FUZZ_EXAMPLES", "300"))
fuzz = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` cut, extended, or with bytes overwritten: the inputs that get furthest."""
    cut = st.integers(0, len(valid)).map(lambda n: valid[:n])
    extended = st.binary(min_size=1, max_size=64).map(lambda b: valid + b)

    def flip(args: tuple[int, int]) -> bytes:
        where, value = args
        if not valid:
            return valid
        b = bytearray(valid)
        b[where % len(b)] = value
        return bytes(b)

    flipped = st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)).map(flip)
    return st.one_of(cut, extended, flipped, st.binary(max_size=256))


@pytest.mark.parametrize("name", sorted(set(TARGETS) - {"etcd_value"}))
@fuzz
@given(data=st.data())
def test_target_survives_mutations_of_its_seed(name: str, data: st.DataObject) -> None:
    target = TARGETS[name]
    target.run(data.draw(mutations(target.seed)))


@fuzz
@given(raw=st.binary(max_size=512))
def test_authenticated_channel_refuses_unsigned_bytes(raw: bytes) -> None:
    TARGETS["transfer_channel"].run(raw)  # raises if random bytes pass authentication


# -- etcd values ------------------------------------------------------------------------

@fuzz
@given(which=st.integers(0, len(VALUES) - 1), data=st.data())
def test_etcd_records(which: int, data: st.DataObject) -> None:
    _, valid = VALUES[which]
    TARGETS["etcd_value"].run(bytes([which]) + data.draw(mutations(valid)))
