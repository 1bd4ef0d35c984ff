"""Heartbeat wire format, signature, replay guard and cluster key file: crafted and fuzzed input."""

from __future__ import annotations

import itertools
import math
import os
import socket
import stat
import struct
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from raps_slurm.errors import BadDatagram, ConfigError, RapsError
from raps_slurm.wire import heartbeat as hbm
from raps_slurm.wire.heartbeat import (
    KEY_BYTES,
    MAX_DATAGRAM,
    Ack,
    Heartbeat,
    Probe,
    ReplayGuard,
    ack_body,
    create_key,
    decode,
    decode_checked,
    encode,
    load_key,
    new_incarnation,
    node_key,
    parse_heartbeat,
    sign,
)
from raps_slurm.wire.heartbeat import body as message_body

KEY = bytes(range(64))
OTHER_KEY = bytes(range(1, 65))
U64 = (1 << 64) - 1
T0 = 1_700_000_000.25

# --- strategies -------------------------------------------------------------------------------

names = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
u64s = st.integers(min_value=0, max_value=U64)
times = st.floats(allow_nan=False, allow_infinity=False)
keys = st.binary(min_size=KEY_BYTES, max_size=128)
heartbeats = st.builds(Heartbeat, node=names, incarnation=u64s, counter=u64s, sent_at=times,
                       probe_reply=st.booleans())
acks = st.builds(Ack, node=names, incarnation=u64s, counter=u64s, sent_at=times,
                 leader_revision=u64s, acked_at=times)
probes = st.builds(Probe, node=names, nonce=u64s, sent_at=times)
messages = st.one_of(heartbeats, acks, probes)
# Signed bodies around a heartbeat's layout: any kind byte, flags, lengths and names.
signed_bodies = st.builds(
    lambda kind, fixed, name_len, name, prefix: sign(
        prefix + bytes((kind,)) + fixed + bytes((name_len,)) + name, KEY),
    st.sampled_from([1, 1, 1, 2, 3, 4, 9]), st.binary(min_size=25, max_size=25),
    st.integers(0, 255), st.binary(max_size=80), st.sampled_from([b"RPS\x01", b"RPS\x02"]))


def reason_of(data: bytes, key: bytes = KEY) -> str:
    """The BadDatagram reason decode gives for ``data``."""
    with pytest.raises(BadDatagram) as info:
        decode(data, key)
    return info.value.reason


def body(kind: int, fixed: bytes, name: bytes = b"node1", *, name_len: int | None = None,
         prefix: bytes = b"RPS\x01") -> bytes:
    """An unsigned datagram body with arbitrary, possibly wrong, pieces."""
    length = len(name) if name_len is None else name_len
    return prefix + bytes((kind,)) + fixed + bytes((length,)) + name


HB_FIXED = struct.pack(">QQdB", 7, 3, T0, 0)


# --- round trip -------------------------------------------------------------------------------

@pytest.mark.parametrize("msg", [
    Heartbeat("node1", 1, 2, T0),
    Heartbeat("c3-r12.n0_7", new_incarnation(), U64, -0.5, probe_reply=True),
    Ack("node1", 1, 2, T0, 99, T0 + 0.001),
    Probe("x", U64, T0),
    Probe("n" * 64, 0, 0.0),
])
def test_every_kind_round_trips(msg: Heartbeat | Ack | Probe) -> None:
    data = encode(msg, KEY)
    assert len(data) <= MAX_DATAGRAM
    assert data[:4] == b"RPS\x01"
    assert decode(data, KEY) == msg


@given(msg=messages, key=keys)
def test_round_trip_fuzz(msg: Heartbeat | Ack | Probe, key: bytes) -> None:
    assert decode(encode(msg, key), key) == msg


def test_layout_is_fixed() -> None:
    data = encode(Heartbeat("ab", 1, 2, 3.0, probe_reply=True), KEY)
    assert data[:-32] == b"RPS\x01\x01" + struct.pack(">QQdB", 1, 2, 3.0, 1) + b"\x02ab"
    assert len(encode(Ack("n" * 64, 1, 1, 1.0, 1, 1.0), KEY)) == 142  # largest fixed message
    assert len(encode(Probe("n", 1, 1.0), KEY)) == 55  # smallest message


