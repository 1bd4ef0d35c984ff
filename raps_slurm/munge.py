"""MUNGE credentials through ``libmunge`` (ctypes), as Slurm's own clients use them.

A client on any node of the cluster encodes a payload; munged signs it with the cluster's
``munge.key`` and the caller's uid and gid as the kernel reports them to munged. A server
decodes it: munged checks the signature, the time to live (300 s by default) and that the
credential was not decoded before (replay), and returns the payload and the uid. Nothing
here trusts what the client says about itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from dataclasses import dataclass

from raps_slurm.errors import RapsError

_LIB: ctypes.CDLL | None = None
_LOCK = threading.Lock()
EMUNGE_CRED_REPLAYED = 17  # munge.h: munge_err_t


class MungeError(RapsError):
    """MUNGE could not encode or refused to decode a credential (``code``: munge_err_t)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Credential:
    """What a decoded credential vouches for."""

    payload: bytes
    uid: int
    gid: int


def _lib() -> ctypes.CDLL:
    global _LIB
    with _LOCK:
        if _LIB is None:
            name = ctypes.util.find_library("munge") or "libmunge.so.2"
            try:
                lib = ctypes.CDLL(name)
            except OSError as exc:
                raise MungeError(f"cannot load libmunge ({name}): {exc} "
                                 "(apt-get install libmunge2 munge)") from None
            lib.munge_encode.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_int]
            lib.munge_encode.restype = ctypes.c_int
            lib.munge_decode.argtypes = [ctypes.c_char_p, ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(ctypes.c_int),
                                         ctypes.POINTER(ctypes.c_uint),
                                         ctypes.POINTER(ctypes.c_uint)]
            lib.munge_decode.restype = ctypes.c_int
            lib.munge_strerror.argtypes = [ctypes.c_int]
            lib.munge_strerror.restype = ctypes.c_char_p
            _LIB = lib
        return _LIB


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _error(lib: ctypes.CDLL, code: int, what: str) -> MungeError:
    text = lib.munge_strerror(code)
    return MungeError(f"{what}: {text.decode(errors='replace') if text else f'error {code}'}",
                      code)


def encode(payload: bytes) -> str:
    """A credential for ``payload`` from the local munged; MungeError if it is not running."""
    lib = _lib()
    cred = ctypes.c_char_p()
    code = lib.munge_encode(ctypes.byref(cred), None, payload, len(payload))
    if code != 0:
        raise _error(lib, code, "munge encode")
    try:
        return (cred.value or b"").decode("ascii")
    finally:
        _libc().free(cred)


def decode(cred: str) -> Credential:
    """The payload and the uid/gid a credential vouches for; MungeError when munged
    refuses it (bad or foreign signature, expired, replayed, malformed)."""
    try:
        raw = cred.encode("ascii")
    except UnicodeEncodeError:
        raise MungeError("munge decode: not a MUNGE credential (non-ASCII)") from None
    if not raw.startswith(b"MUNGE:") or b"\0" in raw:
        raise MungeError("munge decode: not a MUNGE credential")
    lib = _lib()
    buf, size = ctypes.c_void_p(), ctypes.c_int()
    uid, gid = ctypes.c_uint(), ctypes.c_uint()
    code = lib.munge_decode(raw, None, ctypes.byref(buf), ctypes.byref(size),
                            ctypes.byref(uid), ctypes.byref(gid))
    try:
        if code != 0:
            raise _error(lib, code, "munge decode")
        payload = ctypes.string_at(buf, size.value) if buf.value else b""
        return Credential(payload, uid.value, gid.value)
    finally:
        if buf.value:
            _libc().free(buf)
