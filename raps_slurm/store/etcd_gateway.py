"""What goes over etcd's JSON gateway for :class:`~raps_slurm.store.etcd.EtcdStore`:
base64 keys and values, prefix range ends, key-values and revisions read from replies,
and what a failed request tells about its outcome."""

from __future__ import annotations

import base64
import json
from typing import Any

import requests
import urllib3.exceptions
from etcd3gw import exceptions as gw_exc

from raps_slurm.store.base import KeyValue

GRPC_NOT_FOUND = 5
GRPC_UNAUTHENTICATED = 16
GW_TRANSPORT = (gw_exc.ConnectionFailedError, gw_exc.ConnectionTimeoutError)
TRANSPORT_ERRORS = (*GW_TRANSPORT, requests.RequestException)


def b64(data: bytes) -> str:
    """``data`` as the gateway's JSON carries keys and values."""
    return base64.b64encode(data).decode("ascii")


def range_end(prefix: bytes) -> bytes:
    """etcd's end of a prefix range: the prefix with its last byte incremented."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"  # etcd: every key >= the start
    end[-1] += 1
    return bytes(end)


def key_value(item: dict[str, Any]) -> KeyValue:
    """One ``kvs`` item of a range reply."""
    # int64 fields arrive as strings; zero values are omitted.
    lease = int(item.get("lease", 0))
    return KeyValue(key=base64.b64decode(item["key"]).decode("utf-8", "replace"),
                    value=base64.b64decode(item.get("value", "")),
                    mod_revision=int(item.get("mod_revision", 0)),
                    create_revision=int(item.get("create_revision", 0)),
                    lease_id=lease or None)


def header_revision(result: dict[str, Any]) -> int:
    """The store revision in a reply's header (0 when absent)."""
    return int(result.get("header", {}).get("revision", 0))


def error_detail(exc: gw_exc.Etcd3Exception) -> tuple[int | None, str]:
    """grpc code and message from the gateway's JSON error body."""
    text = exc.detail_text or ""
    try:
        body = json.loads(text)
        return body.get("code"), str(body.get("error") or body.get("message") or text)
    except (ValueError, AttributeError):
        return None, text.strip() or type(exc).__name__


def never_sent(exc: BaseException) -> bool:
    """True if the request cannot have reached etcd (refused, unresolved, connect timeout)."""
    cause = exc if isinstance(exc, requests.RequestException) else exc.__context__
    if isinstance(cause, requests.ConnectTimeout):
        return True
    if isinstance(cause, requests.ConnectionError) and cause.args:
        reason = getattr(cause.args[0], "reason", None)
        # NewConnectionError (refused, unresolved) subclasses ConnectTimeoutError
        return isinstance(reason, urllib3.exceptions.ConnectTimeoutError)
    return False


def refused(exc: BaseException) -> bool:
    """True if the connection was refused (nothing listens: the member is not running)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError):
            return True
        todo += [e.__cause__, e.__context__, getattr(e, "reason", None),
                 *(a for a in e.args if isinstance(a, BaseException))]
    return False


def short_error(exc: BaseException) -> str:
    """One line for an error message, e.g. ``[Errno 111] Connection refused``."""
    cause = exc.__context__ if isinstance(exc, gw_exc.Etcd3Exception) else exc
    if isinstance(cause, requests.RequestException):
        reason = getattr(cause.args[0], "reason", None) if cause.args else None
        text = str(reason or cause)
        return text[text.find("[Errno"):] if "[Errno" in text else text[:200]
    if isinstance(exc, gw_exc.Etcd3Exception):
        return error_detail(exc)[1][:200]
    return str(exc)[:200] or type(exc).__name__