# --- every reason from a crafted datagram -----------------------------------------------------

def test_reason_size() -> None:
    good = encode(Probe("n", 1, T0), KEY)
    assert reason_of(b"") == "size"
    assert reason_of(good[:-1]) == "size"  # below the smallest message
    assert reason_of(b"RPS\x01" + b"\0" * (MAX_DATAGRAM - 3)) == "size"  # 513 bytes
    assert reason_of(hbm.sign(b"RPS\x01\x01" + b"\0" * (MAX_DATAGRAM - 36), KEY)) == "size"
    # Exactly MAX_DATAGRAM bytes passes the size check and is judged on its contents.
    assert reason_of(hbm.sign(b"RPS\x01\x01" + b"\0" * (MAX_DATAGRAM - 37), KEY)) == "length"


def test_reason_magic_and_version() -> None:
    good = encode(Heartbeat("node1", 1, 1, T0), KEY)
    assert reason_of(b"XPS" + good[3:]) == "magic"
    assert reason_of(b"RPS\x02" + good[4:]) == "version"
    assert reason_of(b"RPS\x00" + good[4:]) == "version"
    # Checked on the fixed prefix: even a correctly signed datagram of another version drops.
    assert reason_of(hbm.sign(body(1, HB_FIXED, prefix=b"RPS\x02"), KEY)) == "version"


def test_reason_signature() -> None:
    good = encode(Heartbeat("node1", 1, 1, T0), KEY)
    assert reason_of(good, OTHER_KEY) == "signature"
    assert reason_of(good[:-1] + bytes((good[-1] ^ 1,))) == "signature"
    assert reason_of(good[:-32] + b"\0" * 32) == "signature"
    # A tampered field (counter bumped to renew a lease) breaks the signature.
    tampered = bytearray(good)
    tampered[20] ^= 0x01
    assert reason_of(bytes(tampered)) == "signature"


@pytest.mark.parametrize("kind", [0, 6, 255])
def test_reason_kind(kind: int) -> None:
    assert reason_of(hbm.sign(body(kind, HB_FIXED), KEY)) == "kind"


@pytest.mark.parametrize("crafted", [
    body(1, HB_FIXED, name_len=6),  # name shorter than its length byte says
    body(1, HB_FIXED, name_len=4),  # longer
    body(1, HB_FIXED + b"\0"),  # fixed part one byte too long
    body(2, HB_FIXED),  # an Ack needs 40 fixed bytes
    body(3, b"\0" * 15, b"n" * 20),  # 15-byte probe fields: every offset shifts
    b"RPS\x01\x02" + b"\0" * 20,  # signed, too short to hold the Ack fields at all
    body(1, HB_FIXED, b"n" * 65, name_len=255),
])
def test_reason_length(crafted: bytes) -> None:
    assert reason_of(hbm.sign(crafted, KEY)) == "length"


@pytest.mark.parametrize("name", [
    b"", b"n" * 65, b"node 1", b"node/1", b"-node", b".", b"..", b"_x", b"n\x00", b"n\xc3\xa9",
    b"\xff\xfe", b"node1\n",
])
def test_reason_name(name: bytes) -> None:
    assert reason_of(hbm.sign(body(1, HB_FIXED, name), KEY)) == "name"


@pytest.mark.parametrize("crafted", [
    body(1, struct.pack(">QQdB", 1, 1, math.nan, 0)),
    body(1, struct.pack(">QQdB", 1, 1, math.inf, 0)),
    body(1, struct.pack(">QQdB", 1, 1, -math.inf, 0)),
    body(1, struct.pack(">QQdB", 1, 1, T0, 2)),  # unknown flag bit
    body(1, struct.pack(">QQdB", 1, 1, T0, 0x81)),
    body(2, struct.pack(">QQdQd", 1, 1, T0, 1, math.nan)),
    body(2, struct.pack(">QQdQd", 1, 1, math.inf, 1, T0)),
    body(3, struct.pack(">Qd", 1, math.nan)),
])
def test_reason_field(crafted: bytes) -> None:
    assert reason_of(hbm.sign(crafted, KEY)) == "field"


