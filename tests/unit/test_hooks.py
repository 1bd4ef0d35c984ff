"""The Slurm hook wrappers run Python isolated (``-I``): nothing a user leaves in the
environment or the current directory is imported by a hook running as root or
SlurmUser; the hook log is never opened through a symlink or anything but a file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from raps_slurm.hooks.run import open_log

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hooks(tmp_path: Path) -> Path:
    """The four wrappers, written by scripts/install-hooks.sh for this interpreter."""
    dest = tmp_path / "hooks"
    cfg = tmp_path / "raps.yaml"
    (tmp_path / "log").mkdir()
    cfg.write_text(f"checkpoint:\n  local_dir: {tmp_path}/ckpt/%n\n"
                   f"hooks:\n  log_dir: {tmp_path}/log\n")
    done = subprocess.run(["bash", str(REPO / "scripts/install-hooks.sh"), "--python",
                           sys.executable, "--config", str(cfg), str(dest)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return dest


def run(hook: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(hook)], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})


def test_wrappers_exec_python_isolated(hooks: Path) -> None:
    for hook in ("prolog-slurmctld", "epilog-slurmctld", "prolog", "epilog"):
        assert f"' -I -m raps_slurm.hooks {hook} --config '" in (hooks / hook).read_text()


def test_a_users_python_path_and_directory_are_not_imported(hooks: Path, tmp_path: Path
                                                            ) -> None:
    # A job's user controls its environment and working directory: a raps_slurm (or a
    # module any import pulls in) planted there must never run as root.
    trap = tmp_path / "trap"
    marker = tmp_path / "trapped"
    for name in ("raps_slurm", "yaml"):
        (trap / name).mkdir(parents=True)
        (trap / name / "__init__.py").write_text(
            f"open({str(marker)!r}, 'a').write({name!r})\n")
    env = {"PYTHONPATH": str(trap), "PYTHONSTARTUP": str(trap / "raps_slurm/__init__.py"),
           "SPANK_RAPS_ENABLED": "1", "SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "77"}
    done = run(hooks / "prolog", trap, **env)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    # and the real package did its work, imports and all
    job_dir = tmp_path / "ckpt/n1/job-77"
    assert job_dir.is_dir() and stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    log = tmp_path / "log/prolog.log"
    assert "checkpoint dir" in log.read_text()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


def test_a_planted_symlink_log_is_refused(hooks: Path, tmp_path: Path) -> None:
    target = tmp_path / "etc-shadow"
    (tmp_path / "log/prolog.log").symlink_to(target)
    done = run(hooks / "prolog", tmp_path, SPANK_RAPS_ENABLED="1", SLURMD_NODENAME="n1",
               SLURM_JOB_ID="78")
    assert done.returncode == 0  # a node hook never fails the job
    assert f"refusing hook log {tmp_path}/log/prolog.log: it is a symbolic link " \
           "(opened with O_NOFOLLOW; remove it); logging to stderr" in done.stderr
    assert "checkpoint dir" in done.stderr  # the hook still ran, its lines on stderr
    assert not target.exists()


def test_open_log_appends_to_a_file_only(tmp_path: Path) -> None:
    path = tmp_path / "hook.log"
    for line in ("one\n", "two\n"):
        with open_log(path) as f:
            f.write(line)
    assert path.read_text() == "one\ntwo\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    link = tmp_path / "link.log"
    link.symlink_to(path)
    with pytest.raises(OSError, match="it is a symbolic link"):
        open_log(link)
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="cannot open hook log"):  # no reader: refused at once
        open_log(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(OSError, match="not a regular file"):
            open_log(fifo)
    finally:
        os.close(reader)
    assert path.read_text() == "one\ntwo\n"
