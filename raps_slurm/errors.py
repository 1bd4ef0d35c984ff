"""One exception tree for raps-slurm; every error a user can meet is a RapsError."""

from __future__ import annotations


class RapsError(Exception):
    """Root of every error raps-slurm raises on purpose."""


class ConfigError(RapsError):
    """The configuration is invalid; ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


class ScenarioError(ConfigError):
    """A simulator scenario or job trace is invalid; one line per problem."""


class SlurmCommandError(RapsError):
    """A Slurm command failed, timed out, was missing, or printed what we cannot parse."""

    def __init__(self, argv: list[str], message: str, returncode: int | None = None,
                 stderr: str = "") -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.message = message
        detail = f" (exit {returncode})" if returncode is not None else ""
        tail = f": {stderr.strip()}" if stderr.strip() else ""
        super().__init__(f"{' '.join(argv)}{detail}: {message}{tail}")


class SlurmParseError(SlurmCommandError):
    """Slurm printed output the parser does not understand."""


class StoreError(RapsError):
    """A state-store operation failed."""


class StoreUnavailable(StoreError):
    """The state store cannot be reached (connection refused, timeout, cluster down)."""


class LeaseExpired(StoreError):
    """A lease was refreshed or used after it expired or was revoked."""


class StorePermissionDenied(StoreError):
    """The store refused an operation this identity has no right to (etcd RBAC role)."""


class HistoryCompacted(StoreError):
    """A watch asked for revisions the store's history no longer holds (compacted): watch
    again from the current revision, after reading what it needs."""


class RecordError(StoreError):
    """A value read from the store is malformed (names the key and the field)."""


class NotLeader(StoreError):
    """A leader-guarded write was refused: this coordinator is no longer the leader."""


class BadDatagram(RapsError):
    """A heartbeat or acknowledgement datagram that must be dropped; ``reason`` says why."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class PlacementError(RapsError):
    """Backup groups or spares cannot be computed from the given inputs."""


class ClusterError(RapsError):
    """The local test cluster could not be started, stopped or faulted."""


class BenchError(RapsError):
    """A benchmark could not measure what it set out to (a rank failed, a restore differs)."""


class Refused(RapsError):
    """A request at one of the daemons' doors (agent socket, coordinator user door) is
    answered with an error; ``kind`` names the category (counted, sent back)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