@pytest.mark.parametrize(("msg", "reason"), [
    (Heartbeat("bad name", 1, 1, T0), "name"),
    (Heartbeat("", 1, 1, T0), "name"),
    (Heartbeat("n" * 65, 1, 1, T0), "name"),
    (Probe("nœud", 1, T0), "name"),
    (Heartbeat("n", -1, 1, T0), "field"),
    (Heartbeat("n", 1, 1 << 64, T0), "field"),
    (Heartbeat("n", 1, 1, math.nan), "field"),
    (Ack("n", 1, 1, T0, 1, math.inf), "field"),
    (Ack("n", 1, 1, T0, -1, T0), "field"),
    (Probe("n", 1 << 64, T0), "field"),
])
def test_encode_refuses_what_decode_would_drop(msg: Heartbeat | Ack | Probe, reason: str) -> None:
    with pytest.raises(BadDatagram) as info:
        encode(msg, KEY)
    assert info.value.reason == reason


def test_bad_datagram_is_a_raps_error() -> None:
    assert issubclass(BadDatagram, RapsError)


# --- fuzz -------------------------------------------------------------------------------------

@given(data=st.binary(max_size=MAX_DATAGRAM + 64))
def test_arbitrary_bytes_only_ever_raise_bad_datagram(data: bytes) -> None:
    assert reason_of(data) in hbm.REASONS


@given(tail=st.binary(max_size=MAX_DATAGRAM))
def test_arbitrary_bytes_behind_a_valid_prefix_fail_the_signature(tail: bytes) -> None:
    data = b"RPS\x01" + tail
    assert reason_of(data) in ("size", "signature")


@given(kind=st.one_of(st.sampled_from([1, 2, 3]), st.integers(0, 255)),
       rest=st.binary(max_size=MAX_DATAGRAM - 37))
def test_signed_garbage_parses_or_drops_cleanly(kind: int, rest: bytes) -> None:
    # Authenticated but malformed: the parser behind the signature must still be total.
    data = hbm.sign(b"RPS\x01" + bytes((kind,)) + rest, KEY)
    try:
        msg = decode(data, KEY)
    except BadDatagram as exc:
        assert exc.reason in ("size", "kind", "length", "name", "field")
    else:
        assert encode(msg, KEY) == data  # only the canonical encoding is accepted


@given(msg=messages, where=st.integers(min_value=0), bit=st.integers(0, 7))
def test_bit_flip_of_a_valid_datagram_is_dropped(msg: Heartbeat | Ack | Probe, where: int,
                                                 bit: int) -> None:
    data = bytearray(encode(msg, KEY))
    where %= len(data)
    data[where] ^= 1 << bit
    expected = "magic" if where < 3 else "version" if where == 3 else "signature"
    assert reason_of(bytes(data)) == expected


@given(msg=messages, cut=st.integers(min_value=1))
def test_truncated_valid_datagram_is_dropped(msg: Heartbeat | Ack | Probe, cut: int) -> None:
    data = encode(msg, KEY)
    short = data[:len(data) - 1 - cut % len(data)]
    assert reason_of(short) in ("size", "magic", "version", "signature")


@given(msg=messages, extra=st.binary(min_size=1, max_size=MAX_DATAGRAM))
def test_extended_valid_datagram_is_dropped(msg: Heartbeat | Ack | Probe, extra: bytes) -> None:
    data = encode(msg, KEY) + extra
    assert reason_of(data) == ("size" if len(data) > MAX_DATAGRAM else "signature")


@given(msg=messages, key=keys, other=keys)
def test_datagram_signed_with_another_key_is_rejected(msg: Heartbeat | Ack | Probe, key: bytes,
                                                      other: bytes) -> None:
    assume(key != other)
    assert reason_of(encode(msg, other), key) == "signature"


