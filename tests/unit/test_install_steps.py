"""Every external program that the code, the tests and the scripts run is installed by the
set-up's own package list (scripts/test.sh, scripts/demo.sh, scripts/install.sh), so that a
missing install step fails here and not on a newcomer's fresh machine.

Programs are found by reading the sources: in Python, argv lists handed to subprocess or
built by the Slurm argv builders, and ``shutil.which`` names; in the shell scripts, the
first word of each command. A program counts as installed by the set-up when the Debian
package that owns it is listed by an ``ensure_apt`` line, is a dependency of one that is,
or is Essential or of Priority required (present on every Debian system); console scripts
of the venv come from pip."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "scripts").rglob("*.sh"))
SETUP_SCRIPTS = [REPO / "scripts" / name for name in ("test.sh", "demo.sh", "install.sh")]
SUBPROCESS_CALLS = {"run", "Popen", "check_output", "check_call", "call", "execvp", "execv"}
# Started through a variable or a quoted `sh -c` string, or passed as an argument to a
# script function (wait_for NAME SECS PROGRAM...), where the first-word scan cannot see them.
INDIRECT = {"slurmctld", "slurmd", "munged", "curl", "test", "etcdctl"}
# Not programs: the scan's placeholder for a quoted word, and the runner test's missing command.
NOT_PROGRAMS = {"X", "no-such-slurm-cmd"}
BUILTINS = frozenset("""alias bg bind break builtin caller cd command compgen complete continue
declare dirs disown echo enable eval exec exit export false fc fg getopts hash help history
jobs kill let local logout mapfile popd printf pushd pwd read readarray readonly return set
shift shopt source suspend test times trap true type typeset ulimit umask unalias unset wait
if then else elif fi for while until do done case esac in function select time""".split())  # noqa: SIM905
PREFIXES = {"exec", "nohup", "setsid", "command", "env", "time", "!", "if", "elif", "while",
            "until", "then", "do", "else"}
SEARCH_PATH = os.pathsep.join([os.path.join(sys.prefix, "bin"), os.environ.get("PATH", ""),
                               "/usr/local/sbin", "/usr/sbin", "/sbin"])


def _python_sources() -> Iterator[Path]:
    for top in ("raps_slurm", "tests", "examples"):
        yield from sorted((REPO / top).rglob("*.py"))


def _head(node: ast.AST) -> str | None:
    if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
        first = node.elts[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def python_programs(path: Path) -> set[str]:
    """argv[0] of literal argv lists given to subprocess (or returned by the Slurm argv
    builders), and names looked up with shutil.which."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    builders = path.match("raps_slurm/slurm/commands.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in SUBPROCESS_CALLS and node.args and (head := _head(node.args[0])):
                found.add(head)
            if name == "which" and node.args and isinstance(node.args[0], ast.Constant):
                found.add(str(node.args[0].value))
        elif isinstance(node, ast.Assign):
            named = any(isinstance(t, ast.Name) and t.id in ("argv", "cmd") for t in node.targets)
            if named and (head := _head(node.value)):
                found.add(head)
        elif builders and isinstance(node, ast.Return) and node.value and (head := _head(node.value)):
            found.add(head)
    return found


def shell_programs(text: str, functions: set[str]) -> set[str]:
    """First words of the commands of a bash script (a scan, not a parser: quoted strings,
    heredoc bodies, comments, case labels and arithmetic are dropped first)."""
    functions = functions | set(re.findall(r"^\s*([A-Za-z_][\w-]*)\s*\(\)", text, re.M))
    text = re.sub(r"<<-?\s*'?(\w+)'?(.*?)\n.*?^\s*\1\s*$", r"\2", text, flags=re.S | re.M)
    text = text.replace("\\\n", " ")
    found: set[str] = set()
    for line in text.splitlines() + re.findall(r"\$\(([^()]*)\)", text):
        line = re.sub(r"\$\(([^()]*)\)", " X ", line)
        line = re.sub(r"\$\{[^{}]*\}", "X", line)
        line = re.sub(r'"(\\.|[^"\\])*"', " X ", line)
        line = re.sub(r"'[^']*'", " X ", line)
        line = re.sub(r"(^|\s)#.*$", "", line)
        line = re.sub(r"\bcase\b.*?\bin\b", "", line)
        line = re.sub(r"^\s*[\w*|\s.-]+\)", "", line)          # case labels
        line = re.sub(r"\(\(.*?\)\)", "", line)
        line = re.sub(r"=\(\)", "=X", line)                 # empty arrays
        line = re.sub(r"\d*>&\d*|&>", " ", line)           # redirections
        for segment in re.split(r"\|\||&&|[;|&(){}]", line):
            words = segment.split()
            while words and (re.match(r"^[A-Za-z_]\w*(\[.*\])?\+?=", words[0]) or words[0] in PREFIXES):
                words = words[1:]
            if not words:
                continue
            word = words[0]
            if word in ("runuser", "timeout") and "--" in words[:-1]:
                found.add(words[words.index("--") + 1])
            if word in BUILTINS or word in functions or word in NOT_PROGRAMS:
                continue
            if re.fullmatch(r"[A-Za-z][\w.+-]*|/[\w./+-]+", word):
                found.add(word)
    return found - NOT_PROGRAMS


