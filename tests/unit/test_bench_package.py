"""The benchmarks' package: measuring code apart from the CLI, no import cycle, and the
CLI's one-line answers to bad sizes (real ``rapsctl`` processes)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from raps_slurm.bench.checkpoint import parse_size
from raps_slurm.bench.churn import parse_quota

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "raps_slurm" / "bench"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names, ``from x import y`` gives x and x.y)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_no_bench_module_imports_the_cli() -> None:
    modules = sorted(BENCH.glob("*.py"))
    assert len(modules) >= 9
    for path in modules:
        cli = sorted(m for m in _imports(path) if m == "raps_slurm.cli"
                     or m.startswith("raps_slurm.cli."))
        assert not cli, f"{path.name} imports {cli}"


def test_bench_modules_import_each_other_without_a_cycle() -> None:
    names = {p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"}
    graph = {n: {m.split(".")[2] for m in _imports(BENCH / f"{n}.py")
                 if m.startswith("raps_slurm.bench.") and m.split(".")[2] in names}
             for n in names}
    assert graph["loss"] == {"cluster", "heartbeats"}  # the graph is read, not empty
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"import cycle: {' -> '.join((*path, node))}"
        if node not in done:
            for nxt in graph[node]:
                visit(nxt, (*path, node))
            done.add(node)

    for n in sorted(names):
        visit(n, ())


def test_only_cli_bench_reaches_the_benchmarks() -> None:
    users = sorted(p.name for p in (ROOT / "raps_slurm" / "cli").glob("*.py")
                   if any(m.startswith("raps_slurm.bench") for m in _imports(p)))
    assert users == ["bench.py"]


def test_sizes() -> None:
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("64M") == 64 << 20
    assert parse_size("1000000") == 1_000_000
    assert parse_quota("256MiB") == 256 << 20
    assert parse_quota("1g") == 1 << 30
    for bad in ("12XB", "-1M", "lots"):
        with pytest.raises(ValueError, match="expected a size like"):
            parse_size(bad)
    with pytest.raises(ValueError, match="not a size like 256MiB"):
        parse_quota("lots")


def _rapsctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "raps_slurm.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, check=False)


@pytest.mark.parametrize(("args", "option"), [
    (("checkpoint", "--size", "12XB"), "--size"),
    (("messaging", "--large-size", "lots"), "--large-size"),
    (("recovery", "--state", "1QB"), "--state"),
    (("churn", "--quota", "lots"), "--quota"),
])
def test_a_bad_size_is_one_line_naming_the_option(args: tuple[str, ...], option: str) -> None:
    r = _rapsctl("bench", *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and "size like" in lines[0], r.stderr
    assert r.stdout == ""


def test_bench_simulate_json_keys() -> None:
    r = _rapsctl("bench", "simulate", "--nodes", "200", "--years", "0.05", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"nodes", "working_nodes", "spares", "sim_years", "wall_s", "events",
                        "strategies", "sizes", "cpu_s"}
    assert set(out["strategies"]) == {"raps", "global", "scr", "step"}
    assert out["nodes"] == 200 and out["events"] > 0