# --- replay guard -----------------------------------------------------------------------------

def hb(counter: int, incarnation: int = 100, sent_at: float = T0, node: str = "n1") -> Heartbeat:
    return Heartbeat(node, incarnation, counter, sent_at)


def test_replay_of_the_same_datagram_is_rejected() -> None:
    guard = ReplayGuard(5.0)
    first = decode(encode(hb(1), KEY), KEY)
    again = decode(encode(hb(1), KEY), KEY)
    assert isinstance(first, Heartbeat) and isinstance(again, Heartbeat)
    assert guard.check(first, T0) is None
    assert guard.check(again, T0 + 0.5) == "replay"


def test_counters_must_increase_within_an_incarnation() -> None:
    guard = ReplayGuard(5.0)
    assert guard.check(hb(5), T0) is None
    assert guard.check(hb(4), T0) == "replay"
    assert guard.check(hb(0), T0) == "replay"
    assert guard.check(hb(6), T0) is None
    assert guard.check(hb(9), T0) is None  # gaps are fine: datagrams get lost
    assert guard.last("n1") == (100, 9)


def test_older_incarnation_is_a_replay_newer_one_restarts_the_counter() -> None:
    guard = ReplayGuard(5.0)
    assert guard.check(hb(50, incarnation=100), T0) is None
    assert guard.check(hb(51, incarnation=99), T0) == "replay"
    assert guard.check(hb(0, incarnation=101), T0) is None  # restarted agent
    assert guard.check(hb(60, incarnation=100), T0) == "replay"  # its previous life
    assert guard.last("n1") == (101, 0)


def test_nodes_are_independent() -> None:
    guard = ReplayGuard(5.0)
    assert guard.check(hb(5, node="a"), T0) is None
    assert guard.check(hb(1, node="b"), T0) is None
    assert guard.check(hb(5, node="a"), T0) == "replay"


@pytest.mark.parametrize(("sent_at", "verdict"), [
    (T0 - 5.0, None), (T0 + 5.0, None),  # the window is inclusive
    (T0 - 5.001, "skew"), (T0 + 5.001, "skew"),  # too old, from the future
    (T0 - 3600, "skew"), (T0 + 3600, "skew"),
])
def test_skew_both_ways(sent_at: float, verdict: str | None) -> None:
    assert ReplayGuard(5.0).check(hb(1, sent_at=sent_at), T0) == verdict


def test_nan_clock_counts_as_skew() -> None:
    assert ReplayGuard(5.0).check(hb(1), math.nan) == "skew"


def test_a_rejected_heartbeat_changes_nothing() -> None:
    guard = ReplayGuard(5.0)
    assert guard.check(hb(10), T0) is None
    # A skewed heartbeat with a higher counter must not advance the state either, or a
    # forger could burn the counter space and lock out the real agent.
    assert guard.check(hb(11, sent_at=T0 + 60), T0) == "skew"
    assert guard.check(hb(11, incarnation=200, sent_at=T0 - 60), T0) == "skew"
    assert guard.check(hb(3), T0) == "replay"
    assert guard.last("n1") == (100, 10)
    assert guard.check(hb(11), T0) is None  # the next real heartbeat still goes through
    assert guard.check(hb(1, sent_at=T0 + 60, node="new"), T0) == "skew"
    assert guard.last("new") is None


def test_forget_accepts_a_node_afresh() -> None:
    guard = ReplayGuard(5.0)
    assert guard.check(hb(10), T0) is None
    guard.forget("n1")
    guard.forget("never-seen")
    assert guard.last("n1") is None
    assert guard.check(hb(1), T0) is None


@given(steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.floats(-10, 10)),
                      max_size=40))
