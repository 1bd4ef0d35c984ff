"""Kernel heartbeat wire format between agents and the coordinator, signed with node keys.

Every datagram is one message, big-endian, no padding::

    offset  size  field
    0       3     magic  b"RPS"
    3       1     version (1)
    4       1     kind: 1 Heartbeat (agent -> coordinator), 2 Ack (coordinator -> agent),
                        3 Probe (coordinator -> agent, "answer me now"),
                  4 AppReport (agent -> coordinator, progress of the node's ranks),
                  5 AppReport with run delays (the same, each entry with its rank's
                        run delay: kind 4's entries + waited_ms i32)
    5       n     fixed fields of the kind (u64 = unsigned 64-bit, f64 = IEEE double, seconds):
                    Heartbeat  incarnation u64, counter u64, sent_at f64, flags u8
                               (bit 0 = probe_reply, other bits must be 0)        n = 25
                    Ack        incarnation u64, counter u64, sent_at f64,
                               leader_revision u64, acked_at f64                    n = 40
                    Probe      nonce u64, sent_at f64                               n = 16
                  AppReport  incarnation u64, counter u64, sent_at f64, count u8   n = 25
                             (kinds 4 and 5)
    5+n     1     name length L (1..64)
    6+n     L     node name, ASCII subset of UTF-8: [A-Za-z0-9][A-Za-z0-9._-]*
    6+n+L   20c   AppReport only: count entries of job u32, rank u32, step u64,
                  blocked_on i32 (-1 = not blocked); at most MAX_APP_ENTRIES
            (24c) kind 5: each entry then waited_ms i32, the milliseconds the rank's main
                  thread has waited for a CPU since it started (/proc/PID/schedstat),
                  modulo 2**31; -1 = unknown (the detector's starved-or-hung test)
    ...     32    HMAC-SHA256(key of the node named, every byte before the tag)

``decode`` drops anything bad with ``BadDatagram(reason)``, checking in this order:

    size       shorter than the smallest message or longer than MAX_DATAGRAM (read nothing)
    magic      bytes 0..2 are not b"RPS"
    version    byte 3 is not a version we speak
    signature  the tag does not match (constant-time compare)
    kind       signed, but byte 4 names no known kind
    length     signed, but the length does not match the kind and the name length
    name       name length 0 or > 64, or a character outside the node-name set
    field      a timestamp is NaN or infinite, or an unknown flag bit is set

Magic and version are read before the tag because they are fixed-offset byte compares that
tell us *which* MAC scheme and tag position apply (a future version may change them), and they
drop stray traffic on the port without spending an HMAC on it. Nothing the sender chose
beyond those four bytes is interpreted until the signature holds. NaN/inf timestamps get their
own reason ("field") rather than "length" so that metrics tell a broken sender from a
truncated datagram.

Every datagram is signed with the key of the node it names: ``node_key(cluster key, name)``
= HMAC-SHA256(cluster key, b"raps-node-key\\x00" + name). An agent holds only its own node key
(``detection.node_key_file``, made on the head node by ``rapsctl config node-key``); the
coordinator holds the cluster key and derives every node's key (``NodeKeys``). So a heartbeat
or app report verifies only with the key of the node it names, and acks and probes to a node
are signed with that node's key: root on one compute node cannot speak for another. To pick
the key, the coordinator reads the name (``claimed_node``) before the tag; anything whose name
cannot be read is dropped as "signature" (it cannot be verified). The replay guard
(:mod:`raps_slurm.wire.replay_guard`) refuses stale, replayed and impossible (incarnation in the
future, counter beyond what the incarnation's age allows) sequence numbers
(docs/architecture.md, Trust boundaries). Key files are read and written by
:mod:`raps_slurm.wire.keyfile`.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import struct
import threading
from dataclasses import dataclass

from raps_slurm.core.liveness import WAITED_MODULUS as WAITED_MODULUS
from raps_slurm.errors import BadDatagram, ConfigError
from raps_slurm.wire import _udp

# re-exported (the "as" ones): the daemons, rapsctl, scripts/install.sh and the tests take
# them from here
from raps_slurm.wire.keyfile import KEY_BYTES as KEY_BYTES
from raps_slurm.wire.keyfile import accepted_key as accepted_key
from raps_slurm.wire.keyfile import create_key as create_key
from raps_slurm.wire.keyfile import load_key as load_key
from raps_slurm.wire.keyfile import write_key
from raps_slurm.wire.replay_guard import ReplayGuard as ReplayGuard
from raps_slurm.wire.replay_guard import new_incarnation as new_incarnation

MAX_DATAGRAM = 512  # bytes; anything longer is dropped unread
MAX_NAME = 64

MAGIC = b"RPS"
VERSION = 1
KIND_HEARTBEAT = 1
KIND_ACK = 2
KIND_PROBE = 3
KIND_APP = 4
KIND_APP_WAITED = 5
MAX_APP_ENTRIES = 16  # 16 x 24 bytes + a 64-byte name still fit MAX_DATAGRAM (511 bytes)
TAG_BYTES = 32  # HMAC-SHA256 output

REASONS = ("size", "magic", "version", "signature", "kind", "length", "name", "field")

_PREFIX = MAGIC + bytes([VERSION])
_HEADER = struct.Struct(">3sBB")
_HB = struct.Struct(">QQdB")
_ACK = struct.Struct(">QQdQd")
_PROBE = struct.Struct(">Qd")
_APP = struct.Struct(">QQdB")
_ENTRY = struct.Struct(">IIQi")
_ENTRY_WAITED = struct.Struct(">IIQii")
_ENTRIES = {KIND_APP: _ENTRY, KIND_APP_WAITED: _ENTRY_WAITED}
_FIXED = {KIND_HEARTBEAT: _HB, KIND_ACK: _ACK, KIND_PROBE: _PROBE, KIND_APP: _APP,
          KIND_APP_WAITED: _APP}
_NAME_START = _HEADER.size  # offset of the fixed fields
# Smallest well-formed message: a probe with a one-byte name.
_MIN_DATAGRAM = _HEADER.size + _PROBE.size + 1 + 1 + TAG_BYTES
_U64_LIMIT = 1 << 64
_FLAG_PROBE_REPLY = 0x01

# First character alphanumeric: a name can then never be read as a command-line option
# (scontrol, srun -w) nor as "." / ".." when it becomes a path or key component.
_NAME_RE = re.compile(rb"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Agent -> coordinator: "node is alive", once per interval or in reply to a Probe."""

    node: str
    incarnation: int
    counter: int
    sent_at: float
    probe_reply: bool = False


