"""What the kernel says about a local process: its uid, its start time, a socket peer."""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

_UCRED = struct.Struct("iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid


@dataclass(frozen=True)
class Peer:
    """The connecting process as the kernel saw it at connect time."""

    pid: int
    uid: int
    gid: int


def process_uid(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> int | None:
    """Real uid of process ``pid`` from ``<proc_root>/<pid>/status``; None if unknown."""
    try:
        with open(Path(proc_root) / str(pid) / "status", "rb") as f:
            text = f.read(65536).decode("utf-8", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isascii() and fields[1].isdigit():
                return int(fields[1])
            return None
    return None


def process_start(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> int | None:
    """Start time of ``pid`` (clock ticks since boot, /proc/<pid>/stat field 22); None if gone.

    Together with the pid it names one process: a pid reused after the rank exited has
    another start time, so the agent never kills a stranger.
    """
    try:
        with open(Path(proc_root) / str(pid) / "stat", "rb") as f:
            text = f.read(4096).decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])


def peer_credentials(sock: socket.socket) -> Peer:
    """The peer's pid, uid and gid from SO_PEERCRED."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return Peer(*_UCRED.unpack(data))