def test_guard_accepts_exactly_the_strictly_increasing_fresh_ones(
        steps: list[tuple[int, int, float]]) -> None:
    guard = ReplayGuard(5.0)
    best: tuple[int, int] | None = None
    for incarnation, counter, offset in steps:
        sent_at = T0 + offset
        verdict = guard.check(hb(counter, incarnation, sent_at), T0)
        if abs(T0 - sent_at) > 5.0:
            assert verdict == "skew"
        elif best is not None and (incarnation, counter) <= best:
            assert verdict == "replay"
        else:
            assert verdict is None
            best = (incarnation, counter)
        assert guard.last("n1") == best


@pytest.mark.parametrize("skew", [0.0, -1.0, math.nan, math.inf])
def test_guard_refuses_a_meaningless_skew(skew: float) -> None:
    with pytest.raises(ConfigError):
        ReplayGuard(skew)


def test_new_incarnation_strictly_increases() -> None:
    before = time.time_ns()
    values = [new_incarnation() for _ in range(1000)]
    assert values[0] >= before
    assert all(a < b for a, b in itertools.pairwise(values))
    assert values[-1] <= U64


# --- key file ---------------------------------------------------------------------------------

def write_key(path: Path, data: bytes, mode: int) -> str:
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def key_error(path: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_key(path)
    assert len(info.value.errors) == 1
    line = info.value.errors[0]
    assert path in line and "\n" not in line
    return line


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_load_key_accepts_a_private_key(tmp_path: Path, mode: int) -> None:
    path = write_key(tmp_path / "raps.key", KEY, mode)
    assert load_key(path) == KEY


def test_load_key_missing(tmp_path: Path) -> None:
    assert "missing" in key_error(str(tmp_path / "nope.key"))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606, 0o700])
def test_load_key_refuses_loose_modes(tmp_path: Path, mode: int) -> None:
    line = key_error(write_key(tmp_path / "raps.key", KEY, mode))
    assert f"{mode:04o}" in line and "0600 or 0400" in line


def test_load_key_refuses_a_symlink(tmp_path: Path) -> None:
    target = write_key(tmp_path / "real.key", KEY, 0o600)
    link = tmp_path / "raps.key"
    link.symlink_to(target)
    assert "symlink" in key_error(str(link))


def test_load_key_refuses_a_dangling_symlink(tmp_path: Path) -> None:
    link = tmp_path / "raps.key"
    link.symlink_to(tmp_path / "nowhere")
    assert "symlink" in key_error(str(link))


def test_load_key_refuses_a_short_key(tmp_path: Path) -> None:
    line = key_error(write_key(tmp_path / "raps.key", b"k" * (KEY_BYTES - 1), 0o600))
    assert f"{KEY_BYTES - 1} bytes" in line and str(KEY_BYTES) in line
    assert "0 bytes" in key_error(write_key(tmp_path / "empty.key", b"", 0o600))


def test_load_key_refuses_a_huge_file(tmp_path: Path) -> None:
    assert "not a cluster key file" in key_error(write_key(tmp_path / "raps.key", b"k" * 5000, 0o600))


def test_load_key_refuses_a_directory_and_a_fifo(tmp_path: Path) -> None:
    directory = tmp_path / "dir.key"
    directory.mkdir(mode=0o700)
    assert "regular file" in key_error(str(directory))
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo, 0o600)
    assert "regular file" in key_error(str(fifo))  # and does not hang


def test_load_key_unreadable(tmp_path: Path) -> None:
    path = write_key(tmp_path / "raps.key", KEY, 0o600)
    os.chmod(path, 0o000)
    if os.geteuid() != 0:
        assert "unreadable" in key_error(path)
        return
    # Root reads any file: read it as an ordinary user would (the real uid stays root,
    # so the effective uid can be restored).
    os.seteuid(65534)
    try:
        message = key_error(path)
    finally:
        os.seteuid(0)
    assert "unreadable" in message


def test_create_key_writes_a_private_random_key(tmp_path: Path) -> None:
    path = str(tmp_path / "raps.key")
    create_key(path)
    st_ = os.lstat(path)
    assert stat.S_ISREG(st_.st_mode) and stat.S_IMODE(st_.st_mode) == 0o600
    key = load_key(path)
    assert len(key) == 64
    assert sorted(os.listdir(tmp_path)) == ["raps.key"]  # no temp file left behind
    other = str(tmp_path / "other.key")
    create_key(other)
    assert load_key(other) != key


