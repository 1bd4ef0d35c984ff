"""A second uid attacks another user's running job from outside it: it fills the file
system a node's checkpoint dir shares and holds the connection slots of raps-run's
control listener (and of the ranks' listeners).

For the run of the test, n1's checkpoint dir lives on a small ext4 file system of its
own (mkfs's 5 % reserved for root), whose mount point every user may write, as ``/tmp``
on a node whose checkpoint dir shares it. bob fills it (``raps_slurm.testing.attacks
fill``) before alice's job starts, and keeps connections to every port alice listens on
from three addresses (``attacks hold``): more than the listener's 32 handshake slots.
alice's job (one rank on each of n1..n3) finishes with its failure-free result; its rank
on n1 commits checkpoints into root's reserved room; n1's health samples measure that
file system and judge only RAPS's data against root's room, so the node is neither
degraded (no longer a recovery target) nor drained; raps-run says what its control
listener refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from raps_slurm.config import load_file, node_dir
from raps_slurm.core.health import HealthSettings
from raps_slurm.store import Keys, StateStore
from raps_slurm.testing.attacks import listening_ports
from raps_slurm.testing.cluster import LocalCluster, wait_until
from raps_slurm.testing.jobs import (
    HEAT_RING,
    committed,
    finish,
    heat_reference,
    processes,
    wait_mapped,
)
from tests.integration.test_two_users import NODES, users  # noqa: F401

VICTIM_ARGS = ("--steps", "300", "--every", "25", "--step-sec", "0.05")
FS_MB = 32  # the file system n1's checkpoint dir shares
HOLD = 48  # connections bob keeps to each of alice's listeners, over...
SOURCES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")  # ... 16 from each: every slot


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


@contextmanager
def ckpt_on_shared_fs(ckpt: Path, top: Path, image: Path) -> Iterator[Path]:
    """``ckpt`` (a node's checkpoint dir, what is not a job's copied along) on an ext4
    file system of its own mounted at ``top``, whose root every user may write; yields
    ``top``. The mounts go when the block ends."""
    with open(image, "wb") as f:
        f.truncate(FS_MB << 20)
    _run("mkfs.ext4", "-q", "-m", "5", str(image))
    top.mkdir()
    _run("mount", "-o", "loop", str(image), str(top))
    bound = False
    try:
        top.chmod(0o1777)
        inner = top / "ckpt"
        inner.mkdir(mode=0o700)  # as the agent makes it
        ckpt.mkdir(mode=0o700, parents=True, exist_ok=True)
        for entry in ckpt.iterdir():
            if not entry.name.startswith("job-"):
                if entry.is_dir():
                    shutil.copytree(entry, inner / entry.name, symlinks=True)
                else:
                    shutil.copy2(entry, inner / entry.name, follow_symlinks=False)
        _run("mount", "--bind", str(inner), str(ckpt))
        bound = True
        yield top
    finally:
        # lazily: the agent may still hold a file of the job open
        if bound:
            _run("umount", "-l", str(ckpt))
        _run("umount", "-l", str(top))
        top.rmdir()
        image.unlink()


def _point_at_control(job: str, only: Path) -> None:
    """Write the port raps-run's control listener of ``job`` takes into ``only``, as soon
    as it listens (within 60 s): bob's target (any scan of alice's ports would find it;
    srun's own ports are left alone, Slurm's srun stalls its I/O on a stranger's idle
    connection)."""
    want = f"SLURM_JOB_ID={job}".encode()

    def ports() -> set[int]:
        for pid, env, cmd in processes():
            if want in env and b"raps-run" in cmd and not cmd.startswith(b"srun"):
                with contextlib.suppress(OSError):
                    return listening_ports(pid)
        return set()

    found = wait_until(f"job {job}'s raps-run listening", ports, bool, 60, interval=0.005)
    tmp = only.with_suffix(".tmp")
    tmp.write_text("".join(f"{p}\n" for p in found))
    tmp.chmod(0o644)
    tmp.rename(only)


def _attack(*argv: str) -> list[str]:
    return [sys.executable, "-m", "raps_slurm.testing.attacks", *argv]


def test_a_full_shared_file_system_and_held_control_slots_do_not_stop_a_job(
        cluster: LocalCluster, store: tuple[StateStore, Keys],
        users: tuple[int, int],  # noqa: F811 (the fixture)
        leading: Callable[..., Any], tmp_path: Path) -> None:
    alice, bob = users
    s, k = store
    cfg = load_file(cluster.config_path)
    full = HealthSettings.from_config(cfg.detection).disk_full_percent
    clean = heat_reference(tmp_path, len(NODES), VICTIM_ARGS)
    ckpt = Path(node_dir(cfg.checkpoint.local_dir, "n1"))
    top = cluster.run_dir / f"shared-fs-{os.getpid()}"
    only = cluster.run_dir / "jobs" / f"control-port-{os.getpid()}"
    holder = subprocess.Popen(_attack("hold", str(alice), str(HOLD), ",".join(SOURCES),
                                      "--only", str(only)),
                              user=bob, cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        with ckpt_on_shared_fs(ckpt, top, tmp_path / "fs.img"):
            fill = subprocess.run(_attack("fill", str(top)), user=bob, cwd="/",
                                  capture_output=True, text=True, timeout=60, check=False)
            assert fill.returncode == 0, fill.stderr[-3000:]
            filled_at = time.time()
            room = os.statvfs(top)
            assert room.f_bavail == 0, "bob could not fill the file system"
            job, out = cluster.submit_raps_run(
                [sys.executable, str(HEAT_RING), *VICTIM_ARGS],
                [f"--uid={alice}", "--raps-spares=0", f"-N{len(NODES)}", "-w",
                 ",".join(NODES)], "victim-job")
            _point_at_control(job, only)
            # no coordinator leads yet, so raps-run waits for its rank map and starts no
            # supervisor until bob has filled its listener's slots (its own 33rd
            # connection evicts his oldest); found otherwise, on a busy machine, the
            # supervisors could connect first and the slots would not be tested
            wait_until("raps-run evicting one of bob's connections",
                       lambda: out.read_text() if out.exists() else "",
                       lambda t: "control: refused a connection (" in t, 60)
            with leading("c-attack-job"):
                view = wait_mapped(s, k, job)
                [on_n1] = [r["rank"] for r in view["ranks"] if r["node"] == "n1"]
                # the rank on n1 commits checkpoints (into root's reserved room) ...
                wait_until(f"rank {on_n1} commits a checkpoint",
                           lambda: committed(s, k, job, on_n1), bool, 60)
                since = time.time()
                # ... and n1's agent measures them on that file system, judging RAPS's data
                # against root's room: below the threshold, while users have no room left
                sample = wait_until(
                    "a health sample of n1 measuring the full file system with RAPS's data",
                    lambda: json.loads(s.get(k.node_health("n1")).value),  # type: ignore[union-attr]
                    lambda d: d.get("at", 0) > since and (d.get("disk_raps_bytes") or 0) > 0
                    and d.get("disk_total_bytes") == room.f_blocks * room.f_frsize, 30)
                assert (sample["disk_used_percent"] or 100.0) < full, sample
                text = finish(cluster, job, out, clean)
            assert os.statvfs(top).f_bavail == 0
        verdict = s.get(k.node_health_verdict("n1"))
        if verdict is not None:
            record = json.loads(verdict.value)
            assert record["at"] < filled_at or record["level"] == "OK", record
        state = cluster.slurm().node("n1").state_text
        assert "DRAIN" not in state, state
    finally:
        try:
            held, err = holder.communicate("stop\n", timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
            held, err = holder.communicate()
    assert holder.returncode == 0, err[-3000:]
    attack = json.loads(held.splitlines()[-1])
    # raps-run's control listener, held past its slots
    assert attack["ports"] == 1 and attack["opened"] >= HOLD, attack
    lines = text.splitlines()
    refused = [i for i, x in enumerate(lines) if "control: refused a connection (" in x]
    assert any("(evicted" in lines[i] or "(source" in lines[i] for i in refused), text[-3000:]
    # bob held every slot before the supervisors came: a slot was taken from him first
    connected = [i for i, x in enumerate(lines) if "supervisor on" in x and "connected" in x]
    assert len(connected) == len(NODES) and refused[0] < connected[-1], text[-3000:]
    s.delete_prefix(k.job(job))
