"""Chunk transfer between agents: a small authenticated TCP protocol (pair keys).

Handshake: the client sends its name and a nonce; the server answers with its name, a
nonce and a proof ``HMAC(key, "s" | nc | ns | client | server)``; the client answers
with its proof (``"c"`` ...). Both sides check before anything else is read. ``key`` is
the pair's key (:mod:`raps_slurm.checkpoint.peer_keys`): the server derives it from its
node key and the client's name, the client holds it as its ticket for that server, so
neither side can pass for a third node; a client that names the node it means to reach
(``peer``) refuses a server that announces another. After
that every frame is ``u32 length | payload | HMAC-SHA256(session key, direction |
sequence | payload)`` with the session key derived from both nonces, so frames cannot
be forged, replayed, reordered or moved to another connection. A payload is ``u32 n |
n bytes of JSON header | body``; bodies carry chunk records (digest, raw size, stored
size, stored bytes), as in :mod:`raps_slurm.checkpoint.pack`.

Requests: ``has`` (which of these chunks are missing: the sender's delta offer),
``put`` (store chunks; each is decoded and checked against its name before it is
kept), ``put_manifest`` (store a manifest once all its chunks are here), ``get`` and
``get_manifest`` (restores pull from holders), ``verify`` (re-read and check a
generation here), ``log_put``/``log_have``/``log_get``/``log_trim`` (message-log segments of a rank
whose log backup this node is). Anything malformed closes the connection after one error line in the
log; the server never trusts a digest it did not compute.

Bounds: the whole handshake must arrive within ``handshake_timeout`` of the connection;
a request may wait ``idle_timeout`` for its first byte, then all of it (length, payload,
MAC) must arrive within ``request_timeout`` plus its length at ``min_rate`` bytes/s: a
deadline per request, not per ``recv``. At most ``max_connections`` are served at once,
one thread each (:mod:`raps_slurm.wire.gate`: a new connection evicts the oldest one still in
its handshake; only when every slot holds an authenticated peer is it refused).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.checkpoint.codec import Decoder
from raps_slurm.checkpoint.logstore import LogStore
from raps_slurm.checkpoint.manifest import Manifest
from raps_slurm.checkpoint.pack import MAX_CHUNK, STORED_SLACK
from raps_slurm.checkpoint.peer_keys import PeerKeys
from raps_slurm.checkpoint.reader import read_into

# re-exported (the "as" ones): restores, cold copies, the fuzz targets and the tests take
# them from here
from raps_slurm.checkpoint.transfer_wire import (
    MIN_RATE,
    REQUEST_TIMEOUT,
    TIMEOUT,
    Channel,
    cursor_field,
    digests_field,
    handshake_proof,
    hello_node,
    hello_nonce,
    int_field,
    job_field,
    part_field,
    recv_handshake,
    segs_field,
    send_handshake,
)
from raps_slurm.checkpoint.transfer_wire import TransferError as TransferError
from raps_slurm.checkpoint.transfer_wire import decode_records as decode_records
from raps_slurm.checkpoint.transfer_wire import encode_records as encode_records
from raps_slurm.checkpoint.transfer_wire import verify_chunk as verify_chunk
from raps_slurm.errors import RapsError, RecordError
from raps_slurm.logquota import LogQuota
from raps_slurm.wire.framing import FrameError
from raps_slurm.wire.gate import BoundedServer, Gate

log = logging.getLogger("raps.transfer")

BATCH_BYTES = 16 << 20  # chunk bytes per put/get frame, log bytes per log_put
HANDSHAKE_TIMEOUT = 5.0  # the whole handshake, from the connection on
MAX_CONNECTIONS = 128  # connections (and threads) served at once


class TokenBucket:
    """Caps bytes per second across every thread that sends (``replication_mbps``)."""

    def __init__(self, rate_bytes: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = float(rate_bytes)
        self._clock = clock
        self._lock = threading.Lock()
        self._next = clock()

    def take(self, n: int) -> None:
        """Wait until ``n`` more bytes may go."""
        if self.rate <= 0 or n <= 0:
            return
        with self._lock:
            now = self._clock()
            start = max(now, self._next)
            self._next = start + n / self.rate
        if start > now:
            time.sleep(start - now)


# --- server -------------------------------------------------------------------------------


class _Pins:
    """Chunks a connection announced or sent, pinned until it closes: collection must not
    remove them before their manifest arrives."""

    def __init__(self, store: ChunkStore, stack: contextlib.ExitStack) -> None:
        self._store, self._stack = store, stack
        self._sets: dict[str, set[str]] = {}

    def add(self, job: str, digest: str) -> None:
        if job not in self._sets:
            self._sets[job] = self._stack.enter_context(self._store.pinned(job))
        self._store.pin_chunk(job, self._sets[job], digest)


class TransferServer:
    """Serves this node's chunk store to other agents (and to root's ``rapsctl verify``)."""

    def __init__(self, store: ChunkStore, key: bytes | PeerKeys, node: str,
                 address: tuple[str, int],
                 *, digest_algo: str = "blake3", limiter: TokenBucket | None = None,
                 max_generations: int = 5, accepted_key: bytes | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, idle_timeout: float = TIMEOUT,
                 request_timeout: float = REQUEST_TIMEOUT, min_rate: float = MIN_RATE,
                 allowed: Callable[[str, str], bool] | None = None) -> None:
        self.store, self.node = store, node
        # (client, job) -> may it move that job's data here (None: every client may)
        self._allowed = allowed
        self.logs = LogStore(store.root, cold=True)  # backup copies: read for a restore
        self.max_generations = max_generations
        # bytes: the cluster key (and a rollover's other one, whose peers are served too)
        self._keys = key if isinstance(key, PeerKeys) else \
            PeerKeys.from_cluster(key, node, accepted_key)
        self._address = address
        self._algo = digest_algo
        self._limiter = limiter or TokenBucket(0)
        self._server: BoundedServer | None = None
        self.errors = 0
        self.rejected: Counter[str] = Counter()  # kind -> connections refused (see serve)
        self._quota = LogQuota(log)
        self._lock = threading.Lock()
        self.gate = Gate(max_connections, self._refused)
        self.handshake_timeout = handshake_timeout
        self._timeouts = {"idle_timeout": idle_timeout, "request_timeout": request_timeout,
                          "min_rate": min_rate}

    def _refused(self, kind: str) -> None:
        with self._lock:
            self.rejected[kind] += 1

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port)."""
        if self._server is None:
            return self._address
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        """Bind and serve in daemon threads; OSError if the address is taken."""
        server = BoundedServer(self._address, self.serve, self.gate)
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                         name="raps-transfer", daemon=True).start()
        log.info("chunk transfer listening on %s:%d", *self.address)

    def stop(self) -> None:
        """Stop accepting (open transfers end with their connection)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def rejections(self) -> dict[str, int]:
        """A copy of ``rejected`` (kind -> connections), safe while connections end."""
        with self._lock:
            return dict(self.rejected)

    def serve(self, sock: socket.socket) -> None:
        """Serve one connection until it closes; never raises. A connection that ends
        badly is counted in ``rejected`` by kind: ``handshake`` (malformed hello),
        ``authentication`` (wrong proof, or a frame whose MAC fails), ``frame`` (a
        malformed or refused request), ``timeout`` (a handshake or request not in by its
        deadline), ``io`` (reset); the gate counts ``busy`` and ``evicted``. A request
        about a job whose data ``allowed`` says the peer may not move is answered with
        an error and counted as ``forbidden`` (the connection stays)."""
        deadline = time.monotonic() + self.handshake_timeout
        peer = "?"
        stage = "handshake"
        try:
            hello = recv_handshake(sock, deadline)
            peer, nc = hello_node(hello), hello_nonce(hello)
            ns = os.urandom(16)
            keys = self._keys.accepting(peer)
            # one proof per key this server holds: a peer holding either can check one
            send_handshake(sock, {"node": self.node, "nonce": ns.hex(),
                                  "proof": handshake_proof(keys[0], b"s", nc, ns, peer,
                                                           self.node),
                                  "proofs": [handshake_proof(k, b"s", nc, ns, peer, self.node)
                                             for k in keys]}, deadline)
            answer = recv_handshake(sock, deadline)
            given = str(answer.get("proof", ""))
            used = next((k for k in keys if hmac.compare_digest(
                given, handshake_proof(k, b"c", nc, ns, peer, self.node))), None)
            if used is None:
                stage = "authentication"
                raise TransferError(f"{peer} failed authentication")
            chan = Channel(sock, hmac.new(used, b"k" + nc + ns, hashlib.sha256).digest(),
                           client=False, **self._timeouts)
            self.gate.settled(sock)
            stage = "frame"
            with contextlib.ExitStack() as stack:
                self._loop(chan, _Pins(self.store, stack), peer)
        except (TransferError, OSError, ValueError, RecordError) as exc:
            self.errors += 1
            cause = exc.__cause__ if isinstance(exc.__cause__, FrameError) else None
            closed = cause is not None and cause.kind == "closed" and \
                "closed by the peer" in str(exc)
            if self.gate.evicted(sock):
                closed = True  # counted by the gate
            elif not (closed and stage == "frame"):  # a clean end after requests is no error
                kind = ("io" if isinstance(exc, OSError) else
                        "timeout" if cause is not None and cause.kind == "timeout" else
                        "authentication" if "authentication failed" in str(exc) else stage)
                self._refused(kind)
            if not closed:
                self._quota.log(stage, logging.WARNING, "chunk transfer with %s ended: %s",
                                peer, exc)
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def _loop(self, chan: Channel, pins: _Pins, peer: str) -> None:
        while True:
            try:
                header, body = chan.recv()
            except TransferError as exc:
                cause = exc.__cause__
                if isinstance(cause, FrameError) and cause.kind == "closed" and \
                        "closed by the peer" in str(exc):
                    return
                raise
            op = header.get("op")
            handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) and \
                op.isidentifier() else None
            if handler is None:
                raise TransferError(f"unknown op {op!r:.40}")
            try:
                if self._allowed is not None and "job" in header and \
                        not self._allowed(peer, job := job_field(header)):
                    self._refused("forbidden")
                    raise TransferError(f"{peer} is not a node of job {job}")
                reply, out = handler(header, body, pins)
            except RapsError as exc:
                reply, out = {"ok": False, "error": str(exc)}, b""
            if not header.get("urgent"):
                # restores are not throttled: every rank of the job waits for them
                self._limiter.take(len(out))
            chan.send(reply, out)

    def _op_has(self, h: dict[str, Any], body: memoryview, pins: _Pins
                ) -> tuple[dict[str, Any], bytes]:
        job = job_field(h)
        digests = digests_field(h)
        for d in digests:  # what we already hold must survive until the manifest comes
            pins.add(job, d)
        return {"ok": True, "missing": self.store.missing(job, digests)}, b""

    def _op_put(self, h: dict[str, Any], body: memoryview, pins: _Pins
                ) -> tuple[dict[str, Any], bytes]:
        job = job_field(h)
        algo = h.get("algo", self._algo)
        if algo not in ("blake3", "sha256"):
            raise TransferError(f"unknown digest {algo!r:.20}")
        dec = Decoder()
        good, bad = [], []
        for digest, raw, stored in decode_records(body):
            reason = verify_chunk(algo, digest, raw, stored, dec)
            if reason is not None:
                bad.append(digest)
                log.warning("chunk %s of job %s from a peer is bad: %s", digest[:16], job, reason)
                continue
            pins.add(job, digest)
            good.append((digest, raw, stored))
        written, nbytes = self.store.put_many(job, good)
        return {"ok": True, "stored": written, "bytes": nbytes, "bad": bad}, b""

    def _op_put_manifest(self, h: dict[str, Any], body: memoryview, pins: _Pins
                         ) -> tuple[dict[str, Any], bytes]:
        job = job_field(h)
        m = Manifest.from_json("manifest from a peer", bytes(body))
        if m.job != job:
            raise TransferError(f"manifest of job {m.job} sent for job {job}")
        missing = self.store.missing(job, m.digests())
        if missing:
            return {"ok": False, "error": f"{len(missing)} chunk(s) missing",
                    "missing": missing}, b""
        self.store.put_manifest(m)
        self.store.collect(job, self.max_generations)
        return {"ok": True}, b""

    def _op_get_manifest(self, h: dict[str, Any], body: memoryview, pins: _Pins
                         ) -> tuple[dict[str, Any], bytes]:
        raw = self.store.manifest_bytes(job_field(h), int_field(h, "rank"), int_field(h, "gen"))
        return {"ok": True, "found": raw is not None}, raw or b""

    def _op_get(self, h: dict[str, Any], body: memoryview, pins: _Pins
                ) -> tuple[dict[str, Any], bytes]:
        job = job_field(h)
        out, missing = [], []
        for d in digests_field(h):
            try:
                data = self.store.read(job, d)
            except FileNotFoundError:
                missing.append(d)
                continue
            raw = self.store.raw_size(job, d) or 0
            out.append((d, raw, data))
        return {"ok": True, "missing": missing}, encode_records(out)

    def _op_log_put(self, h: dict[str, Any], body: memoryview, pins: _Pins
                    ) -> tuple[dict[str, Any], bytes]:
        job, rank = job_field(h), int_field(h, "rank")
        if "part" in h:  # a segment too large for one frame, in pieces
            n, off, total = part_field(h)
            done = self.logs.put_part(job, rank, n, off, total, body)
            return {"ok": True, "segs": [n] if done else []}, b""
        segs = segs_field(h, len(body))
        pos = 0
        for n, size in segs:
            self.logs.append(job, rank, bytes(body[pos:pos + size]), number=n, sync_dir=False)
            pos += size
        self.logs.sync(job, rank)  # one directory sync for the batch, before the reply
        return {"ok": True, "segs": [n for n, _ in segs]}, b""

    def _op_log_have(self, h: dict[str, Any], body: memoryview, pins: _Pins
                     ) -> tuple[dict[str, Any], bytes]:
        return {"ok": True, "segments": self.logs.segments(job_field(h), int_field(h, "rank"))}, b""

    def _op_log_get(self, h: dict[str, Any], body: memoryview, pins: _Pins
                    ) -> tuple[dict[str, Any], bytes]:
        """A page of a rank's log from the cursor ``from`` ([number, offset], default the
        start): whole segments up to BATCH_BYTES, or one piece of a larger one. Each item
        is [number, offset, length, segment size]; ``more`` while the log goes on."""
        job, rank = job_field(h), int_field(h, "rank")
        start, start_off = cursor_field(h)
        parts: list[bytes] = []
        items: list[list[int]] = []
        used = 0
        for n in self.logs.segments(job, rank):
            if n < start:
                continue
            off = start_off if n == start else 0
            total = self.logs.size(job, rank, n)
            if off >= total:
                continue  # gone meanwhile, or wholly sent
            if used and used + total - off > BATCH_BYTES:
                return {"ok": True, "segments": items, "more": True}, b"".join(parts)
            data = self.logs.segment(job, rank, n, off, BATCH_BYTES)
            if not data:
                continue
            parts.append(data)
            items.append([n, off, len(data), total])
            used += len(data)
            if off + len(data) < total:
                return {"ok": True, "segments": items, "more": True}, b"".join(parts)
        return {"ok": True, "segments": items, "more": False}, b"".join(parts)

    def _op_log_trim(self, h: dict[str, Any], body: memoryview, pins: _Pins
                     ) -> tuple[dict[str, Any], bytes]:
        floors = h.get("floors")
        if not isinstance(floors, dict) or not all(
                isinstance(k, str) and k.isdigit() and type(v) is int for k, v in floors.items()):
            raise TransferError("field 'floors': expected an object of rank -> seq")
        n = self.logs.trim(job_field(h), int_field(h, "rank"),
                           {int(k): v for k, v in floors.items()})
        return {"ok": True, "trimmed": n}, b""

    def _op_verify(self, h: dict[str, Any], body: memoryview, pins: _Pins
                   ) -> tuple[dict[str, Any], bytes]:
        found = verify_local(self.store, job_field(h), int_field(h, "rank"), int_field(h, "gen"))
        return {"ok": True, **found}, b""


def verify_local(store: ChunkStore, job: str, rank: int, gen: int) -> dict[str, Any]:
    """Re-read and check one generation held here: ``{"found", "chunks", "bad": [...]}``."""
    with store.pinned(job, gens=[(rank, gen)]):
        try:
            m = store.manifest(job, rank, gen)
        except RapsError as exc:
            return {"found": True, "chunks": 0,
                    "bad": [{"digest": "manifest", "reason": str(exc)}]}
        if m is None:
            return {"found": False, "chunks": 0, "bad": []}
        buf = bytearray(m.total_size)
        bad = read_into(m, lambda d: store.read(job, d), memoryview(buf))
        return {"found": True, "chunks": len(m.chunks),
                "bad": [{"digest": b.digest, "reason": b.reason} for b in bad]}


# --- client -------------------------------------------------------------------------------


@dataclass
class PushResult:
    """What one push of a generation to one peer moved."""

    offered: int
    sent_chunks: int
    sent_bytes: int
    ok: bool
    error: str = ""


class TransferClient:
    """One authenticated connection to a peer's transfer server."""

    def __init__(self, key: bytes | PeerKeys, node: str, address: tuple[str, int], *,
                 peer: str | None = None, limiter: TokenBucket | None = None,
                 timeout: float = TIMEOUT, handshake_timeout: float = HANDSHAKE_TIMEOUT
                 ) -> None:
        keys = key if isinstance(key, PeerKeys) else PeerKeys.from_cluster(key, node)
        self.peer = ""
        self.address = address
        self._limiter = limiter or TokenBucket(0)
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except OSError as exc:
            raise TransferError(f"cannot connect to {address[0]}:{address[1]}: {exc}") from exc
        try:
            deadline = time.monotonic() + handshake_timeout
            nc = os.urandom(16)
            send_handshake(sock, {"node": node, "nonce": nc.hex()}, deadline)
            hello = recv_handshake(sock, deadline)
            self.peer, ns = hello_node(hello), hello_nonce(hello)
            if peer is not None and self.peer != peer:
                raise TransferError(f"the server there is {self.peer!r}, not {peer!r}")
            ticket = keys.ticket(self.peer)
            if ticket is None:
                raise TransferError(f"no transfer ticket for node {self.peer!r} "
                                    "(detection.transfer_tickets_file)")
            want = handshake_proof(ticket, b"s", nc, ns, node, self.peer)
            offered = hello.get("proofs")
            offered = offered if isinstance(offered, list) else [hello.get("proof", "")]
            if not any(hmac.compare_digest(str(p), want) for p in offered[:2]):
                raise TransferError(f"{address[0]}:{address[1]} failed authentication")
            send_handshake(sock, {"proof": handshake_proof(ticket, b"c", nc, ns, node,
                                                           self.peer)}, deadline)
            self._chan = Channel(sock, hmac.new(ticket, b"k" + nc + ns, hashlib.sha256).digest(),
                                 client=True, idle_timeout=timeout)
        except (OSError, TransferError) as exc:
            sock.close()
            raise TransferError(f"handshake with {address[0]}:{address[1]}: {exc}") from exc

    def close(self) -> None:
        """Close the connection."""
        with contextlib.suppress(OSError):
            self._chan.sock.close()

    def __enter__(self) -> TransferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, header: dict[str, Any], body: bytes = b"") -> tuple[dict[str, Any], memoryview]:
        """One request and its reply; TransferError on transport failure or refusal."""
        self._limiter.take(len(body))
        try:
            self._chan.send(header, body)
            reply, out = self._chan.recv()
        except OSError as exc:
            raise TransferError(f"{self.peer}: {exc}") from exc
        if reply.get("ok") is not True:
            raise TransferError(f"{self.peer} refused {header.get('op')}: "
                                f"{reply.get('error', 'no reason given')}")
        return reply, out

    def push(self, store: ChunkStore, manifest: Manifest, *, delta: bool = True) -> PushResult:
        """Send a generation held in ``store``: chunks the peer lacks (all with ``delta``
        off), then the manifest."""
        job = manifest.job
        digests = sorted(manifest.digests())
        if delta:
            reply, _ = self.call({"op": "has", "job": job, "digests": digests})
            want = digests_field({"digests": reply.get("missing")})
        else:
            want = digests
        sent = nbytes = 0
        for batch in _batches(store, job, want):
            body = encode_records(batch)
            reply, _ = self.call({"op": "put", "job": job, "algo": manifest.digest_algo}, body)
            if reply.get("bad"):
                raise TransferError(f"{self.peer} found {len(reply['bad'])} bad chunk(s) in "
                                    f"what we sent, first {str(reply['bad'][0])[:16]}")
            sent += len(batch)
            nbytes += len(body)
        self.call({"op": "put_manifest", "job": job}, manifest.to_json())
        return PushResult(len(digests), sent, nbytes, True)

    def fetch(self, job: str, digests: Sequence[str], sizes: dict[str, int]
              ) -> Iterator[tuple[str, int, memoryview]]:
        """Stored chunks from the peer, in batches; absent ones are skipped."""
        for batch in self.fetch_batches(job, digests, sizes):
            yield from batch

    def fetch_batches(self, job: str, digests: Sequence[str], sizes: dict[str, int],
                      depth: int = 2, urgent: bool = False
                      ) -> Iterator[list[tuple[str, int, memoryview]]]:
        """Like :meth:`fetch`, one list per frame. ``depth`` requests are in flight, so the
        peer prepares the next batch while this side receives the last one; ``urgent``
        (a restore) asks the peer not to apply its ``replication_mbps`` cap."""
        batches: list[list[str]] = [[]]
        size = 0
        for d in digests:
            batches[-1].append(d)
            size += sizes.get(d, MAX_CHUNK) + STORED_SLACK
            if size >= BATCH_BYTES:
                batches.append([])
                size = 0
        todo = [b for b in batches if b]
        sent = 0
        try:
            while sent < min(depth, len(todo)):
                self._chan.send({"op": "get", "job": job, "digests": todo[sent],
                                 "urgent": urgent})
                sent += 1
            for _ in range(len(todo)):
                reply, body = self._chan.recv()
                if sent < len(todo):
                    self._chan.send({"op": "get", "job": job, "digests": todo[sent],
                                     "urgent": urgent})
                    sent += 1
                if reply.get("ok") is not True:
                    raise TransferError(f"{self.peer} refused get: "
                                        f"{reply.get('error', 'no reason given')}")
                yield list(decode_records(body))
        except OSError as exc:
            raise TransferError(f"{self.peer}: {exc}") from exc

    def _get(self, job: str, digests: list[str]) -> Iterator[tuple[str, int, memoryview]]:
        _, body = self.call({"op": "get", "job": job, "digests": digests})
        yield from decode_records(body)

    def manifest(self, job: str, rank: int, gen: int) -> bytes | None:
        """The peer's copy of a manifest, None if it has none."""
        reply, body = self.call({"op": "get_manifest", "job": job, "rank": rank, "gen": gen})
        return bytes(body) if reply.get("found") else None

    def verify(self, job: str, rank: int, gen: int) -> dict[str, Any]:
        """Ask the peer to re-read and check a generation it holds."""
        reply, _ = self.call({"op": "verify", "job": job, "rank": rank, "gen": gen})
        return reply


def _batches(store: ChunkStore, job: str, digests: Sequence[str]
             ) -> Iterator[list[tuple[str, int, bytes]]]:
    batch: list[tuple[str, int, bytes]] = []
    size = 0
    for d in digests:
        data = store.read(job, d)
        batch.append((d, store.raw_size(job, d) or 0, data))
        size += len(data)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