def test_create_key_ignores_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        create_key(str(tmp_path / "raps.key"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(tmp_path / "raps.key").st_mode) == 0o600


def test_create_key_refuses_to_overwrite(tmp_path: Path) -> None:
    path = write_key(tmp_path / "raps.key", KEY, 0o600)
    with pytest.raises(ConfigError) as info:
        create_key(path)
    assert "already exists" in str(info.value) and path in str(info.value)
    assert load_key(path) == KEY
    link = tmp_path / "link.key"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError):
        create_key(str(link))
    assert not (tmp_path / "nowhere").exists()
    assert sorted(os.listdir(tmp_path)) == ["link.key", "raps.key"]


def test_create_key_in_a_missing_directory(tmp_path: Path) -> None:
    path = str(tmp_path / "no" / "raps.key")
    with pytest.raises(ConfigError) as info:
        create_key(path)
    assert path in str(info.value)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=20)
@given(data=st.binary(max_size=100), mode=st.integers(0o400, 0o777))
def test_load_key_fuzz_only_config_errors(tmp_path: Path, data: bytes, mode: int) -> None:
    path = write_key(tmp_path / "fuzz.key", data, mode | 0o400)
    try:
        assert len(load_key(path)) >= KEY_BYTES
    except ConfigError as exc:
        assert len(exc.errors) == 1
    finally:
        os.unlink(path)


# --- app reports (variable length) ------------------------------------------------------------


def test_app_report_round_trip_and_limits() -> None:
    from raps_slurm.wire.heartbeat import MAX_APP_ENTRIES, MAX_DATAGRAM, AppReport, RankProgress
    ranks = tuple(RankProgress(12, i, 1000 + i, None if i % 2 else i + 1)
                  for i in range(MAX_APP_ENTRIES))
    msg = AppReport("n" * 64, 7, 9, 123.5, ranks)
    data = encode(msg, KEY)
    assert len(data) <= MAX_DATAGRAM
    assert decode(data, KEY) == msg
    assert decode(encode(AppReport("n1", 1, 1, 1.0), KEY), KEY) == AppReport("n1", 1, 1, 1.0)
    with pytest.raises(BadDatagram) as info:
        encode(AppReport("n1", 1, 1, 1.0, ranks + ranks[:1]), KEY)
    assert info.value.reason == "field"
    with pytest.raises(BadDatagram):
        encode(AppReport("n1", 1, 1, 1.0, (RankProgress(1, 0, 0, -5),)), KEY)


def test_app_report_with_run_delays_is_kind_5_and_round_trips() -> None:
    from raps_slurm.wire.heartbeat import (
        KIND_APP,
        KIND_APP_WAITED,
        MAX_APP_ENTRIES,
        MAX_DATAGRAM,
        WAITED_MODULUS,
        AppReport,
        RankProgress,
    )
    ranks = tuple(RankProgress(12, i, 1000 + i, None if i % 2 else i + 1,
                               None if i == 3 else (WAITED_MODULUS - 1 if i == 4 else i * 7))
                  for i in range(MAX_APP_ENTRIES))
    msg = AppReport("n" * 64, 7, 9, 123.5, ranks)
    data = encode(msg, KEY)
    assert data[4] == KIND_APP_WAITED and len(data) <= MAX_DATAGRAM
    assert decode(data, KEY) == msg
    # no run delay known: the old kind, readable by a coordinator that predates kind 5
    plain = AppReport("n1", 1, 1, 1.0, (RankProgress(1, 0, 5, None),))
    assert encode(plain, KEY)[4] == KIND_APP and decode(encode(plain, KEY), KEY) == plain
    for bad in (-2, WAITED_MODULUS):
        with pytest.raises(BadDatagram) as info:
            encode(AppReport("n1", 1, 1, 1.0, (RankProgress(1, 0, 0, None, bad),)), KEY)
        assert info.value.reason == "field"
    # a kind-5 datagram whose entries are kind 4's size is refused, not misread
    short = bytearray(encode(plain, KEY)[:-32])
    short[4] = KIND_APP_WAITED
    assert reason_of(hbm.sign(bytes(short), KEY)) == "length"


