"""libraps's wire format, read by the project's own parsers: a stand-in agent on a unix
socket takes the C test rank's packs (raps_slurm.checkpoint.pack.iter_records, each chunk
decoded and checked against its blake3 name) and manifests (Manifest.from_json, which
checks the whole digest), and serves them back for the restore, an older generation by
its label too. A relaunched rank's recovery reports, the done of raps_finalize, refusals,
a missing agent and a bad environment (RAPS_EPOCHS among it) are checked against what
the stand-in received. The agent itself is tested
with libraps in tests/integration/test_libraps_agent.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import socketserver
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raps_slurm.checkpoint.codec import SHUF, Decoder, hasher
from raps_slurm.checkpoint.manifest import MAX_MANIFEST, Manifest
from raps_slurm.checkpoint.pack import is_sealed, iter_records, sealed_bytes
from raps_slurm.runtime.agent_client import encode_frame, recv_exact

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "libraps"


@pytest.fixture(autouse=True)
def _compiler() -> None:
    # scripts/test.sh installs gcc and make: where CI runs, a missing one is a failure
    assert shutil.which("cc") is not None, "no C compiler: run scripts/test.sh"
    assert (LIB / "Makefile").exists(), f"{LIB}/Makefile is missing"


class StandIn:
    """Answers the local API's ops as the agent does, keeping chunks in memory."""

    def __init__(self, path: str, refuse: dict[str, str] | None = None,
                 resume_step: int | None = None) -> None:
        self.refuse = refuse or {}
        self.resume_step = resume_step
        self.chunks: dict[str, bytes] = {}
        self.puts: list[list[tuple[str, int]]] = []  # (digest, codec) of each pack
        self.manifests: list[Manifest] = []
        self.ops: list[str] = []
        self.requests: list[dict[str, Any]] = []
        stand_in = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                stand_in.serve(self.request)

        self.server = socketserver.ThreadingUnixStreamServer(path, Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        """One connection: requests and replies until the client closes it."""
        while True:
            try:
                head, fds, _, _ = socket.recv_fds(conn, 4, 4)
                if not head:
                    return
                body = recv_exact(conn, int.from_bytes(head, "big"))
            except OSError:
                return
            request = json.loads(body)
            reply, out = self._answer(request, fds)
            for fd in fds:
                os.close(fd)
            if out:
                socket.send_fds(conn, [encode_frame(reply)], out)
            else:
                conn.sendall(encode_frame(reply))
            for fd in out:
                os.close(fd)

    def _answer(self, req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        op = req["op"]
        self.ops.append(op)
        self.requests.append(req)
        if op in self.refuse:
            return {"ok": False, "kind": self.refuse[op], "error": f"{op}: no, {op}"}, []
        if op in ("register", "heartbeat"):
            return {"ok": True, "valid_for": 30.0, "epoch": 1}, []
        if op == "ckpt_begin":
            return {"ok": True, "session": "a" * 32, "base_ok": req["base"] is not None,
                    "params": {"avg_chunk_kb": 64, "digest": "blake3", "zstd_level": 1,
                               "shuffle": True}}, []
        if op == "ckpt_put":
            assert len(fds) == 1 and is_sealed(fds[0])
            seen = []
            for e in iter_records(fds[0]):
                raw = Decoder().decode(e.payload, e.raw_size)
                assert hasher("blake3")(raw).hex() == e.digest
                self.chunks[e.digest] = raw
                seen.append((e.digest, e.payload[0]))
            self.puts.append(seen)
            return {"ok": True, "chunks": len(seen), "bytes": 0}, []
        if op == "ckpt_commit":
            assert len(fds) == 1 and is_sealed(fds[0])
            m = Manifest.from_json("manifest from libraps", os.pread(fds[0], MAX_MANIFEST, 0))
            assert m.digests() <= set(self.chunks), "a chunk named but never sent"
            self.manifests.append(m.with_generation(len(self.manifests) + 1))
            return {"ok": True, "generation": len(self.manifests), "state": "committed",
                    "holders": ["n1"], "epoch": 1}, []
        if op == "ckpt_restore":
            m = self.manifests[req.get("generation", len(self.manifests)) - 1]
            data = b"".join(self.chunks[d] for d, _ in m.chunks)
            return {"ok": True, "generation": m.generation, "fallbacks": [],
                    "size": len(data), "resume_step": self.resume_step}, \
                [sealed_bytes(data), sealed_bytes(m.to_json())]
        if op == "ckpt_generations":
            return {"ok": True, "more": False, "resume_step": self.resume_step,
                    "generations": [{"generation": m.generation,
                                     "label": m.extra["libraps"]["version"]}
                                    for m in reversed(self.manifests)]}, []
        return {"ok": True}, []

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def check(tmp_path_factory: pytest.TempPathFactory) -> Path:
    subprocess.run(["make", "-s", "-C", str(LIB), "libraps.so"], check=True,
                   capture_output=True, timeout=180)
    out = tmp_path_factory.mktemp("libraps") / "check"
    subprocess.run(["cc", "-O2", "-I", str(LIB), "-o", str(out), str(LIB / "tests/check.c"),
                    "-L", str(LIB), f"-Wl,-rpath,{LIB}", "-lraps"], check=True,
                   capture_output=True, timeout=120)
    return out


@pytest.fixture
def sock(tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path / "agent.sock")


def run(check: Path, env: dict[str, str], *args: str) -> tuple[int, list[dict[str, Any]]]:
    proc = subprocess.run([str(check), *args], env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, [json.loads(x) for x in proc.stdout.splitlines()
                             if x.startswith("{")]


def rank_env(sock: str) -> dict[str, str]:
    return {"RAPS_AGENT_SOCKET": sock, "RAPS_JOB": "42", "RAPS_RANK": "0"}


def test_saves_are_packs_and_manifests_the_agent_reads(check: Path, sock: str) -> None:
    agent = StandIn(sock)
    try:
        rc, lines = run(check, rank_env(sock))
    finally:
        agent.close()
    assert rc == 0, lines
    assert lines[-2] == {"version": 2, "restored": 2, "same": True}, lines
    first, second = agent.manifests
    assert [i.name for i in first.items] == ["raps.c", "r1", "r2"], first.items
    assert first.total_size == second.total_size > 3 << 20
    # the doubles went shuffled; the second save sent only the chunks that changed
    assert any(codec == SHUF for _, codec in agent.puts[0])
    sent_second = {d for pack in agent.puts[1:] for d, _ in pack}
    assert 0 < len(sent_second) < len(second.chunks) // 2, (len(sent_second),
                                                              len(second.chunks))
    assert sent_second == second.digests() - first.digests()
    assert agent.ops[0] == "register" and agent.ops[-1] == "unregister", agent.ops


def test_refusals_carry_the_agent_kind(check: Path, sock: str) -> None:
    agent = StandIn(sock, refuse={"ckpt_commit": "quota"})
    try:
        rc, lines = run(check, rank_env(sock))
    finally:
        agent.close()
    assert rc == 1, lines
    assert lines[-1]["call"] == "checkpoint" and lines[-1]["rc"] == 7, lines
    assert lines[-1]["kind"] == "quota" and "ckpt_commit: no" in lines[-1]["error"], lines


@pytest.mark.parametrize(("env", "code", "named"), [
    ({"RAPS_JOB": "42", "RAPS_RANK": "0"}, 2, "RAPS_AGENT_SOCKET"),
    ({"RAPS_AGENT_SOCKET": "/x", "RAPS_JOB": "42", "RAPS_RANK": "one"}, 2, "RAPS_RANK"),
    ({"RAPS_AGENT_SOCKET": "/x", "RAPS_RANK": "0"}, 2, "SLURM_JOB_ID"),
    ({"RAPS_AGENT_SOCKET": "/x", "RAPS_JOB": "4x2", "RAPS_RANK": "0"}, 1, "4x2"),
    ({"RAPS_AGENT_SOCKET": "/nonexistent/agent.sock", "RAPS_JOB": "42", "RAPS_RANK": "0"},
     3, "/nonexistent/agent.sock"),
])
def test_bad_environment_and_no_agent(check: Path, env: dict[str, str], code: int,
                                      named: str) -> None:
    rc, lines = run(check, env, "init")
    assert rc == 1 and lines[0]["rc"] == code and named in lines[0]["error"], lines


@pytest.mark.parametrize(("rank", "epochs", "want"), [
    ("3", "3=2,7=4", 2), ("7", "3=2,7=4", 4), ("5", "3=2,7=4", 1), ("0", "0=9", 9),
])
def test_epochs_give_listed_ranks_their_own_epoch(check: Path, sock: str, rank: str,
                                                  epochs: str, want: int) -> None:
    agent = StandIn(sock)
    try:
        rc, lines = run(check, {**rank_env(sock), "RAPS_RANK": rank, "RAPS_EPOCH": "1",
                                "RAPS_EPOCHS": epochs}, "init")
    finally:
        agent.close()
    assert rc == 0, lines
    registers = [r for r in agent.requests if r["op"] == "register"]
    assert [(r["rank"], r["epoch"]) for r in registers] == [(int(rank), want)], registers


@pytest.mark.parametrize("epochs", ["3=", "=2", "3=0", "3=2,", "3=2;7=4", "3=2, 7=4",
                                    "-1=2", "3=+2", "0=2,0=3", "3=2x"])
def test_malformed_epochs_are_refused(check: Path, sock: str, epochs: str) -> None:
    agent = StandIn(sock)
    try:
        rc, lines = run(check, {**rank_env(sock), "RAPS_EPOCHS": epochs}, "init")
    finally:
        agent.close()
    assert rc == 1 and lines[0]["rc"] == 2, lines
    assert "RAPS_EPOCHS" in lines[0]["error"] and "RANK=EPOCH" in lines[0]["error"], lines
    assert "register" not in agent.ops, agent.ops


@pytest.mark.parametrize(("epoch", "resume", "events"), [
    # relaunched: running at the first progress, caught up at the step before the fault
    ("2", 3, [("running", 0), ("caught_up", 3)]),
    ("2", None, [("running", 0), ("caught_up", 0)]),  # the plan has no progress
    ("1", 3, []),  # never relaunched: nothing to report
])
def test_an_older_generation_by_label_and_the_recovery_reports(
        check: Path, sock: str, epoch: str, resume: int | None,
        events: list[tuple[str, int]]) -> None:
    agent = StandIn(sock, resume_step=resume)
    try:
        rc, lines = run(check, {**rank_env(sock), "RAPS_EPOCH": epoch}, "older")
    finally:
        agent.close()
    assert rc == 0, lines
    assert {"labels": [2, 1], "same": True} in lines, lines
    restores = [r for r in agent.requests if r["op"] == "ckpt_restore"]
    assert [r.get("generation") for r in restores] == [1], restores
    sent = [(r["phase"], r["detail"]["step"]) for r in agent.requests
            if r["op"] == "recovery_event"]
    assert sent == events and all(r["epoch"] == int(epoch) for r in agent.requests
                                  if r["op"] == "recovery_event"), agent.requests
    # finalize: done, with no address (the rank serves no messages), then unregister
    assert agent.ops[-2:] == ["peer_publish", "unregister"], agent.ops
    assert {k: v for k, v in agent.requests[-2].items() if k != "job"} == {
        "op": "peer_publish", "rank": 0, "epoch": int(epoch), "host": None, "port": None,
        "done": True}, agent.requests[-2]


def test_refused_recovery_reports_do_not_fail_the_rank(check: Path, sock: str) -> None:
    agent = StandIn(sock, refuse={"recovery_event": "schema", "peer_publish": "quota"},
                    resume_step=2)
    try:
        rc, lines = run(check, {**rank_env(sock), "RAPS_EPOCH": "2"}, "older")
    finally:
        agent.close()
    assert rc == 0 and all(x["rc"] == 0 for x in lines if "rc" in x), lines
    assert agent.ops.count("recovery_event") == 2, agent.ops  # each phase tried once
    assert agent.ops[-1] == "unregister", agent.ops

