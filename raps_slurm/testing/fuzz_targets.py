"""Fuzz targets: every parser of untrusted bytes, with the errors it documents.

A target takes any bytes and returns; the parser may raise only its own error (which the
target swallows), never IndexError, struct.error, UnicodeDecodeError or a hang. The same
targets serve the hypothesis tests (``tests/unit/test_fuzz_parsers.py``) and atheris
(``python -m raps_slurm.testing.fuzz``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from raps_slurm.agent.api_schema import SCHEMAS, Refused, decode_request, parse_request
from raps_slurm.checkpoint.manifest import Manifest
from raps_slurm.checkpoint.pack import MAGIC as PACK_MAGIC
from raps_slurm.checkpoint.pack import PackError, iter_records, sealed_bytes
from raps_slurm.checkpoint.transfer_wire import (
    Channel,
    TransferError,
    decode_records,
    encode_records,
    split_payload,
)
from raps_slurm.config import load_file
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.health import HealthPolicy, HealthSettings, door_rejections
from raps_slurm.core.jobs import JobRecord, JobSpec, RankEntry, RankMap
from raps_slurm.core.planner import Plan, PlanEvent
from raps_slurm.errors import BadDatagram, ConfigError, RecordError, ScenarioError
from raps_slurm.runtime.frames import DATA, FrameError
from raps_slurm.runtime.frames import decode as decode_frame
from raps_slurm.runtime.frames import encode as encode_frame
from raps_slurm.runtime.msglog import Entry, MessagingError, parse_records
from raps_slurm.sim.scenario import load_scenario
from raps_slurm.wire.heartbeat import (
    Heartbeat,
    NodeKeys,
    claimed_node,
    decode,
    decode_from_node,
    encode,
    node_key,
    parse_heartbeat,
    sign,
)

KEY = bytes(range(32))  # a fixed cluster key: seeds signed with it reach past the MAC
_NODE_KEYS = NodeKeys(KEY)  # the coordinator's view: the key of the node a datagram names


@dataclass(frozen=True)
class Target:
    """One parser: ``run(data)`` returns or raises what the parser must never raise."""

    run: Callable[[bytes], None]
    seed: bytes  # a valid input: mutations of it get furthest


@contextlib.contextmanager
def fed(raw: bytes) -> Iterator[socket.socket]:
    """A connected socket that reads ``raw`` and then the end of the stream."""
    a, b = socket.socketpair()
    try:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(5)
        yield b
    finally:
        a.close()
        b.close()


def _heartbeat(data: bytes) -> None:
    with contextlib.suppress(BadDatagram):
        decode(data, KEY)
    # The same bytes signed: the parse behind the tag, and the receiver's fast path, which
    # must take exactly the heartbeats decode accepts.
    signed = sign(data, KEY)
    try:
        msg: object = decode(signed, KEY)
    except BadDatagram:
        msg = None
    fast = parse_heartbeat(signed)
    if isinstance(msg, Heartbeat) != (fast is not None) or (
            isinstance(msg, Heartbeat) and fast != (msg.node.encode(), msg.incarnation,
                                                    msg.counter, msg.sent_at, msg.probe_reply)):
        raise AssertionError(f"fast path {fast!r} but decode {msg!r}")
    # The coordinator's path: the name is read before the tag to choose the node's key;
    # signed with that key, it must read what decode reads.
    with contextlib.suppress(BadDatagram):
        decode_from_node(data, _NODE_KEYS)
    try:
        mine = sign(data, node_key(KEY, claimed_node(signed)))
    except BadDatagram:
        return
    outcomes: list[object] = []
    for with_key in (None, node_key(KEY, claimed_node(mine))):
        try:
            outcomes.append(decode_from_node(mine, _NODE_KEYS) if with_key is None
                            else decode(mine, with_key))
        except BadDatagram as exc:
            outcomes.append(exc.reason)
    if outcomes[0] != outcomes[1]:
        raise AssertionError(f"coordinator read {outcomes[0]!r} but decode {outcomes[1]!r}")


def _agent_request(data: bytes) -> None:
    with contextlib.suppress(Refused):
        parse_request(decode_request(data), SCHEMAS)


def _chunk_records(data: bytes) -> None:
    with contextlib.suppress(TransferError):
        list(decode_records(memoryview(data)))


def _frame_split(data: bytes) -> None:
    with contextlib.suppress(TransferError):
        split_payload(data)


def _channel(data: bytes) -> None:
    with fed(data) as sock:
        chan = Channel(sock, secrets.token_bytes(32), client=True)
        try:
            chan.recv()
        except TransferError:
            return
        raise AssertionError("bytes without the session key passed frame authentication")


def _rank_frames(data: bytes) -> None:
    with contextlib.suppress(FrameError):  # the body of a frame whose MAC passed
        decode_frame(data)


def _log_records(data: bytes) -> None:
    with contextlib.suppress(MessagingError):
        list(parse_records(data))


def _pack_file(data: bytes) -> None:
    fd = sealed_bytes(data, "fuzz-pack")
    try:
        with contextlib.suppress(PackError):
            list(iter_records(fd))
    finally:
        os.close(fd)


def _manifest(data: bytes) -> None:
    with contextlib.suppress(RecordError):
        Manifest.from_json("fuzz", data)


VALUES: list[tuple[Callable[[str, bytes], object], bytes]] = [
    (JobRecord.from_json, JobRecord("5", 0, 1000, ("n1",), JobSpec()).to_json()),
    (RankMap.from_json, RankMap("5", 0, ("n1",), ("n2",), 1).to_json()),
    (RankEntry.from_json, RankEntry(0, "n1", 1, "running", ("n2",)).to_json()),
    (Plan.from_json, Plan("5-0-2", "5", 0, "n1", "n2", 2, "dead", 10).to_json()),
    (PlanEvent.from_json, PlanEvent("5-0-2", "running", 1.0, "n2", {"x": 1}).to_json()),
    (CkptRecord.from_json, CkptRecord(0, 1, 1, "ab" * 32, 5, 5, 1, "cd" * 32, "n1", ("n1",),
                                      1, "committed", 1.0).to_json()),
]


def _etcd_value(data: bytes) -> None:
    """The first byte picks the record type, the rest is its value."""
    if not data:
        return
    parse, _ = VALUES[data[0] % len(VALUES)]
    with contextlib.suppress(RecordError):
        parse("/raps/v1/fuzz", data[1:])


def _health_sample(data: bytes) -> None:
    """What an agent writes to nodes/<node>/health, as the leader reads it."""
    try:
        sample = json.loads(data)
    except (ValueError, RecursionError):
        return
    if not isinstance(sample, dict):
        return
    door_rejections(sample)
    HealthPolicy(HealthSettings()).observe("n1", sample, 1.0)


def _yaml_file(loader: Callable[[Path], object], error: type[BaseException]
               ) -> Callable[[bytes], None]:
    def run(data: bytes) -> None:
        with tempfile.NamedTemporaryFile(suffix=".yaml", dir=_tmp()) as f:
            f.write(data)
            f.flush()
            with contextlib.suppress(error):
                loader(Path(f.name))
    return run


def _tmp() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _seed_frame() -> bytes:
    return b"".join(bytes(p) for p in encode_frame(DATA, 1, 2, 3, 1, b"payload"))


RECORDS = encode_records([("ab" * 32, 5, b"\x00hello"), ("cd" * 32, 3, b"\x00abc")])

TARGETS: dict[str, Target] = {
    "heartbeat": Target(_heartbeat, encode(Heartbeat("n1", 7, 3, 1.0e9), KEY)),
    "agent_request": Target(_agent_request, json.dumps(
        {"op": "heartbeat", "job": "5", "rank": 0, "step": 1, "items": 1,
         "blocked_on": None}).encode()),
    "chunk_records": Target(_chunk_records, RECORDS),
    "transfer_frame": Target(_frame_split, struct.pack(">I", 12) + b'{"op":"get"}body'),
    "transfer_channel": Target(_channel, struct.pack(">I", 40) + bytes(40)),
    "rank_frames": Target(_rank_frames, _seed_frame()),
    "log_records": Target(_log_records, b"".join(
        bytes(p) for p in Entry(2, 1, 1, 5, 0x12345678, False, b"hello").record(
            with_body=True))),
    "pack_file": Target(_pack_file, PACK_MAGIC + RECORDS),
    "manifest": Target(_manifest, json.dumps(
        {"format": 1, "job": "5", "rank": 0, "generation": 1, "epoch": 1,
         "digest_algo": "blake3", "total_size": 5,
         "items": [{"name": "", "kind": "bytes", "nbytes": 5}],
         "chunks": [["ab" * 32, 5]]}).encode()),
    "etcd_value": Target(_etcd_value, b"\x00" + VALUES[0][1]),
    "health_sample": Target(_health_sample, json.dumps(
        {"at": 1.0, "interval_sec": 1.0, "nvme_temp_c": {"nvme0": 41.0},
         "rejected": {"transfer": {"io": 1}}}).encode()),
    "config": Target(_yaml_file(load_file, ConfigError),
                     yaml.safe_dump({"detection": {"miss_threshold": 3}}).encode()),
    "scenario": Target(_yaml_file(load_scenario, ScenarioError),
                       yaml.safe_dump({"nodes": 64, "years": 1}).encode()),
}