@dataclass(frozen=True, slots=True)
class Ack:
    """Coordinator -> agent: the heartbeat (incarnation, counter) was accepted."""

    node: str
    incarnation: int
    counter: int
    sent_at: float
    leader_revision: int
    acked_at: float


@dataclass(frozen=True, slots=True)
class Probe:
    """Coordinator -> agent: "answer me now" (the second channel before a DEAD verdict)."""

    node: str
    nonce: int
    sent_at: float


@dataclass(frozen=True, slots=True)
class RankProgress:
    """One rank's last app heartbeat, as the agent forwards it, with the time its main
    thread has waited for a CPU (``waited_ms``, cumulative modulo ``WAITED_MODULUS``;
    None = not known)."""

    job: int
    rank: int
    step: int
    blocked_on: int | None
    waited_ms: int | None = None


@dataclass(frozen=True, slots=True)
class AppReport:
    """Agent -> coordinator: the ranks that sent an app heartbeat since the last report.

    Its own (incarnation, counter) sequence, checked by its own ReplayGuard: a replayed
    report would make a hung rank look alive.
    """

    node: str
    incarnation: int
    counter: int
    sent_at: float
    ranks: tuple[RankProgress, ...] = ()


Message = Heartbeat | Ack | Probe | AppReport


# One precomputed HMAC object per key: copying it skips the key schedule (two SHA-256 blocks)
# on every datagram, about 30% of the verify cost. A handful of keys covers key rotation.
_mac_lock = threading.Lock()
_mac_cache: dict[bytes, hmac.HMAC] = {}
_MAC_CACHE_MAX = 4


def _mac_base(key: bytes) -> hmac.HMAC:
    """The cached, never-updated HMAC object for ``key``; callers ``copy()`` it."""
    base = _mac_cache.get(key)
    if base is None:
        base = hmac.new(key, digestmod=hashlib.sha256)
        with _mac_lock:
            if len(_mac_cache) >= _MAC_CACHE_MAX:
                _mac_cache.clear()
            _mac_cache[key] = base
    return base


