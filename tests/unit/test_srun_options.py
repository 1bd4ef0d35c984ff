"""srun's options read as srun reads them (core/srun_options.py): the tables checked
against the installed srun, and GNU getopt_long's rules: prefixes, combined short flags,
attached and separate values."""

from __future__ import annotations

import os
import re
import string
import subprocess
from collections.abc import Callable

import pytest

from raps_slurm.core.launch import cpus_per_rank, run_flags, split_command
from raps_slurm.core.srun_options import LONG, SHORT, Group, Option, long_name, parse, unparse


@pytest.fixture(scope="module")
def srun(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """srun with a configuration of its own: enough for it to read its command line."""
    conf = tmp_path_factory.mktemp("srun") / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=n1\n"
                    "PartitionName=p Nodes=n1\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}

    def run(*args: str) -> str:
        p = subprocess.run(["srun", *args], env=env, capture_output=True, text=True,
                           timeout=30, check=False)
        return p.stderr + p.stdout
    return run


def test_the_long_options_are_the_installed_sruns(srun: Callable[..., str]) -> None:
    for letter in string.ascii_lowercase:
        ours = {n for n in LONG if n.startswith(letter)}
        said = srun(f"--{letter}")
        m = re.search(r"is ambiguous; possibilities:(.*)", said)
        if m:
            assert set(re.findall(r"'--([\w-]+)'", m[1])) == ours, (letter, said)
        elif "unrecognized option" in said:
            assert not ours, (letter, said)
        else:
            assert len(ours) == 1, (letter, said)
    for name, kind in LONG.items():
        if kind == "req":
            assert "requires an argument" in srun(f"--{name}"), name
        else:
            allowed = "doesn't allow an argument" not in srun(f"--{name}=@")
            assert allowed == (kind == "opt"), name


def test_the_short_options_are_the_installed_sruns(srun: Callable[..., str]) -> None:
    helped = dict(re.findall(r"^  -(\w), --([\w-]+)", srun("--help"), re.M))
    assert len(helped) > 30
    for letter in string.ascii_letters:
        said = srun(f"-{letter}")
        if "invalid option" in said:
            assert letter not in SHORT, letter
            continue
        name = SHORT[letter]
        assert helped.get(letter, name) == name, letter
        if "requires an argument" in said:
            assert LONG[name] == "req", letter
        elif letter not in "hV":  # they print and exit before reading on
            attached = "invalid option -- '@'" not in srun(f"-{letter}@")
            assert attached == (LONG[name] == "opt"), letter


def test_prefixes_name_one_option_or_none() -> None:
    assert long_name("lab") == "label"
    assert long_name("nodel") == "nodelist"
    assert long_name("node") is None  # nodefile, nodelist, nodes
    assert long_name("tasks-per") == "ntasks-per-node"  # an alias
    assert long_name("cpu_") == "cpu-bind"
    assert long_name("nodes") == "nodes"  # exact, though also a prefix of nothing else
    assert long_name("mpi") == "mpi" and long_name("zzz") is None


def test_short_flags_combine_and_values_attach_or_follow() -> None:
    assert parse(["-lvN4", "-c", "2", "-I", "-K1", "--mem", "1G", "--nice=3"]) == [
        Group(("-lvN4",), (Option("label"), Option("verbose"), Option("nodes", "4"))),
        Group(("-c", "2"), (Option("cpus-per-task", "2"),)),
        Group(("-I",), (Option("immediate"),)),
        Group(("-K1",), (Option("kill-on-bad-exit", "1"),)),
        Group(("--mem", "1G"), (Option("mem", "1G"),)),
        Group(("--nice=3",), (Option("nice", "3"),))]
    # a required value may start with '-', as getopt takes the next word whatever it is
    assert parse(["-o", "-"]) == [Group(("-o", "-"), (Option("output", "-"),))]


def test_what_the_table_does_not_read_is_left_to_srun() -> None:
    unread = (Option(None),)
    assert parse(["--tres-per-task", "gpu:1", "--node=2", "-Y", "--label=1", "-v"]) == [
        Group(("--tres-per-task", "gpu:1"), unread), Group(("--node=2",), unread),
        Group(("-Y",), unread), Group(("--label=1",), unread),
        Group(("-v",), (Option("verbose"),))]
    assert parse(["--mpi4py", "--mpi4"], own=["mpi4py"]) == [
        Group(("--mpi4py",), (Option("mpi4py"),)), Group(("--mpi4",), unread)]


def test_a_missing_value_is_one_clear_error() -> None:
    for words in (["-c"], ["--mem"], ["-lN"], ["--cpus-per-t"]):
        with pytest.raises(ValueError, match=r"srun option '.*' needs a value"):
            parse(words)


def test_unparse_keeps_the_users_words_unless_an_option_is_taken_out() -> None:
    groups = parse(["-lvN4", "--mem", "1G", "-l"])
    assert unparse(groups, set()) == ["-lvN4", "--mem", "1G", "-l"]
    assert unparse(groups, {"label"}) == ["--verbose", "--nodes=4", "--mem", "1G"]


def test_raps_run_reads_its_flags_and_refusals_as_srun_would() -> None:
    assert run_flags(["--lab", "-lv", "--mpi4py", "--mem=1G"]) == (
        {"label", "mpi4py"}, ["--verbose", "--mem=1G"])
    for bad, name in ((["-vN2"], "--nodes"), (["--nodel=n1"], "--nodelist"),
                      (["--tasks-per-node=1"], "--ntasks-per-node"),
                      (["--kill"], "--kill-on-bad-exit"), (["-lk"], "--no-kill")):
        with pytest.raises(ValueError, match=f"raps-run sets {name} itself"):
            split_command([*bad, "--", "true"])
    with pytest.raises(ValueError, match=r"'app\.py': srun options come before"):
        split_command(["--mem=1G", "app.py", "--", "true"])
    assert cpus_per_rank(["-vc4", "--mem=1G"]) == (4, ["--verbose", "--mem=1G"])
    assert cpus_per_rank(["--cpus-per-t=3"]) == (3, [])
    assert cpus_per_rank(["--cpus=3"]) == (1, ["--cpus=3"])  # ambiguous: srun says so
