"""The coordinator's user door: request parsing, the credential bound to its request, and
the owner rule, on the memory store with a stand-in for munged (the door is under test,
not MUNGE; tests/integration/test_trust.py runs it with the real munged)."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator

import pytest

from raps_slurm.coordinator.userdoor import Refused, UserDoor, parse_request, request_digest
from raps_slurm.core.jobs import JobRecord, JobSpec
from raps_slurm.munge import Credential, MungeError
from raps_slurm.store import Keys, MemoryStore

ALICE, BOB = 1001, 1002


def body(op: str = "job", job: str = "7", cred: str = "MUNGE:x", **extra: object) -> bytes:
    return json.dumps({"op": op, "job": job, "cred": cred, **extra}).encode()


@pytest.mark.parametrize("raw, kind", [
    (b"\xff\xfe", "json"), (b"{nope", "json"), (b"[1]", "schema"),
    (body(op="drain"), "unknown_op"), (body(job="7; rm"), "schema"), (body(job="1" * 21), "schema"),
    (body(cred="secret"), "schema"), (body(extra=1), "schema"),
])
def test_malformed_requests_are_refused_by_kind(raw: bytes, kind: str) -> None:
    with pytest.raises(Refused) as exc:
        parse_request(raw)
    assert exc.value.kind == kind


def test_a_well_formed_request_parses() -> None:
    assert parse_request(body(op="recoveries", job="12")) == ("recoveries", "12", "MUNGE:x")


@pytest.fixture
def door() -> Iterator[tuple[UserDoor, dict[str, Credential]]]:
    store = MemoryStore()
    keys = Keys()
    store.put(keys.job("7"), JobRecord("7", 0, ALICE, ("n1", "n2"), JobSpec()).to_json())
    creds: dict[str, Credential] = {}

    def decode(cred: str) -> Credential:
        if cred not in creds:
            raise MungeError("munge decode: Invalid credential", 8)
        return creds.pop(cred)  # once, as munged

    d = UserDoor(store, keys, ("127.0.0.1", 0), decode)
    yield d, creds
    d.stop()
    store.close()


def ask(door: tuple[UserDoor, dict[str, Credential]], uid: int, op: str = "job",
        job: str = "7", payload: bytes | None = None) -> dict[str, object]:
    d, creds = door
    cred = f"MUNGE:{len(creds)}-{uid}-{op}-{job}"
    creds[cred] = Credential(request_digest(op, job) if payload is None else payload, uid, uid)
    return d.answer(body(op, job, cred))


def refused(door: tuple[UserDoor, dict[str, Credential]], *args: object, **kw: object) -> Refused:
    with pytest.raises(Refused) as exc:
        ask(door, *args, **kw)  # type: ignore[arg-type]
    return exc.value


def test_the_owner_and_root_are_served_others_refused(
        door: tuple[UserDoor, dict[str, Credential]]) -> None:
    got = ask(door, ALICE)
    assert got["ok"] is True and got["result"]["job_id"] == "7"  # type: ignore[index]
    assert ask(door, 0)["ok"] is True
    assert ask(door, ALICE, "recoveries")["result"] == []
    exc = refused(door, BOB)
    assert exc.kind == "permission"
    assert str(exc) == f"permission denied: job 7 belongs to uid {ALICE}, you are uid {BOB}"
    assert refused(door, ALICE, job="8").kind == "unknown_job"
    assert door[0].counts == {"served": 3}  # answer() alone counts only what it served


def test_a_credential_answers_only_its_own_request(
        door: tuple[UserDoor, dict[str, Credential]]) -> None:
    exc = refused(door, ALICE, payload=request_digest("job", "8"))
    assert exc.kind == "credential" and "another request" in str(exc)
    with pytest.raises(Refused) as bad:
        door[0].answer(body(cred="MUNGE:forged"))
    assert bad.value.kind == "credential" and "Invalid credential" in str(bad.value)


def test_the_socket_side_counts_every_refusal(
        door: tuple[UserDoor, dict[str, Credential]]) -> None:
    d, _ = door
    d.start()

    def send(raw: bytes) -> dict[str, object]:
        with socket.create_connection(d.address, timeout=5) as conn:
            conn.sendall(raw)
            conn.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
        (n,) = struct.unpack(">I", data[:4])
        reply: dict[str, object] = json.loads(data[4:4 + n])
        return reply

    assert send(struct.pack(">I", 1 << 20))["kind"] == "size"
    assert send(struct.pack(">I", 100) + b"short")["kind"] == "truncated"
    assert send(struct.pack(">I", 3) + b"[1]")["kind"] == "schema"
    raw = body(cred="MUNGE:nobody")
    assert send(struct.pack(">I", len(raw)) + raw)["kind"] == "credential"
    assert d.counts == {"size": 1, "truncated": 1, "schema": 1, "credential": 1}


@pytest.mark.parametrize("cred", ["nope", "MUNGE:\x00x", "MUNGE:é"])
def test_what_is_not_a_munge_credential_never_reaches_libmunge(cred: str) -> None:
    from raps_slurm.munge import decode
    with pytest.raises(MungeError, match="not a MUNGE credential"):
        decode(cred)
