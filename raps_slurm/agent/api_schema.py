"""The local API's request schemas: strict decoding of what a user process sends.

Every request is a JSON object with an ``op`` and the fields its schema names (all of
them but those marked :class:`Omittable`, and no other);
decoding refuses duplicate keys, NaN/Infinity and deep nesting, and every refusal is a
:class:`Refused` with a kind (counted by the server) and one line naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from raps_slurm.errors import Refused as Refused  # re-exported: every op module raises it
from raps_slurm.runtime.agent_client import MAX_JOB_ID_LEN

OPS = ("hello", "register", "heartbeat", "unregister")
PID_LIMIT = 1 << 22  # Linux PID_MAX_LIMIT on 64-bit


def _show(value: object) -> str:
    """A short, printable rendering of a client-supplied value for an error message."""
    if isinstance(value, str):
        return repr(value[:40] + ("..." if len(value) > 40 else ""))
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "a list"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:  # json keeps the last silently; two readers could disagree
            raise ValueError(f"duplicate key {_show(key)}")
        seen.add(key)
    return dict(pairs)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not allowed")


def decode_request(body: bytes) -> dict[str, object]:
    """One request body as a JSON object; Refused (the connection must close) otherwise."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused("encoding", f"request is not valid UTF-8 (byte {exc.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise Refused("json", "request is not valid JSON: nested too deeply") from None
    except ValueError as exc:
        raise Refused("json", f"request is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise Refused("not_object", f"request must be a JSON object, got {type(obj).__name__}")
    return obj


def is_int(value: object, low: int, high: int) -> bool:
    # bool is an int in Python; true must not pass for rank 1.
    return type(value) is int and low <= value <= high


Check = tuple[Callable[[object], bool], str]


class Omittable(tuple[Callable[[object], bool], str]):
    """A :data:`Check` whose field a request may leave out (its handler then sees no key);
    when present it is checked like any other."""


JOB: Check = (lambda v: isinstance(v, str) and v.isascii() and v.isdigit()
                and 1 <= len(v) <= MAX_JOB_ID_LEN,
                f"a string of 1..{MAX_JOB_ID_LEN} decimal digits")
RANK: Check = (lambda v: is_int(v, 0, 2**31 - 1), "an integer >= 0 and < 2**31")
_COUNT: Check = (lambda v: is_int(v, 0, 2**63 - 1), "an integer >= 0 and < 2**63")
EPOCH: Check = (lambda v: is_int(v, 1, 2**63 - 1), "an integer >= 1 and < 2**63")
_PID: Check = (lambda v: is_int(v, 1, PID_LIMIT), f"an integer 1..{PID_LIMIT}")
_PEER: Check = (lambda v: v is None or is_int(v, 0, 2**31 - 1),
                 "null or an integer >= 0 and < 2**31")
SCHEMAS: dict[str, dict[str, Check]] = {
    "hello": {},
    "register": {"job": JOB, "rank": RANK, "epoch": EPOCH, "pid": _PID},
    "heartbeat": {"job": JOB, "rank": RANK, "step": _COUNT, "items": _COUNT,
                  "blocked_on": _PEER},
    "unregister": {"job": JOB, "rank": RANK},
}


def parse_request(obj: Mapping[str, object],
                  schemas: Mapping[str, Mapping[str, Check]] = SCHEMAS
                  ) -> tuple[str, dict[str, object]]:
    """(op, fields) after checking the op's schema; Refused naming the field otherwise."""
    ops = ", ".join(schemas)
    if "op" not in obj:
        raise Refused("schema", f"missing field 'op' (allowed ops: {ops})")
    op = obj["op"]
    if not isinstance(op, str):
        raise Refused("schema", f"field 'op': expected a string, got {_show(op)}")
    schema = schemas.get(op)
    if schema is None:
        raise Refused("unknown_op", f"unknown op {_show(op)} (allowed: {ops})")
    allowed = ", ".join(["op", *schema])
    for key in obj:
        if key != "op" and key not in schema:
            raise Refused("schema", f"unknown field {_show(key)} for op '{op}' "
                                    f"(allowed: {allowed})")
    for key, check in schema.items():
        ok, what = check
        if key not in obj:
            if isinstance(check, Omittable):
                continue
            raise Refused("schema", f"missing field '{key}' for op '{op}' (allowed: {allowed})")
        if not ok(obj[key]):
            raise Refused("schema", f"field '{key}': expected {what}, got {_show(obj[key])}")
    return op, {k: v for k, v in obj.items() if k != "op"}