def _tag(key: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 of ``body`` under ``key``."""
    mac = _mac_base(key).copy()
    mac.update(body)
    return mac.digest()


def sign(body: bytes, key: bytes) -> bytes:
    """``body`` followed by its tag; exposed so tests can craft signed-but-malformed datagrams."""
    return body + _tag(key, body)


def _check_name(node: str) -> bytes:
    """The encoded node name, or BadDatagram("name") if it is not a node name."""
    raw = node.encode("utf-8", "replace")
    if _NAME_RE.fullmatch(raw) is None:
        raise BadDatagram("name", f"{node!r} is not 1..{MAX_NAME} of [A-Za-z0-9._-] "
                                  "starting with a letter or digit")
    return raw


def is_node_name(node: str) -> bool:
    """Whether ``node`` is a node name (one a node key can be made for)."""
    return _NAME_RE.fullmatch(node.encode("utf-8", "replace")) is not None


def _check_u64(what: str, value: int) -> None:
    """BadDatagram("field") unless ``value`` fits an unsigned 64-bit field."""
    if isinstance(value, bool) or not 0 <= value < _U64_LIMIT:
        raise BadDatagram("field", f"{what} {value!r} outside 0..2**64-1")


def _check_time(what: str, value: float) -> None:
    """BadDatagram("field") unless ``value`` is a finite number."""
    if not math.isfinite(value):
        raise BadDatagram("field", f"{what} {value!r} is not finite")


def encode(msg: Message, key: bytes) -> bytes:
    """Serialize and sign ``msg``; BadDatagram ("name"/"field") if it cannot be sent as is."""
    return sign(body(msg), key)


def body(msg: Message) -> bytes:
    """``msg`` serialized without its tag (``_udp.sign_send`` signs batches of them)."""
    raw = _check_name(msg.node)
    if isinstance(msg, Heartbeat):
        _check_u64("incarnation", msg.incarnation)
        _check_u64("counter", msg.counter)
        _check_time("sent_at", msg.sent_at)
        kind = KIND_HEARTBEAT
        fixed = _HB.pack(msg.incarnation, msg.counter, msg.sent_at,
                         _FLAG_PROBE_REPLY if msg.probe_reply else 0)
    elif isinstance(msg, Ack):
        _check_u64("incarnation", msg.incarnation)
        _check_u64("counter", msg.counter)
        _check_u64("leader_revision", msg.leader_revision)
        _check_time("sent_at", msg.sent_at)
        _check_time("acked_at", msg.acked_at)
        kind = KIND_ACK
        fixed = _ACK.pack(msg.incarnation, msg.counter, msg.sent_at, msg.leader_revision,
                          msg.acked_at)
    elif isinstance(msg, AppReport):
        _check_u64("incarnation", msg.incarnation)
        _check_u64("counter", msg.counter)
        _check_time("sent_at", msg.sent_at)
        if len(msg.ranks) > MAX_APP_ENTRIES:
            raise BadDatagram("field", f"{len(msg.ranks)} ranks > {MAX_APP_ENTRIES} per report")
        # kind 4 while no entry knows its run delay: what a coordinator before kind 5 reads
        kind = KIND_APP if all(r.waited_ms is None for r in msg.ranks) else KIND_APP_WAITED
        fixed = _APP.pack(msg.incarnation, msg.counter, msg.sent_at, len(msg.ranks))
        entries = []
        for r in msg.ranks:
            blocked = -1 if r.blocked_on is None else r.blocked_on
            waited = -1 if r.waited_ms is None else r.waited_ms
            if not (0 <= r.job < 1 << 32 and 0 <= r.rank < 1 << 31 and 0 <= r.step < 1 << 64
                    and -1 <= blocked < 1 << 31 and -1 <= waited < WAITED_MODULUS):
                raise BadDatagram("field", f"rank entry out of range: {r}")
            entries.append(_ENTRY.pack(r.job, r.rank, r.step, blocked) if kind == KIND_APP
                           else _ENTRY_WAITED.pack(r.job, r.rank, r.step, blocked, waited))
        return b"".join((_HEADER.pack(MAGIC, VERSION, kind), fixed, bytes((len(raw),)), raw,
                         *entries))
    else:
        _check_u64("nonce", msg.nonce)
        _check_time("sent_at", msg.sent_at)
        kind = KIND_PROBE
        fixed = _PROBE.pack(msg.nonce, msg.sent_at)
    return b"".join((_HEADER.pack(MAGIC, VERSION, kind), fixed, bytes((len(raw),)), raw))


def _signed(key: bytes, data: bytes, body_end: int) -> bool:
    mac = _mac_base(key).copy()
    mac.update(data[:body_end])
    return hmac.compare_digest(mac.digest(), data[body_end:])


def decode(data: bytes, key: bytes, also: bytes | None = None) -> Message:
    """Verify and parse one datagram; BadDatagram(reason) for anything that must be dropped.

    ``also``: a second key whose signatures are accepted too (a key rollover,
    ``detection.accepted_key_file``)."""
    _check_frame(data)
    body_end = len(data) - TAG_BYTES
    if not any(_signed(k, data, body_end) for k in (key, also) if k is not None):
        raise BadDatagram("signature")
    return _parse(data)


def claimed_node(data: bytes) -> str:
    """The node name a datagram claims, read before its tag to choose the key that must have
    signed it. Frame errors as ``decode``; a datagram where no well-formed name can be found
    cannot be verified: BadDatagram("signature")."""
    _check_frame(data)
    body_end = len(data) - TAG_BYTES
    fixed = _FIXED.get(data[4])
    len_at = _NAME_START + fixed.size if fixed is not None else body_end
    if len_at >= body_end:
        raise BadDatagram("signature", "no node name to choose a key by")
    name_end = len_at + 1 + data[len_at]
    raw = data[len_at + 1:name_end]
    if name_end > body_end or _NAME_RE.fullmatch(raw) is None:
        raise BadDatagram("signature", "no node name to choose a key by")
    return raw.decode("ascii")


def decode_from_node(data: bytes, keys: NodeKeys) -> Message:
    """``decode`` on the coordinator: the datagram must be signed with the key of the node it
    names (or that node's key under the rollover's accepted key)."""
    if keys.verified(claimed_node(data), data) is None:
        raise BadDatagram("signature")
    return _parse(data)


# What _udp.recv_batch needs to check the tag exactly where decode would.
FRAME = (_PREFIX, _MIN_DATAGRAM, MAX_DATAGRAM)


def decode_checked(data: bytes, signed: int) -> Message:
    """decode() of a datagram whose tag ``_udp.recv_batch`` checked (given FRAME):
    ``signed`` is the index of the matching key, -1 for none, -2 if not checked."""
    _check_frame(data)
    if signed < 0:
        raise BadDatagram("signature")
    return _parse(data)


def _check_frame(data: bytes) -> None:
    size = len(data)
    if size > MAX_DATAGRAM or size < _MIN_DATAGRAM:
        raise BadDatagram("size", f"{size} bytes outside {_MIN_DATAGRAM}..{MAX_DATAGRAM}")
    if not data.startswith(_PREFIX):
        if not data.startswith(MAGIC):
            raise BadDatagram("magic")
        raise BadDatagram("version", f"version {data[3]}, we speak {VERSION}")


def _parse(data: bytes) -> Message:
    """The message in a datagram whose frame and tag were checked."""
    size = len(data)
    body_end = size - TAG_BYTES

    # Authenticated from here on; still parsed strictly, since a bug or a version skew in a
    # sender holding the key must not crash the coordinator.
    kind = data[4]
    fixed = _FIXED.get(kind)
    if fixed is None:
        raise BadDatagram("kind", f"kind {kind}")
    len_at = _NAME_START + fixed.size
    if body_end <= len_at:
        raise BadDatagram("length", f"{size} bytes too short for kind {kind}")
    name_len = data[len_at]
    name_end = len_at + 1 + name_len
    entry = _ENTRIES.get(kind, _ENTRY)
    entries = data[len_at - 1] if kind in _ENTRIES else 0  # the count is the last fixed byte
    if body_end != name_end + entries * entry.size or entries > MAX_APP_ENTRIES:
        raise BadDatagram("length", f"{size} bytes, name length {name_len}, kind {kind}")
    raw = data[len_at + 1:name_end]
    if _NAME_RE.fullmatch(raw) is None:
        raise BadDatagram("name", f"bad node name {raw[:MAX_NAME]!r}")
    node = raw.decode("ascii")

    if kind == KIND_HEARTBEAT:
        incarnation, counter, sent_at, flags = _HB.unpack_from(data, _NAME_START)
        if flags & ~_FLAG_PROBE_REPLY:
            raise BadDatagram("field", f"unknown flags {flags:#04x}")
        if not math.isfinite(sent_at):
            raise BadDatagram("field", "sent_at not finite")
        return Heartbeat(node, incarnation, counter, sent_at, bool(flags))
    if kind in _ENTRIES:
        incarnation, counter, sent_at, _count = _APP.unpack_from(data, _NAME_START)
        if not math.isfinite(sent_at):
            raise BadDatagram("field", "sent_at not finite")
        ranks = []
        for i in range(entries):
            job, rank, step, blocked, *more = entry.unpack_from(data, name_end + i * entry.size)
            waited = more[0] if more else -1
            if blocked < -1 or rank >= 1 << 31 or waited < -1:
                raise BadDatagram("field", f"rank entry {i} out of range")
            ranks.append(RankProgress(job, rank, step, None if blocked == -1 else blocked,
                                      None if waited == -1 else waited))
        return AppReport(node, incarnation, counter, sent_at, tuple(ranks))
    if kind == KIND_ACK:
        incarnation, counter, sent_at, revision, acked_at = _ACK.unpack_from(data, _NAME_START)
        if not (math.isfinite(sent_at) and math.isfinite(acked_at)):
            raise BadDatagram("field", "timestamp not finite")
        return Ack(node, incarnation, counter, sent_at, revision, acked_at)
    nonce, sent_at = _PROBE.unpack_from(data, _NAME_START)
    if not math.isfinite(sent_at):
        raise BadDatagram("field", "sent_at not finite")
    return Probe(node, nonce, sent_at)


# The hot path of a coordinator (one heartbeat per node per second): the fields of a plain
# heartbeat in one unpack, and its ack's body without building message objects.
_HB_FRAME = struct.Struct(">5sQQdBB")  # prefix and kind, the fixed fields, the name length
_HB_START = _PREFIX + bytes((KIND_HEARTBEAT,))
_ACK_START = _HEADER.pack(MAGIC, VERSION, KIND_ACK)


def parse_heartbeat(data: bytes) -> tuple[bytes, int, int, float, bool] | None:
    """(raw name, incarnation, counter, sent_at, probe_reply) of an authenticated datagram
    that is a well-formed heartbeat, else None (``decode_checked`` then says why)."""
    size = len(data)
    if size > MAX_DATAGRAM or size < _HB_FRAME.size + 1 + TAG_BYTES:
        return None
    start, incarnation, counter, sent_at, flags, name_len = _HB_FRAME.unpack_from(data)
    if (start != _HB_START or flags & ~_FLAG_PROBE_REPLY
            or size != _HB_FRAME.size + name_len + TAG_BYTES or not math.isfinite(sent_at)):
        return None
    raw = data[_HB_FRAME.size:size - TAG_BYTES]
    if _NAME_RE.fullmatch(raw) is None:
        return None
    return raw, incarnation, counter, sent_at, bool(flags)


def ack_body(raw_name: bytes, incarnation: int, counter: int, sent_at: float,
             leader_revision: int, acked_at: float) -> bytes:
    """``body(Ack(...))`` for fields taken from a parsed heartbeat (so known to be valid)."""
    return b"".join((_ACK_START, _ACK.pack(incarnation, counter, sent_at, leader_revision,
                                           acked_at), bytes((len(raw_name),)), raw_name))


NODE_KEY_CONTEXT = b"raps-node-key\x00"  # domain separation: no other use of the key collides
NODE_KEY_CACHE = 1 << 16  # node keys a coordinator keeps derived (a larger cluster re-derives)


def node_key(cluster_key: bytes, node: str) -> bytes:
    """Node ``node``'s key: HMAC-SHA256(cluster key, b"raps-node-key\\x00" + name), 32 bytes.

    The only key a compute node needs for heartbeats: it proves which node signed, and it
    gives nothing about the cluster key or another node's key. BadDatagram("name") if
    ``node`` is not a node name."""
    return hmac.digest(cluster_key, NODE_KEY_CONTEXT + _check_name(node), "sha256")


class NodeKeys:
    """The coordinator's node keys: derived from the cluster key (and from the rollover's
    accepted key, ``detection.accepted_key_file``), for verifying and signing.

    Each node's keys are kept as precomputed HMAC states (``_udp.hmac_state``): verifying
    a datagram or signing an ack then costs two SHA-256 blocks of the message, no key
    schedule. A node's keys are kept only once a datagram verified with them (or to sign
    for the node), so a flood of made-up names costs a derivation each but evicts nobody;
    at most ``max_nodes`` names are kept, the oldest dropped first. Thread-safe.
    """

    def __init__(self, key: bytes, also: bytes | None = None,
                 max_nodes: int = NODE_KEY_CACHE) -> None:
        self._roots = (key,) if also is None else (key, also)
        self._max = max_nodes
        # node -> (signing key, its HMAC state, the HMAC states of every accepted key)
        self._cache: dict[str, tuple[bytes, bytes, tuple[bytes, ...]]] = {}
        self._lock = threading.Lock()

    def _derive(self, node: str) -> tuple[bytes, bytes, tuple[bytes, ...]]:
        keys = [node_key(root, node) for root in self._roots]
        states = tuple(_udp.hmac_state(k) for k in keys)
        return keys[0], states[0], states

    def _keep(self, node: str, entry: tuple[bytes, bytes, tuple[bytes, ...]]) -> None:
        with self._lock:
            while len(self._cache) >= self._max:
                self._cache.pop(next(iter(self._cache)))
            self._cache[node] = entry

    def _entry(self, node: str) -> tuple[bytes, bytes, tuple[bytes, ...]]:
        entry = self._cache.get(node)
        if entry is None:
            entry = self._derive(node)
            self._keep(node, entry)
        return entry

    def key(self, node: str) -> bytes:
        """The key acks and probes to ``node`` are signed with."""
        return self._entry(node)[0]

    def verified(self, node: str, data: bytes, member: bool = False) -> bytes | None:
        """The HMAC state that signs for ``node`` (an ``_udp.sign_send`` item's signer) if
        the last 32 bytes of ``data`` are the HMAC of the rest under one of ``node``'s
        keys, else None. ``member``: ``node`` is known to be in the cluster, so its keys
        are kept even when this datagram fails (the names kept are bounded by the
        cluster's, and a wrongly signed flood naming a node costs no derivation each)."""
        entry = self._cache.get(node)
        known = entry is not None
        if entry is None:
            entry = self._derive(node)
            if member:
                self._keep(node, entry)
                known = True
        for state in entry[2]:
            if _udp.verify(state, data):
                if not known:
                    self._keep(node, entry)
                return entry[1]
        return None


def agent_keys(node: str, node_key_file: str, cluster_key: bytes,
               accepted: bytes | None) -> tuple[bytes, bytes | None]:
    """An agent's (node key, rollover's node key or None): its ``detection.node_key_file``
    (``%n`` already replaced), or derived from the cluster key when that is ''. A node key
    file that is not this node's under either cluster key is refused (a key installed on the
    wrong node would only make every heartbeat fail)."""
    try:
        derived = node_key(cluster_key, node)
        other = node_key(accepted, node) if accepted is not None else None
    except BadDatagram as exc:
        raise ConfigError([f"node {node!r}: {exc}"]) from None
    if not node_key_file:
        return derived, other
    mine = load_key(node_key_file, node=node)
    if mine == derived:
        return mine, other
    if mine == other:  # a rollover: the new node key installed first
        return mine, derived
    raise ConfigError([f"node key {node_key_file}: not the key of {node} under "
                       "detection.cluster_key_file (made for another node or another "
                       f"cluster key? rapsctl config node-key {node} --out FILE)"])


def create_node_key(path: str, cluster_key: bytes, node: str) -> None:
    """Write ``node``'s key (``node_key``) atomically with mode 0600, for its agent's
    ``detection.node_key_file``; ConfigError if ``path`` exists or ``node`` is no node name."""
    try:
        key = node_key(cluster_key, node)
    except BadDatagram as exc:
        raise ConfigError([f"node key for {node!r}: {exc}"]) from None
    write_key(path, key, "node key", "remove it first to replace it")
