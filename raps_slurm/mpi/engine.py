"""MPI matching on the logged runtime: envelopes, posted and unexpected messages, and
the determinants that make any-source matching replayable.

The runtime delivers, per source, the messages in the order they were sent, and its
``recv`` names the source. MPI matches on ``(source, tag, communicator)`` with
wildcards, so every runtime message carries an *envelope* (:data:`ENVELOPE`: kind,
context id, tag) before its bytes, and this engine pulls messages from the runtime
into per-source *unexpected* queues (arrival order kept), and matches them against
*posted* receives in posting order, as MPI says: messages from one sender never
overtake each other, and of two posted receives that match a message the first wins.

Determinants. Which source an ``ANY_SOURCE`` receive matched, and the outcome of a
``Test``/``Testany``/``Testall``/``Waitany``/``Iprobe``/``Probe(ANY_SOURCE)``, depend
on timing. Each is recorded in the rank's own log stream (``Context.record``), which
the runtime makes durable before the rank's next send. A matched receive is named by
its *receive serial* (the n-th receive this rank posted), a test-like call by its *test
serial*; a negative outcome is recorded only as "test serials up to n without a record
were negative" before a send. A restored rank reads the records made after its
checkpoint and, for those serials, takes the same decisions: a replayed receive acts
as a receive from the recorded source, a replayed test returns the recorded outcome
(waiting for completion when it was positive).
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from raps_slurm.runtime.context import Context
from raps_slurm.runtime.inbox import Placed
from raps_slurm.runtime.receiving import Into

ANY_SOURCE, ANY_TAG, PROC_NULL = -1, -1, -2
ENVELOPE = struct.Struct(">BQi")  # kind, context id, tag
OBJ, RAW = 1, 2                   # pickled object / raw buffer bytes
DET = struct.Struct(">BQqqq")     # kind, serial, a, b, c
D_MATCH, D_TEST, D_NEG = 1, 2, 3


@dataclass(slots=True)
class Msg:
    """One message, pulled from the runtime and not yet matched."""

    src: int        # world rank
    ctx: int
    tag: int
    kind: int
    data: bytes | memoryview  # a view past the envelope: large bodies are not copied again
    order: int = 0  # arrival order (for ANY_SOURCE among unexpected messages)
    placed: bool = False  # ``data`` is the matched receive's own buffer (Recv.into)


@dataclass(slots=True)
class Recv:
    """A posted receive (world ranks); ``msg`` once matched."""

    serial: int
    ctx: int
    src: int            # world rank or ANY_SOURCE
    tag: int
    msg: Msg | None = None
    fixed: int | None = None  # replay: the source a recorded determinant names
    into: memoryview | None = None  # the receive's buffer, if a message may be read into it
    claimed: int | None = None  # ANY_SOURCE: the source whose message is read into ``into``

    def want(self) -> int:
        """The source this receive can match (ANY_SOURCE if not known)."""
        if self.fixed is not None:
            return self.fixed
        return self.claimed if self.claimed is not None else self.src

    def matches(self, m: Msg) -> bool:
        """MPI matching rule for this receive and ``m``."""
        src = self.want()
        return (m.ctx == self.ctx and (src == ANY_SOURCE or src == m.src)
                and (self.tag == ANY_TAG or self.tag == m.tag))


@dataclass
class Replay:
    """Decisions recorded after the restored checkpoint, by serial."""

    matches: dict[int, int] = field(default_factory=dict)              # recv serial -> src
    tests: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # test serial -> out
    tests_upto: int = 0  # test serials up to here without a record were negative


class Engine:
    """Sends with envelopes, matching, progress and determinants for one rank."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.rank, self.size = ctx.rank, ctx.size
        self.unexpected: dict[int, deque[Msg]] = {}
        self.posted: list[Recv] = []
        self.arrivals = 0
        self.recv_serial = 0
        self.test_serial = 0
        self.negatives = False  # a negative test outcome not yet covered by a record
        self.replay = Replay()
        self.sends_hook: Callable[[], None] | None = None  # called before each send
        self.sent = 0  # messages sent to other ranks: the progress this rank reports

    # --- state in a checkpoint -------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a checkpoint must keep: unexpected messages and the serials."""
        if self.posted:
            raise RuntimeError(f"checkpoint with {len(self.posted)} receive request(s) "
                               "pending: complete them (Wait) before checkpointing")
        msgs = [(m.src, m.ctx, m.tag, m.kind, bytes(m.data), m.order)
                for q in self.unexpected.values() for m in q]
        return {"unexpected": msgs, "arrivals": self.arrivals, "sent": self.sent,
                "recv_serial": self.recv_serial, "test_serial": self.test_serial}

    def load(self, st: dict[str, Any], records: list[bytes]) -> None:
        """Put back a checkpoint's state and the decisions recorded after it (recorded
        again at once, same order: the log stream stays one consistent sequence)."""
        self.unexpected = {}
        for src, ctx_id, tag, kind, data, order in st.get("unexpected", []):
            self.unexpected.setdefault(src, deque()).append(
                Msg(src, ctx_id, tag, kind, data, order))
        self.arrivals = int(st.get("arrivals", 0))
        self.sent = int(st.get("sent", 0))
        self.recv_serial = int(st.get("recv_serial", 0))
        self.test_serial = int(st.get("test_serial", 0))
        self.replay = Replay()
        for rec in records:
            self.ctx.record(rec)
            kind, serial, a, b, c = DET.unpack(rec)
            if kind == D_MATCH:
                self.replay.matches[serial] = a
            elif kind == D_TEST:
                self.replay.tests[serial] = (a, b, c)
                self.replay.tests_upto = max(self.replay.tests_upto, serial)
            elif kind == D_NEG:
                self.replay.tests_upto = max(self.replay.tests_upto, serial)

    # --- sending ---------------------------------------------------------------------

    def send(self, dst: int, ctx_id: int, tag: int, kind: int, data: bytes | memoryview
             ) -> None:
        """One message to world rank ``dst`` (to itself: straight to its own queue)."""
        head = ENVELOPE.pack(kind, ctx_id, tag)
        if dst == self.rank:
            self._incoming(Msg(dst, ctx_id, tag, kind, bytes(data)))
            return
        if self.negatives:
            # "Every test until now without a record was negative" before a send that
            # may depend on it.
            self._record(DET.pack(D_NEG, self.test_serial, 0, 0, 0))
            self.negatives = False
        self.ctx.send_small(dst, head, data)  # joined as the log copies it
        # The program's progress: the agent relays it, and a relaunched rank's first
        # report once it has re-sent what it sent before its loss ends its recovery.
        self.sent += 1
        self.ctx.heartbeat(self.sent)

    # --- receiving -------------------------------------------------------------------

    def post(self, ctx_id: int, src: int, tag: int) -> Recv:
        """Post a receive (world source or ANY_SOURCE); matched at once if an unexpected
        message fits, else when one arrives."""
        self.recv_serial += 1
        r = Recv(self.recv_serial, ctx_id, src, tag)
        if src == ANY_SOURCE and r.serial in self.replay.matches:
            r.fixed = self.replay.matches.pop(r.serial)
        m = self._find(r.ctx, r.want(), r.tag, take=True)
        if m is not None:
            self._matched(r, m)
        else:
            self.posted.append(r)
        return r

    def wait(self, r: Recv) -> Msg:
        """Progress until ``r`` is matched (with ``r.into``, a large message for it may be
        read straight into that buffer: :meth:`_placer`)."""
        while r.msg is None:
            self._progress([r.want()])
        return r.msg

    def drain(self) -> None:
        """Take in whatever has arrived (never waits)."""
        self.ctx.poll()
        for src in range(self.size):
            if src == self.rank:
                continue
            while (raw := self.ctx.try_recv_buffer(src)) is not None:
                self._arrived(src, raw)

    def wait_any(self, reqs: list[Recv]) -> None:
        """Progress until at least one of ``reqs`` is matched."""
        while all(r.msg is None for r in reqs):
            self._progress([r.want() for r in reqs])

    def wait_all(self, reqs: list[Recv]) -> None:
        """Progress until every one of ``reqs`` is matched, taking messages as they come
        from any of their sources (a large one may be read into its receive's buffer
        while another is waited for)."""
        while wants := [r.want() for r in reqs if r.msg is None]:
            self._progress(wants)

    def probe(self, ctx_id: int, src: int, tag: int, block: bool) -> Msg | None:
        """The message a receive would match, left in place (``block``: wait for one).
        A test-like decision: recorded / replayed by test serial."""
        self.test_serial += 1
        serial = self.test_serial
        rep = self._replayed(serial)
        if rep is not None:
            found, rsrc, _ = rep
            if not found:
                return None
            src, block = rsrc, True
        while True:
            self.drain()
            m = self._find(ctx_id, src, tag, take=False)
            if m is not None or not block:
                break
            self._progress([src])
        if rep is None and (src == ANY_SOURCE or not block):
            self._decide(serial, m is not None, m.src if m else 0, m.tag if m else 0)
        return m

    def decision(self, outcome: Callable[[], tuple[int, int, int] | None],
                 wait_for: Callable[[tuple[int, int, int]], None]) -> tuple[int, int, int] | None:
        """A test-like call: ``outcome()`` is its result now (None: negative). Replayed:
        the recorded result, after ``wait_for`` it (a positive one)."""
        self.test_serial += 1
        serial = self.test_serial
        rep = self._replayed(serial)
        if rep is not None:
            if rep[0] == 0:
                return None
            wait_for(rep)
            return rep
        self.drain()
        got = outcome()
        self._decide(serial, *(got if got is not None else (0, 0, 0)))
        return got

    # --- internals -------------------------------------------------------------------

    def _replayed(self, serial: int) -> tuple[int, int, int] | None:
        """The recorded outcome of test serial ``serial`` ((0, 0, 0): negative), or None
        when it is not being replayed."""
        if serial in self.replay.tests:
            return self.replay.tests.pop(serial)
        if serial <= self.replay.tests_upto:
            return (0, 0, 0)
        return None

    def _decide(self, serial: int, a: int, b: int, c: int) -> None:
        if a:
            self._record(DET.pack(D_TEST, serial, a, b, c))
        else:
            self.negatives = True

    def _record(self, rec: bytes) -> None:
        if rec[0] != D_MATCH:  # a test serial recorded covers the negatives below it
            self.negatives = False
        self.ctx.record(rec)

    def _progress(self, wants: list[int]) -> None:
        """Wait for the next message from one of the sources ``wants`` (ANY_SOURCE: any
        rank), then take in everything else that has arrived. A large message for a
        posted receive with a buffer to read into may go straight there (:meth:`_placer`)."""
        if len(wants) == 1 and 0 <= wants[0] != self.rank:  # a receive from one peer
            src = wants[0]
            self._arrived(src, self.ctx.recv_buffer(src, into=self._placer(src)))
            return
        if ANY_SOURCE in wants:
            sources = [s for s in range(self.size) if s != self.rank]
        else:
            sources = sorted({s for s in wants if s != self.rank and s >= 0})
        if not sources:
            raise RuntimeError(f"rank {self.rank} waits for a message from itself that "
                               "was never sent (deadlock)")
        placers = {s: p for s in sources if (p := self._placer(s)) is not None}
        src, raw = self.ctx.recv_any_buffer(sources, into=placers)
        self._arrived(src, raw)

    def _placer(self, src: int) -> Into | None:
        """Where a large message from ``src`` goes as it comes (runtime
        ``recv_buffer``'s ``into``): into the buffer of the posted receive its envelope
        matches (the first in posting order) when that receive names ``src`` or
        ANY_SOURCE and has one (``Recv.into``) it fits; else None, and it is matched when
        whole, as any other. It is that receive's message: messages from ``src`` arrive in
        order, this is the next, and a receive posted later cannot come before it. An
        ANY_SOURCE receive is then *claimed* for ``src``: a message from another rank
        that is whole first goes to another receive (MPI orders messages per source
        only), and the match is recorded as any ANY_SOURCE match. None when no posted
        receive that ``src`` may match has such a buffer."""
        for q in self.posted:  # a loop, not any(): this runs once per receive
            if q.into is not None and q.want() in (src, ANY_SOURCE):
                break
        else:
            return None

        def place(buffered: memoryview, length: int) -> tuple[int, memoryview] | None:
            if len(buffered) < ENVELOPE.size:
                return None
            kind, ctx_id, tag = ENVELOPE.unpack_from(buffered)
            size = length - ENVELOPE.size
            if kind != RAW:
                return None  # an object: unpickled from its own bytes
            m = Msg(src, ctx_id, tag, kind, b"")
            q = next((q for q in self.posted if q.matches(m)), None)
            if q is None or q.into is None or size > q.into.nbytes:
                return None  # unexpected, or truncated: the receive says so when whole
            if q.want() == ANY_SOURCE:
                q.claimed = src  # the caller reads the frame into it from here on
            return ENVELOPE.size, q.into[:size]

        return place

    def _arrived(self, src: int, raw: bytes | memoryview | Placed) -> None:
        if isinstance(raw, Placed):
            kind, ctx_id, tag = ENVELOPE.unpack_from(raw.head)
            self._incoming(Msg(src, ctx_id, tag, kind, raw.tail, placed=True))
            return
        kind, ctx_id, tag = ENVELOPE.unpack_from(raw)
        self._incoming(Msg(src, ctx_id, tag, kind, memoryview(raw)[ENVELOPE.size:]))

    def _incoming(self, m: Msg) -> None:
        self.arrivals += 1
        m.order = self.arrivals
        for i, r in enumerate(self.posted):
            if r.matches(m):
                del self.posted[i]
                self._matched(r, m)
                return
        q = self.unexpected.get(m.src)
        if q is None:  # not setdefault: a deque made per message and thrown away
            q = self.unexpected[m.src] = deque()
        q.append(m)

    def _matched(self, r: Recv, m: Msg) -> None:
        r.msg = m
        if r.src == ANY_SOURCE and r.fixed is None:
            self._record(DET.pack(D_MATCH, r.serial, m.src, 0, 0))

    def _find(self, ctx_id: int, src: int, tag: int, *, take: bool) -> Msg | None:
        """The unexpected message a receive ``(ctx_id, src, tag)`` matches: the first
        from ``src``; with ANY_SOURCE the earliest arrived among each source's first."""
        if src == ANY_SOURCE:
            queues: Iterable[tuple[int, deque[Msg]]] = self.unexpected.items()
        else:
            mine = self.unexpected.get(src)
            if not mine:  # the usual case of a blocking receive: nothing came unasked
                return None
            queues = [(src, mine)]
        best: tuple[int, int, int] | None = None  # order, src, index
        for s, q in queues:
            for i, m in enumerate(q):
                if m.ctx == ctx_id and (tag == ANY_TAG or tag == m.tag):
                    if best is None or m.order < best[0]:
                        best = (m.order, s, i)
                    break
        if best is None:
            return None
        q = self.unexpected[best[1]]
        m = q[best[2]]
        if take:
            del q[best[2]]
        return m
