"""Strict JSON records for etcd values: typed field access with one-line errors. Pure."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from raps_slurm.errors import RecordError


def dump(data: dict[str, Any]) -> bytes:
    """Canonical JSON bytes (sorted keys, no spaces): equal records give equal values."""
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


@dataclass
class Reader:
    """Typed field access to one JSON object from etcd, with one-line errors."""

    key: str
    raw: Any
    data: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        obj = self.raw
        if isinstance(obj, (bytes, bytearray)):
            try:
                obj = json.loads(obj)
            except (ValueError, UnicodeDecodeError) as exc:
                raise RecordError(f"{self.key}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise RecordError(f"{self.key}: expected a JSON object, got {type(obj).__name__}")
        self.data = obj

    def _bad(self, name: str, want: str) -> RecordError:
        got = self.data.get(name, "<missing>")
        return RecordError(f"{self.key}: field {name!r}: expected {want}, got {got!r:.80}")

    def integer(self, name: str, lo: int = 0, hi: int = 2**63) -> int:
        v = self.data.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self._bad(name, f"an integer {lo}-{hi}")
        return v

    def opt_integer(self, name: str, lo: int = 0, hi: int = 2**63) -> int | None:
        return None if self.data.get(name) is None else self.integer(name, lo, hi)

    def num(self, name: str) -> float:
        v = self.data.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._bad(name, "a number")
        return float(v)

    def opt_num(self, name: str) -> float | None:
        return None if self.data.get(name) is None else self.num(name)

    def text(self, name: str, *, empty: bool = False) -> str:
        v = self.data.get(name)
        if not isinstance(v, str) or (not v and not empty):
            raise self._bad(name, "a string" if empty else "a non-empty string")
        return v

    def opt_text(self, name: str) -> str | None:
        return None if self.data.get(name) is None else self.text(name)

    def choice(self, name: str, allowed: tuple[str, ...]) -> str:
        v = self.data.get(name)
        if v not in allowed:
            raise self._bad(name, "one of " + ", ".join(allowed))
        return str(v)

    def obj(self, name: str) -> dict[str, Any]:
        v = self.data.get(name)
        if not isinstance(v, dict):
            raise self._bad(name, "an object")
        return v

    def names(self, name: str, *, empty: bool = False) -> tuple[str, ...]:
        v = self.data.get(name)
        if (not isinstance(v, list) or (not v and not empty)
                or not all(isinstance(x, str) and x for x in v)):
            raise self._bad(name, "a list of node names")
        return tuple(v)