def all_programs() -> dict[str, set[str]]:
    """Program name -> files that run it."""
    where: dict[str, set[str]] = {}
    for path in _python_sources():
        for prog in python_programs(path):
            where.setdefault(prog, set()).add(str(path.relative_to(REPO)))
    lib_functions = set(re.findall(r"^\s*([A-Za-z_][\w-]*)\s*\(\)",
                                   (REPO / "scripts/lib/setup.sh").read_text(), re.M))
    for path in SCRIPTS:
        for prog in shell_programs(path.read_text(), lib_functions):
            where.setdefault(prog, set()).add(str(path.relative_to(REPO)))
    for prog in INDIRECT:
        where.setdefault(prog, set()).add("tests/unit/test_install_steps.py (INDIRECT)")
    return {prog: files for prog, files in where.items() if prog not in NOT_PROGRAMS}


def listed_packages() -> set[str]:
    """Packages named on the ensure_apt lines of the set-up scripts."""
    names: set[str] = set()
    for path in SETUP_SCRIPTS:
        if not path.exists():
            continue
        text = path.read_text().replace("\\\n", " ")
        for line in re.findall(r"^\s*ensure_apt\s+(.*)$", text, re.M):
            names |= {w for w in line.split() if re.fullmatch(r"[a-z0-9][a-z0-9.+-]+", w)}
    return names


def _dpkg(*args: str) -> str:
    return subprocess.run(["dpkg-query", *args], capture_output=True, text=True, check=False).stdout


def packages() -> dict[str, tuple[list[str], bool]]:
    """Every package dpkg knows: its dependencies and provided names, and whether it is
    Essential or of Priority required (on every Debian system, fresh ones included). One
    dpkg-query for them all: one per package took seconds."""
    table: dict[str, tuple[list[str], bool]] = {}
    for line in _dpkg("-W", "-f=${Package}\t${Depends},${Pre-Depends},${Provides}\t"
                      "${Essential} ${Priority}\n").splitlines():
        name, depends, flags = [*line.split("\t"), "", ""][:3]
        deps = [alt.strip().split(" ")[0].split(":")[0] for alt in re.split(r"[,|]", depends)]
        old_deps, old_base = table.get(name, ([], False))
        table[name] = (old_deps + [d for d in deps if d],
                       old_base or "yes" in flags.split() or "required" in flags.split())
    return table


def closure(listed: set[str], table: dict[str, tuple[list[str], bool]]) -> set[str]:
    """The listed packages with everything they depend on (installed ones only)."""
    seen: set[str] = set()
    todo = list(listed)
    while todo:
        pkg = todo.pop()
        if pkg in seen:
            continue
        seen.add(pkg)
        todo.extend(table.get(pkg, ([], False))[0])
    return seen


def _variants(path: str) -> list[str]:
    """The names dpkg may know PATH by (following the /usr merge)."""
    return list(dict.fromkeys(
        variant for candidate in dict.fromkeys([path, os.path.realpath(path)])
        for variant in (candidate, re.sub(r"^/usr/", "/", candidate), "/usr" + candidate)))


def owners(paths: list[str]) -> dict[str, str]:
    """The Debian package that owns each of PATHS (following the /usr merge); a path no
    package owns is left out. One dpkg-query for them all."""
    variants = {path: _variants(path) for path in paths}
    found: dict[str, str] = {}
    every = sorted({v for vs in variants.values() for v in vs})
    for line in _dpkg("-S", *every).splitlines() if every else []:
        if line.startswith("diversion by"):
            continue
        pkgs, _, owned = line.partition(": ")
        found.setdefault(owned.strip(), pkgs.split(",")[0].strip())
    return {path: next(found[v] for v in vs if v in found)
            for path, vs in variants.items() if any(v in found for v in vs)}


def test_every_external_program_is_installed_by_the_setup() -> None:
    assert shutil.which("dpkg-query"), "dpkg-query missing: the project's machines are Debian"
    table = packages()
    installed = closure(listed_packages(), table)
    problems: list[str] = []
    system: dict[str, str] = {}  # program -> its path, outside the venv
    programs = all_programs()
    for prog, files in sorted(programs.items()):
        path = prog if prog.startswith("/") else shutil.which(prog, path=SEARCH_PATH)
        if path is None or not os.access(path, os.X_OK):
            problems.append(f"{prog}: not installed (run by {', '.join(sorted(files))})")
        elif not os.path.realpath(path).startswith(os.path.realpath(sys.prefix)):
            system[prog] = path  # (a console script of the venv: pip installs it)
    owned = owners(sorted(set(system.values())))
    for prog, path in sorted(system.items()):
        files = ", ".join(sorted(programs[prog]))
        pkg = owned.get(path)
        if pkg is None:
            problems.append(f"{prog}: {path} belongs to no Debian package (run by {files})")
        elif pkg not in installed and not table.get(pkg, ([], False))[1]:
            problems.append(f"{prog}: package {pkg} is not installed by scripts/test.sh "
                            f"(run by {files})")
    assert not problems, "\n".join(problems)


def test_the_scan_sees_what_it_should() -> None:
    """The scan itself: it must see programs in each form, or the test above proves nothing."""
    found = all_programs()
    for prog in ("scontrol", "srun", "sbatch", "squeue", "sinfo", "scancel", "etcd", "openssl",
                 "make", "apt-get", "dpkg-query", "runuser", "etcdctl", "curl", "slurmd"):
        assert prog in found, prog
    assert shell_programs("case $x in a | b) foo -v ;; esac\nFOO=1 bar \"$(baz q)\"\n", set()) \
        == {"foo", "bar", "baz"}
    assert "etcd-client" in listed_packages()
