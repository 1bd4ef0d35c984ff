"""scripts/install.sh into staging roots: what each role puts where, with which mode, that a
second run changes nothing, and that bad arguments get one line and exit 2.

Real runs of the script (it builds spank/ with make and runs the package's own config
check and key tools); only the root is a temporary directory. The local-cluster test
(tests/integration/test_install.py) runs jobs through what it installs."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install.sh"
LIB = "usr/local/lib/raps"
HOOKS = ("prolog-slurmctld", "epilog-slurmctld", "prolog", "epilog")



@pytest.fixture(autouse=True)
def _build_tools() -> None:
    # scripts/test.sh installs them: missing fails, never skips
    assert shutil.which("make") and shutil.which("gcc") and Path(
        "/usr/include/slurm/spank.h").exists(), \
        "building spank/ needs make, gcc and libslurm-dev: run scripts/test.sh"


def install(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), "--root", str(root),
                           "--python", sys.executable, *args],
                          capture_output=True, text=True, check=False, timeout=120)


def tree(root: Path) -> dict[str, tuple[str, int, str]]:
    """path -> (kind, mode, sha256 or link target) of everything under root."""
    out: dict[str, tuple[str, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", 0, os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), "")
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode),
                            hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    root = tmp_path_factory.mktemp("controller")
    first = install(root, "--role", "controller")
    assert first.returncode == 0, first.stderr
    second = install(root, "--role", "controller")
    assert second.returncode == 0, second.stderr
    return root, first.stdout, second.stdout


def test_controller_installs_each_piece_with_its_mode(controller: tuple[Path, str, str]) -> None:
    root, first, _ = controller
    t = tree(root)
    assert t["etc/raps/raps.yaml"][:2] == ("file", 0o644)
    assert t["etc/raps/raps.yaml"][2] == hashlib.sha256(
        (REPO / "configs/raps.yaml").read_bytes()).hexdigest()
    assert t["etc/raps/raps.key"][:2] == ("file", 0o600)         # created: rapsctl config create-key
    assert (root / "etc/raps/raps.key").stat().st_size >= 32
    assert t[f"{LIB}/raps_spank.so"][:2] == ("file", 0o644)
    assert t[f"{LIB}/raps_spank.so"][2] == hashlib.sha256(
        (REPO / "spank/raps_spank.so").read_bytes()).hexdigest()
    for hook in HOOKS:
        assert t[f"{LIB}/{hook}"][:2] == ("file", 0o755)
        text = (root / LIB / hook).read_text()
        # The wrapper names final paths, never the staging root.
        assert f"-m raps_slurm.hooks {hook} --config '/etc/raps/raps.yaml'" in text
        assert str(root) not in text
    unit = (root / "etc/systemd/system/raps-coordinator.service").read_text()
    assert "Environment=RAPS_CONFIG=/etc/raps/raps.yaml" in unit
    assert f"ExecStart={Path(sys.executable).parent}/raps-coordinator --config" in unit
    assert not (root / "etc/systemd/system/raps-agent.service").exists()
    snippet = (root / "etc/slurm/plugstack.conf.d/raps.conf").read_text().splitlines()
    assert snippet[-1] == ("required /usr/local/lib/raps/raps_spank.so "
                           "agent_socket=/run/raps/%n/agent.sock coordinator=127.0.0.1:7470")
    assert (root / "etc/slurm/plugstack.conf").read_text() == \
        "include /etc/slurm/plugstack.conf.d/*.conf\n"
    conf = (root / "etc/slurm/slurm.conf.d/raps.conf").read_text()
    assert "PrologSlurmctld=/usr/local/lib/raps/prolog-slurmctld" in conf
    assert os.readlink(root / "usr/local/bin/rapsctl") == f"{Path(sys.executable).parent}/rapsctl"
    assert "controller: " in first and "changed under" in first


def test_second_run_changes_nothing(controller: tuple[Path, str, str]) -> None:
    root, _, second = controller
    before = tree(root)
    third = install(root, "--role", "controller")
    assert third.returncode == 0, third.stderr
    assert second.strip() == third.stdout.strip() == f"install.sh: controller: nothing changed under {root}"
    assert tree(root) == before


def test_a_changed_file_is_put_back_and_reported(controller: tuple[Path, str, str]) -> None:
    root, _, _ = controller
    hook = root / LIB / "prolog"
    good = hook.read_bytes()
    hook.write_text("#!/bin/sh\nexit 0\n")
    (root / "etc/raps/raps.key").chmod(0o644)
    out = install(root, "--role", "controller")
    assert out.returncode == 0, out.stderr
    assert "install.sh: updated /usr/local/lib/raps/prolog" in out.stdout.splitlines()
    assert "install.sh: mode 600: /etc/raps/raps.key" in out.stdout.splitlines()
    assert "controller: 2 changed" in out.stdout
    assert hook.read_bytes() == good and stat.S_IMODE(hook.stat().st_mode) == 0o755


def test_compute_needs_the_controllers_key_and_writes_nothing_without_it(
        tmp_path: Path, controller: tuple[Path, str, str]) -> None:
    root = tmp_path / "n1"
    root.mkdir()
    out = install(root, "--role", "compute")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "pass --key FILE" in out.stderr
    assert list(root.iterdir()) == []
    key = controller[0] / "etc/raps/raps.key"
    first = install(root, "--role", "compute", "--key", str(key))
    assert first.returncode == 0, first.stderr
    t = tree(root)
    assert t["etc/raps/raps.key"] == tree(controller[0])["etc/raps/raps.key"]
    assert t["var/lib/raps/ckpt"] == ("dir", 0o700, "")
    unit = (root / "etc/systemd/system/raps-agent.service").read_text()
    assert f"ExecStart={Path(sys.executable).parent}/raps-agent --node ${{RAPS_NODE}}" in unit
    assert not (root / "etc/systemd/system/raps-coordinator.service").exists()
    again = install(root, "--role", "compute", "--key", str(key))
    assert again.stdout.strip() == f"install.sh: compute: nothing changed under {root}"
    assert tree(root) == t


def test_login_gets_plugin_config_rapsctl_and_libraps_only(tmp_path: Path) -> None:
    out = install(tmp_path, "--role", "login", "--enable")
    assert out.returncode == 0, out.stderr
    assert "install.sh: --enable: the login role has no service" in out.stdout
    files = {p for p, v in tree(tmp_path).items() if v[0] != "dir"}
    # libraps: programs are built on login nodes (scripts/test.sh installs gfortran)
    libraps = {"usr/local/include/raps.h", "usr/local/include/raps.mod",
               "usr/local/lib/libraps.so", "usr/local/lib/libraps.so.0",
               "usr/local/lib/libraps_f.so", "usr/local/lib/libraps_f.so.0",
               "usr/local/lib/pkgconfig/raps.pc"}
    assert files == {"etc/raps/raps.yaml", f"{LIB}/raps_spank.so", "etc/slurm/plugstack.conf",
                     "etc/slurm/plugstack.conf.d/raps.conf", "usr/local/bin/rapsctl",
                     *libraps}


def test_config_prefix_and_sysconfdir_shape_every_path(tmp_path: Path) -> None:
    """The plugstack line and the hooks follow the installed config and the chosen paths."""
    cfg = tmp_path / "site.yaml"
    cfg.write_text("agent:\n  socket_path: /var/run/raps-%n.sock\n"
                   "coordinator:\n  addresses: ['ctl1:7470', 'ctl2:7470']\n"
                   "detection:\n  cluster_key_file: /etc/site/raps.key\n")
    root = tmp_path / "root"
    root.mkdir()
    out = install(root, "--role", "controller", "--config", str(cfg), "--prefix", "/opt/site",
                  "--sysconfdir", "/etc/site")
    assert out.returncode == 0, out.stderr
    assert (root / "etc/site/raps/raps.yaml").read_text() == cfg.read_text()
    assert stat.S_IMODE((root / "etc/site/raps.key").stat().st_mode) == 0o600
    line = (root / "etc/site/slurm/plugstack.conf.d/raps.conf").read_text().splitlines()[-1]
    assert line == ("required /opt/site/lib/raps/raps_spank.so "
                    "agent_socket=/var/run/raps-%n.sock coordinator=ctl1:7470,ctl2:7470")
    conf = (root / "etc/site/slurm/slurm.conf.d/raps.conf").read_text()
    assert "Prolog=/opt/site/lib/raps/prolog" in conf
    assert "PlugStackConfig=/etc/site/slurm/plugstack.conf" in conf
    assert "--config '/etc/site/raps/raps.yaml'" in (root / "opt/site/lib/raps/prolog").read_text()


def test_a_compute_node_with_transfer_tickets_gets_no_cluster_key(
        tmp_path: Path, controller: tuple[Path, str, str]) -> None:
    cfg = tmp_path / "site.yaml"
    cfg.write_text("detection:\n  node_key_file: /etc/raps/node.key\n"
                   "  transfer_tickets_file: /etc/raps/node.tickets\n")
    root = tmp_path / "n1"
    root.mkdir()
    key = controller[0] / "etc/raps/raps.key"
    out = install(root, "--role", "compute", "--config", str(cfg), "--key", str(key))
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "holds no cluster key" in out.stderr and list(root.iterdir()) == []
    out = install(root, "--role", "compute", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    assert not (root / "etc/raps/raps.key").exists()
    assert (root / "etc/systemd/system/raps-agent.service").exists()
    # a key left from an earlier install is named, not used
    (root / "etc/raps/raps.key").write_bytes(key.read_bytes())
    out = install(root, "--role", "compute", "--config", str(cfg))
    assert "/etc/raps/raps.key is not needed here" in out.stdout


def test_enable_outside_the_real_root_enables_nothing(tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_bytes(os.urandom(64))
    key.chmod(0o600)
    out = install(tmp_path, "--role", "compute", "--key", str(key), "--enable")
    assert out.returncode == 0, out.stderr
    assert f"install.sh: --enable: not enabling raps-agent: it is installed under {tmp_path}" \
        in out.stdout


@pytest.mark.parametrize(("args", "says"), [
    ([], "--role is required"),
    (["--role", "storage"], "unknown role 'storage' (allowed: controller, compute, login)"),
    (["--role", "login", "--frobnicate"], "unknown argument '--frobnicate'"),
    (["--role", "login", "--prefix"], "--prefix needs a value"),
    (["--role", "login", "--prefix", "usr/local"], "'usr/local' is not an absolute path"),
    (["--role", "login", "--config", "/no/such.yaml"], "'/no/such.yaml' is not a file"),
    (["--role", "compute", "--hooks-config", "/etc/hostname"],
     "--hooks-config is for --role controller"),
])
def test_bad_arguments_get_one_line_and_exit_2(tmp_path: Path, args: list[str],
                                               says: str) -> None:
    out = install(tmp_path, *args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_bad_key_or_config_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_bytes(os.urandom(64))
    key.chmod(0o644)
    root = tmp_path / "root"
    root.mkdir()
    out = install(root, "--role", "compute", "--key", str(key))
    assert out.returncode == 2 and "mode 0644" in out.stderr and out.stderr.count("\n") == 1
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("detection:\n  miss_threshold: -1\n")
    out = install(root, "--role", "login", "--config", str(cfg))
    assert out.returncode == 1 and "is not a valid RAPS config" in out.stderr
    assert "miss_threshold" in out.stderr
    assert list(root.iterdir()) == []


def test_the_controller_hooks_take_their_own_config(tmp_path: Path) -> None:
    hooks_cfg = tmp_path / "hooks.yaml"
    hooks_cfg.write_text("store:\n  user: raps-hooks\n"
                         "  password_file: /etc/raps/etcd/raps-hooks.password\n")
    root = tmp_path / "root"
    root.mkdir()
    out = install(root, "--role", "controller", "--hooks-config", str(hooks_cfg))
    assert out.returncode == 0, out.stderr
    assert "install.sh: installed /etc/raps/hooks.yaml" in out.stdout.splitlines()
    assert (root / "etc/raps/hooks.yaml").read_bytes() == hooks_cfg.read_bytes()
    assert stat.S_IMODE((root / "etc/raps/hooks.yaml").stat().st_mode) == 0o644
    for hook, cfg in (("prolog-slurmctld", "hooks"), ("epilog-slurmctld", "hooks"),
                      ("prolog", "raps"), ("epilog", "raps")):
        assert f"--config '/etc/raps/{cfg}.yaml'" in (root / LIB / hook).read_text(), hook
    before = tree(root)
    again = install(root, "--role", "controller")  # the installed hooks.yaml is kept
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"install.sh: controller: nothing changed under {root}"
    assert tree(root) == before
    bad = tmp_path / "bad.yaml"
    bad.write_text("store:\n  endpoints: 7\n")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    out = install(fresh, "--role", "controller", "--hooks-config", str(bad))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "--hooks-config:" in out.stderr and "not a valid RAPS config" in out.stderr
    assert list(fresh.iterdir()) == []


def test_every_option_is_in_the_help_and_in_docs_install_md() -> None:
    options = set(re.findall(r"^\s+(--[a-z-]+)\)", SCRIPT.read_text(), re.M))
    assert {"--role", "--root", "--prefix", "--sysconfdir", "--python", "--config", "--key",
            "--hooks-config", "--spank", "--enable"} == options
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True,
                         check=True).stdout
    docs = (REPO / "docs" / "install.md").read_text()
    assert [o for o in sorted(options) if o not in out or f"`{o}" not in docs] == []