def test_app_report_count_must_match_the_entries() -> None:
    from raps_slurm.wire.heartbeat import AppReport, RankProgress
    data = bytearray(encode(AppReport("n1", 1, 1, 1.0, (RankProgress(1, 0, 5, None),)), KEY))
    count_at = 5 + 24  # header, then incarnation, counter, sent_at: the count byte
    for count in (0, 2, 200):
        data[count_at] = count
        assert reason_of(hbm.sign(bytes(data[:-32]), KEY)) == "length"


def test_key_rollover_accepts_a_second_key_and_signs_with_the_first() -> None:
    from raps_slurm.coordinator.heartbeats import HeartbeatServer

    old, new, other = b"o" * 32, b"n" * 32, b"x" * 32
    hb = Heartbeat("n1", 1, 1, time.time())
    assert decode(encode(hb, old), new, also=old) == hb
    assert decode(encode(hb, new), new, also=old) == hb
    with pytest.raises(BadDatagram, match="signature"):
        decode(encode(hb, other), new, also=old)
    with pytest.raises(BadDatagram, match="signature"):
        decode(encode(hb, old), new)  # no rollover configured: the old key is refused
    server = HeartbeatServer(("127.0.0.1", 0), new, max_skew=5.0, leader_revision=lambda: 3,
                             accepted_key=old)
    server.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(2.0)
    try:
        # node keys from either cluster key are accepted; acks use the signing one's
        sock.sendto(encode(Heartbeat("n1", 1, 2, time.time()), node_key(old, "n1")),
                    server.address)
        ack = sock.recvfrom(512)[0]
        assert isinstance(decode(ack, node_key(new, "n1")), Ack)
        with pytest.raises(BadDatagram, match="signature"):
            decode(ack, node_key(old, "n1"))
    finally:
        sock.close()
        server.stop()


# --- the receiver's fast path (heartbeat.parse_heartbeat, ack_body) ----------------------------

def _reference(data: bytes) -> Heartbeat | str:
    try:
        msg = decode(data, KEY)
    except BadDatagram as exc:
        return exc.reason
    return msg if isinstance(msg, Heartbeat) else type(msg).__name__


@given(hb=heartbeats)
def test_a_valid_heartbeat_takes_the_fast_path_with_the_same_fields(hb: Heartbeat) -> None:
    data = encode(hb, KEY)
    fields = parse_heartbeat(data)
    assert fields == (hb.node.encode(), hb.incarnation, hb.counter, hb.sent_at, hb.probe_reply)
    assert decode_checked(data, 0) == hb


@given(data=st.one_of(signed_bodies, st.binary(max_size=MAX_DATAGRAM + 8)))
def test_the_fast_path_takes_exactly_the_heartbeats_decode_accepts(data: bytes) -> None:
    fields = parse_heartbeat(data)
    expected = _reference(data)
    if isinstance(expected, Heartbeat):
        assert fields == (expected.node.encode(), expected.incarnation, expected.counter,
                          expected.sent_at, expected.probe_reply)
    elif expected in ("signature", "size", "magic", "version"):
        pass  # the fast path only ever sees datagrams whose frame and tag were checked
    else:
        assert fields is None, (expected, data)


@given(hb=heartbeats, revision=st.integers(0, U64),
       acked_at=st.floats(allow_nan=False, allow_infinity=False))
def test_ack_body_is_the_codecs(hb: Heartbeat, revision: int, acked_at: float) -> None:
    fast = ack_body(hb.node.encode(), hb.incarnation, hb.counter, hb.sent_at, revision, acked_at)
    assert fast == message_body(Ack(hb.node, hb.incarnation, hb.counter, hb.sent_at, revision, acked_at))
