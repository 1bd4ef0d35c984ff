"""Checkpoints through the real agents of the test cluster: a rank saves through its
node's agent socket (sealed memory files over SCM_RIGHTS), the agents replicate to the
rank's backup group over their transfer servers, and a rank relaunched on a node that
holds nothing restores from the holders."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from raps_slurm.checkpoint.chunkstore import ChunkStore
from raps_slurm.config import load_file, node_dir
from raps_slurm.core.checkpoints import CkptRecord
from raps_slurm.core.jobs import (
    JobRecord,
    JobSpec,
    RankEntry,
    RankMap,
    group_from_json,
    group_to_json,
)
from raps_slurm.model import BackupGroup
from raps_slurm.slurm import CommandRunner
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.ckpt_rank import make_state
from raps_slurm.testing.cluster import LocalCluster, wait_until


def setup_job(store: tuple[StateStore, Keys], node: str = "n1", epoch: int = 1) -> str:
    s, k = store
    job = str(700000 + uuid.uuid4().int % 100000)
    # registered with its nodes (restores take records naming only them), run by root
    s.put(k.job(job), JobRecord(job, 0, 0, ("n1", "n2", "n3", "n4"), JobSpec(spares=1))
          .to_json())
    s.put(k.job_map(job), RankMap(job, 0, (node,), ("n4",), 2, 0.0).to_json())
    s.put(k.job_rank(job, 0), RankEntry(0, node, epoch, "running", ("n4",)).to_json())
    s.put(k.job_group(job, 0), group_to_json(BackupGroup(0, node, "n2", ("n3",))))
    return job


def run_rank(cluster: LocalCluster, node: str, job: str, mode: str, *, epoch: int = 1,
             saves: int = 2, uid: int | None = None, killed_ok: bool = False
             ) -> tuple[int, list[dict[str, Any]]]:
    cfg = load_file(cluster.config_path)
    args = [sys.executable, "-m", "raps_slurm.testing.ckpt_rank", mode, "--socket",
            node_dir(cfg.agent.socket_path, node), "--job", job, "--epoch", str(epoch),
            "--saves", str(saves)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120,
                          user=uid, cwd="/")
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines or (killed_ok and proc.returncode == -signal.SIGKILL), \
        (proc.returncode, proc.stderr[-3000:])
    return proc.returncode, lines


def group_of(store: tuple[StateStore, Keys], job: str) -> BackupGroup:
    s, k = store
    kv = s.get(k.job_group(job, 0))
    assert kv is not None
    return group_from_json(kv.key, kv.value, 0)


def record(store: tuple[StateStore, Keys], job: str, gen: int) -> CkptRecord | None:
    s, k = store
    kv = s.get(k.ckpt(job, 0, gen))
    return None if kv is None else CkptRecord.from_json(kv.key, kv.value)


def test_save_replicate_and_restore_elsewhere(cluster: LocalCluster,
                                              store: tuple[StateStore, Keys]) -> None:
    job = setup_job(store)
    rc, saves = run_rank(cluster, "n1", job, "save", saves=3)
    assert rc == 0, saves
    assert [x["generation"] for x in saves] == [1, 2, 3]
    assert saves[1]["new_chunks"] < saves[0]["new_chunks"] / 4  # incremental
    rec = wait_until("generation 3 committed on three holders", lambda: record(store, job, 3),
                     lambda r: r is not None and r.state == "committed", 20)
    assert rec.holders == ("n1", "n2", "n3")
    # The rank moves to n4 with a new epoch (what recovery does) and restores there.
    s, k = store
    s.put(k.job_rank(job, 0), RankEntry(0, "n4", 2, "running", (), ((1, "n1"),)).to_json())
    rc, [out] = run_rank(cluster, "n4", job, "restore", epoch=2)
    assert rc == 0 and out["generation"] == 3 and out["identical"] and out["saves"] == 3
    rec = wait_until("n4 among the holders", lambda: record(store, job, 3),
                     lambda r: r is not None and "n4" in r.holders, 5)
    # The old copy on n1 is fenced, by whichever fence comes first: its commit is refused
    # and it exits EX_TEMPFAIL, or its agent, which checks its ranks' epochs every
    # lease/3, kills a superseded epoch (SIGKILL) before it gets there.
    rc, lines = run_rank(cluster, "n1", job, "save", epoch=1, saves=1, killed_ok=True)
    assert (rc == 75 and lines[-1]["kind"] == "epoch") or (rc == -signal.SIGKILL), (rc, lines)
    assert record(store, job, 4) is None


def test_partner_agent_down_then_back(cluster: LocalCluster,
                                      store: tuple[StateStore, Keys]) -> None:
    s, k = store
    job = setup_job(store)
    cluster.agent_stop("n3")
    try:
        wait_until("n3's registration to lapse", lambda: s.get(k.node("n3")), lambda v: v is None,
                   15)
        rc, _ = run_rank(cluster, "n1", job, "save", saves=1)
        assert rc == 0
        rec = wait_until("generation 1 on n1 and n2", lambda: record(store, job, 1),
                         lambda r: r is not None and r.holders == ("n1", "n2"), 20)
        assert rec.state == "under_replicated"
    finally:
        cluster.agent_start("n3")
    rec = wait_until("the repair pass to copy generation 1 to n3",
                     lambda: record(store, job, 1),
                     lambda r: r is not None and r.state == "committed", 30)
    assert rec.holders == ("n1", "n2", "n3")


def test_another_user_cannot_use_a_rank_it_did_not_register(
        cluster: LocalCluster, store: tuple[StateStore, Keys]) -> None:
    # The test suite runs as root (it starts Slurm); uid 65534 is the other user.
    job = setup_job(store)
    rc, _ = run_rank(cluster, "n1", job, "save", saves=1)
    assert rc == 0
    # uid 65534 cannot register a job it does not own, so it cannot save or restore.
    rc, lines = run_rank(cluster, "n1", job, "restore", uid=65534)
    assert rc == 1 and lines[-1]["kind"] in ("unknown_job", "permission"), lines


def test_dead_backup_is_replaced_and_rereplicated(
        cluster: LocalCluster, store: tuple[StateStore, Keys], rapsctl: Any,
        leading: Callable[[str], Any]) -> None:
    run = CommandRunner(timeout=60, env=cluster.env)
    with leading("ckpt"):
        out = run.run(["sbatch", "--parsable", "-o", "/dev/null", "--raps", "--raps-spares=1",
                       "--raps-replicas=2", "--no-kill", "-N4", "--wrap", "sleep 300"])
        job = out.strip().split(";")[0]
        try:
            data = wait_until(f"job {job} mapped", lambda: rapsctl.job(int(job)),
                              lambda d: d is not None and d["state"] == "mapped", 20)
            primary = data["ranks"][0]["node"]
            group = group_of(store, job)
            batch_host = cluster.slurm().job(int(job)).batch_host or primary
            victim = next(m for m in (*group.ckpt_mirrors, group.log_backup)
                          if m and m not in (primary, batch_host))
            rc, _ = run_rank(cluster, primary, job, "save", saves=1)
            assert rc == 0
            rec = wait_until("generation 1 on the whole group", lambda: record(store, job, 1),
                             lambda r: r is not None and r.state == "committed", 20)
            assert victim in rec.holders
            cluster.crash(victim)
            try:
                new = wait_until(
                    f"{victim} replaced in rank 0's group",
                    lambda: group_of(store, job),
                    lambda g: victim not in (g.log_backup, *g.ckpt_mirrors), 30)
                replacement = ({new.log_backup, *new.ckpt_mirrors} - {group.log_backup,
                                                                      *group.ckpt_mirrors})
                assert len(replacement) == 1 and victim not in replacement
                rec = wait_until("generation 1 copied to the replacement",
                                 lambda: record(store, job, 1),
                                 lambda r: r is not None and set(replacement) <= set(r.holders)
                                 and r.state == "committed", 30)
                assert victim not in rec.holders
            finally:
                cluster.restart(victim)
                run.run(["scontrol", "update", f"NodeName={victim}", "State=RESUME"])
        finally:
            run.run(["scancel", job])


def test_cli_show_verify_and_restore(cluster: LocalCluster, store: tuple[StateStore, Keys],
                                     rapsctl: Any, tmp_path: Path) -> None:
    job = setup_job(store)
    rc, _ = run_rank(cluster, "n1", job, "save", saves=2)
    assert rc == 0
    wait_until("generation 2 committed", lambda: record(store, job, 2),
               lambda r: r is not None and r.state == "committed", 20)
    rows = json.loads(rapsctl("show", "checkpoints", job, "--json").stdout)
    assert [(r["rank"], r["generation"], r["state"]) for r in rows] == \
        [(0, 1, "committed"), (0, 2, "committed")]
    assert rows[1]["holders"] == ["n1", "n2", "n3"]
    assert [r["attested"] for r in rows] == ["yes", "yes"], rows
    text = rapsctl("show", "checkpoints", job).stdout
    assert text.splitlines()[0].split()[:3] == ["rank", "generation", "epoch"]
    # A shared record rewritten by someone else (another manifest) is shown as such.
    s, keys = store
    kv = s.get(keys.ckpt(job, 0, 1))
    assert kv is not None
    real = CkptRecord.from_json(kv.key, kv.value)
    s.put(kv.key, replace(real, manifest_digest="0" * 64).to_json())
    rows = json.loads(rapsctl("show", "checkpoints", job, "--json").stdout)
    assert [r["attested"] for r in rows] == ["no (no matching commit)", "yes"], rows
    s.put(kv.key, real.to_json())
    ok = rapsctl("verify", job, "--json")
    assert ok.returncode == 0 and {r["result"] for r in json.loads(ok.stdout)} == {"ok"}
    # Damage, on n2 only, one chunk that generation 2 has and generation 1 has not.
    chunks = ChunkStore(cluster.run_dir / "ckpt" / "n2")
    m1, m2 = chunks.manifest(job, 0, 1), chunks.manifest(job, 0, 2)
    assert m1 is not None and m2 is not None
    victim = sorted(m2.digests() - m1.digests())[0]
    loc = chunks.location(job, victim)
    assert loc is not None
    with open(chunks.pack_path(job, loc), "r+b") as f:
        f.seek(loc.offset + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    bad = rapsctl("verify", job, "--rank", "0", "--json", check=False)
    assert bad.returncode == 1, bad.stderr
    results = {(r["generation"], r["holder"]): r for r in json.loads(bad.stdout)}
    assert results[(2, "n2")]["result"].startswith("BAD")
    assert [b["digest"] for b in results[(2, "n2")]["bad"]] == [victim]
    assert results[(2, "n1")]["result"] == "ok" and results[(1, "n2")]["result"] == "ok"
    out = tmp_path / "state.bin"
    done = rapsctl("restore", job, "--rank", "0", "--out", str(out))
    assert "from generation 2" in done.stdout
    want = make_state(1, 2, 8 << 20)
    assert out.read_bytes() == want["field"].tobytes() + want["step"].tobytes()
    missing = rapsctl("show", "checkpoints", "123456789", check=False)
    assert missing.returncode == 1 and "no committed checkpoint" in missing.stderr
    assert "expected a numeric Slurm job id" in rapsctl("verify", "abc", check=False).stderr
