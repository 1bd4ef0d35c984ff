"""Who a rank may talk to, and how it proves it: the keys of a rank's traffic with each
peer, the proofs of the handshake (runtime/transport.py, whose docstring gives the
protocol), and the refusals counted."""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import blake3

from raps_slurm.errors import RapsError
from raps_slurm.logquota import LogQuota
from raps_slurm.runtime.frames import ALIGN, DATA, HEADER, MAX_MESSAGE, FrameError
from raps_slurm.wire import framing

log = logging.getLogger("raps.runtime")

PROTOCOL = b"raps-rank/3"
FRAME_MAC = ("control", "all")  # messagelog.frame_mac: which frames carry a MAC
KEY_BYTES = 32
ASK_EVERY = 1.0  # s: a peer's keys are asked of the agent again at most this often
ASK_BURST = 2.0  # ... after this many at once
_BOUND = struct.Struct(">IIQQB")  # what a proof binds besides the nonces


@dataclass(frozen=True)
class RankKeys:
    """The keys of one rank's traffic with a peer, and where the rank map puts the peer:
    ``connect`` is proved when connecting to it (empty: none to be had), ``accept`` are
    the keys it may prove when it connects here, ``epoch`` the epoch it runs at (None:
    not checked, for a fixed test key)."""

    connect: bytes
    accept: tuple[bytes, ...]
    epoch: int | None


def tagged(kind: int, mode: str) -> bool:
    """Whether a frame of ``kind`` carries a MAC under ``frame_mac`` ``mode``."""
    return mode == "all" or kind != DATA


class Auth:
    """One rank's keys: proofs, session keys, refusal counts. ``keys`` gives the
    :class:`RankKeys` of a peer rank (or is one key for every pair, in tests); ``epoch``
    is this incarnation's, ``frame_mac`` which frames carry a MAC (:data:`FRAME_MAC`)."""

    def __init__(self, keys: bytes | Callable[[int], RankKeys], rank: int,
                 max_message: int = MAX_MESSAGE, *, epoch: int = 0,
                 frame_mac: str = "control", ranks: int = 1 << 31) -> None:
        if isinstance(keys, bytes):
            if len(keys) != KEY_BYTES:
                raise ValueError(f"key of {len(keys)} bytes: exactly {KEY_BYTES} are needed")
            fixed = RankKeys(keys, (keys,), None)
            keys = lambda peer: fixed  # noqa: E731
        if not 0 < max_message <= (1 << 32) - ALIGN - HEADER.size - framing.TAG_SIZE:
            raise ValueError(f"max_message {max_message}: expected 1..4 GiB")
        if frame_mac not in FRAME_MAC:
            raise ValueError(f"frame_mac {frame_mac!r}: expected one of {', '.join(FRAME_MAC)}")
        self._source, self.rank, self.max_message = keys, rank, max_message
        # peer -> (its keys or why there are none, when asked, forgotten since, tokens)
        self._keys: dict[int, tuple[RankKeys | str, float, bool, float]] = {}
        self.ranks = ranks
        self.epoch, self.frame_mac = epoch, frame_mac
        self.mode = FRAME_MAC.index(frame_mac)
        # a DATA frame's padding (frames.pad) counts: at most ALIGN - 1 bytes
        self.max_frame = HEADER.size + ALIGN - 1 + max_message + framing.TAG_SIZE
        self.refused: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._quota = LogQuota(log)

    def keys_for(self, peer: int, fresh: bool = False) -> RankKeys:
        """``peer``'s :class:`RankKeys`, asked once and kept (``fresh``: asked again, as
        after the peer moved or a handshake with it failed); FrameError if not to be had.

        Asking again takes a token of the peer's bucket (:data:`ASK_BURST` at once, one
        more each :data:`ASK_EVERY`): a new incarnation's first hello is answered at
        once, and a stranger's hellos (a rank out of range, a wrong epoch, a wrong
        proof) cost the agent and etcd no more than that; an answer or a refusal is kept
        until then."""
        if not 0 <= peer < self.ranks:
            raise FrameError(f"rank {peer}: this job has ranks 0..{self.ranks - 1}",
                             "handshake")
        now = time.monotonic()
        with self._lock:
            known = self._keys.get(peer)
            ask, tokens = known is None, 0.0
            if known is not None and (fresh or known[2]):
                tokens = min(ASK_BURST, known[3] + (now - known[1]) / ASK_EVERY)
                ask = tokens >= 1
        if ask:
            try:
                got: RankKeys | str = self._source(peer)
            except (OSError, RapsError) as exc:
                got = f"no keys for rank {peer}: {exc}"
            with self._lock:
                left = ASK_BURST - 1 if known is None else tokens - 1
                self._keys[peer] = known = (got, now, False, left)
        assert known is not None
        if isinstance(known[0], str):
            raise FrameError(known[0], "handshake")
        return known[0]

    def forget(self, peer: int) -> None:
        """Ask for ``peer``'s keys again next time (if its bucket has a token)."""
        with self._lock:
            known = self._keys.get(peer)
            if known is not None:
                self._keys[peer] = (known[0], known[1], True, known[3])

    def proof(self, key: bytes, side: bytes, nc: bytes, ns: bytes, src: int, dst: int,
              src_epoch: int = 0, dst_epoch: int = 0) -> bytes:
        """``P(side)`` of the module docstring under ``key`` (this rank's ``frame_mac``
        bound in)."""
        bound = _BOUND.pack(src, dst, src_epoch, dst_epoch, self.mode)
        return bytes(blake3.blake3(PROTOCOL + side + nc + ns + bound, key=key).digest())

    def tagged(self, first: int) -> bool:
        """Whether a frame whose body starts with ``first`` (its kind) carries a MAC."""
        return tagged(first, self.frame_mac)

    def refuse(self, kind: str, peer: str, reason: object) -> None:
        """Count one refusal and log it (one line, at most one per kind per 10 s)."""
        with self._lock:
            self.refused[kind] += 1
        self._quota.log(kind, logging.WARNING, "rank %d: refused %s (%s): %s", self.rank,
                        peer, kind, reason)

    def refusals(self) -> dict[str, int]:
        """A copy of ``refused`` (kind -> connections)."""
        with self._lock:
            return dict(self.refused)
