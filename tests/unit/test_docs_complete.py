"""The README as the front door, links that resolve, and nothing that exists left
undocumented: every rapsctl command and option, every daemon option, every job-side
option and every environment variable the code reads is named in README.md or docs/."""

from __future__ import annotations

import re
from pathlib import Path

import click

from raps_slurm.agent.main import cli as agent_cli
from raps_slurm.cli import cli as rapsctl_cli
from raps_slurm.coordinator.main import cli as coordinator_cli
from raps_slurm.core.launch import OWN_OPTIONS, RUN_FLAGS
from raps_slurm.core.srun_options import SHORT

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "CHANGELOG.md", *DOCS]
README_LIMIT = 12 * 1024
# Names that match RAPS_* in the code but are not environment variables.
NOT_ENV = {
    "RAPS_EXPORT": "a C macro in spank/raps_spank.c (symbol visibility)",
    "RAPS_REASON": "a Python constant in raps_slurm/coordinator/detection.py (drain prefix)",
}


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _all_docs() -> str:
    return "\n".join(_text(p) for p in PAGES)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", _text(path), flags=re.M | re.S)  # no '#' in code
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", _text(path), flags=re.M | re.S)
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


def test_readme_fits_and_starts_with_the_two_commands() -> None:
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, the limit is {README_LIMIT}"
    text = _text(README)
    first_section = text.index("\n## ")
    first_block = text[text.index("```"):text.index("```", text.index("```") + 3)]
    assert text.index("```") < first_section
    assert "scripts/demo.sh" in first_block and "scripts/test.sh" in first_block


def test_readme_links_every_docs_page() -> None:
    linked = {(README.parent / t.split("#")[0]).resolve() for t in _links(README)}
    unlinked = [p.name for p in DOCS if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_relative_links_resolve_to_files_and_anchors() -> None:
    checked, broken = 0, []
    for page in PAGES:
        for target in _links(page):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            checked += 1
            if not dest.is_file():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no heading with that anchor)")
    assert checked >= 30, checked  # the README's table alone links every page
    assert not broken, broken


def test_anchor_slugs() -> None:
    assert _slug("10. Monitoring") == "10-monitoring"
    assert _slug("Why etcd3gw and not the etcd3 client") == "why-etcd3gw-and-not-the-etcd3-client"
    assert _slug("`rapsctl show racks`") == "rapsctl-show-racks"


def test_paths_named_in_docs_exist() -> None:
    """A path in backticks (`raps_slurm/...`, `docs/x.md`, `core/x.func`) names a file or
    directory of the repository."""
    tops = ("raps_slurm/", "scripts/", "slurm/", "configs/", "docs/", "examples/", "tests/",
            "spank/", "core/")
    missing = []
    for page in PAGES:
        for m in re.finditer(r"`([^`\s]+)`", _text(page)):
            name = m.group(1).rstrip(".,;:")
            if not name.startswith(tops) or name.endswith(".so"):  # .so: built, not tracked
                continue
            module = name.split(".")[0] + ".py"  # core/jobs.build_map -> core/jobs.py
            candidates = [name, f"raps_slurm/{name}", module, f"raps_slurm/{module}"]
            if not any((ROOT / c).exists() for c in candidates):
                missing.append(f"{page.name}: {name}")
    assert not missing, missing


def _synopsis(path: Path, heading: str) -> list[str]:
    """The entries of the first code block after ``heading``: a line starting with a
    program name, plus its indented continuation lines."""
    text = _text(path)
    block = text[text.index(heading):]
    block = block[block.index("```") + 3:]
    block = block[block.index("\n") + 1:block.index("```")]
    entries: list[str] = []
    for line in block.splitlines():
        if line.startswith(" ") and entries:
            entries[-1] += " " + line.strip()
        elif line.strip():
            entries.append(line.strip())
    return entries


def _options(cmd: click.Command) -> list[str]:
    return [o for p in cmd.params if isinstance(p, click.Option)
            for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]


def _leaves(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out += _leaves(cmd, (*path, name))
        else:
            out.append((*path, name))
    return out


def test_rapsctl_md_names_every_command_and_option() -> None:
    entries = [re.sub(r"\s+", " ", e.replace("[--config FILE] ", ""))
               for e in _synopsis(ROOT / "docs" / "rapsctl.md", "## Synopsis")]
    leaves = _leaves(rapsctl_cli)
    assert len(leaves) >= 35, leaves
    missing = []
    for path in leaves:
        words = " ".join(path)
        mine = [e for e in entries if e.startswith(f"rapsctl {words} ") or e == f"rapsctl {words}"
                or f"| {words} " in e]
        if not mine:
            missing.append(f"rapsctl {words}: no synopsis line")
            continue
        cmd: click.Command = rapsctl_cli
        for word in path:
            assert isinstance(cmd, click.Group)
            cmd = cmd.commands[word]
        missing += [f"rapsctl {words} {o}" for o in _options(cmd)
                    if not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", e) for e in mine)]
    top = " ".join(_synopsis(ROOT / "docs" / "rapsctl.md", "## Synopsis"))
    missing += [f"rapsctl {o}" for o in _options(rapsctl_cli) if o not in top]
    assert not missing, f"docs/rapsctl.md lacks {missing}"


def test_operations_md_names_every_daemon_option() -> None:
    entries = _synopsis(ROOT / "docs" / "operations.md", "## Daemons")
    for prog, cmd in (("raps-coordinator", coordinator_cli), ("raps-agent", agent_cli)):
        mine = " ".join(e for e in entries if e.startswith(prog + " "))
        opts = _options(cmd)
        assert len(opts) >= 5, opts
        missing = [o for o in opts if o not in ("-h", "--help") and o not in mine]
        assert not missing, f"docs/operations.md's {prog} synopsis lacks {missing}"


def test_jobs_md_names_every_job_option() -> None:
    jobs = _text(ROOT / "docs" / "jobs.md")
    spank = set(re.findall(r'\{ "(raps[a-z-]*)", ', _text(ROOT / "spank" / "raps_spank.c")))
    assert len(spank) == 5, spank
    missing = [f"--{o}" for o in spank if f"`--{o}" not in jobs]
    # raps-run: what it refuses (it sets them itself) and its own flag
    names = {*OWN_OPTIONS, *RUN_FLAGS}
    forms = [f"--{n}" for n in names] + [f"-{c}" for c, n in SHORT.items() if n in names]
    missing += [o for o in forms if not re.search(rf"`{re.escape(o)}[`/=]", jobs)]
    local = re.findall(r'add_argument\("(-[-\w]+)"',
                       _text(ROOT / "raps_slurm" / "runtime" / "local.py"))
    assert "--restarts" in local
    synopsis = " ".join(_synopsis(ROOT / "docs" / "jobs.md", "## Local runs"))
    missing += [f"local {o}" for o in local if o not in synopsis]
    assert not missing, f"docs/jobs.md lacks {missing}"


def test_every_environment_variable_is_documented() -> None:
    sources = [*(ROOT / "raps_slurm").rglob("*.py"), *(ROOT / "scripts").rglob("*.sh"),
               *(ROOT / "spank").glob("*.c")]
    found: dict[str, str] = {}
    for path in sources:
        for name in re.findall(r"\b((?:SPANK_)?RAPS_[A-Z][A-Z0-9_]*)\b", _text(path)):
            found.setdefault(name, str(path.relative_to(ROOT)))
    assert len(found) >= 30, found
    docs = _all_docs()
    missing = {n: where for n, where in found.items()
               if n not in NOT_ENV and f"`{n}" not in docs}
    assert not missing, f"environment variables read by the code but not documented: {missing}"
