"""The repository's own documentation: what the code cites from docs/architecture.md
exists there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def _headings(path: Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.M)}


def test_code_cites_sections_that_exist_in_architecture_md() -> None:
    sections = _headings(ROOT / "docs" / "architecture.md")
    cites: list[tuple[str, str]] = []
    for path in _tracked("raps_slurm", "configs", "scripts", "slurm", "spank"):
        if path.suffix not in {".py", ".yaml", ".sh", ".c", ".conf", ".service", ".pyi"}:
            continue
        text = re.sub(r"\s*\n\s*(#\s*)?", " ", path.read_text(errors="replace"))
        for m in re.finditer(r"docs/architecture\.md,\s+([A-Z][A-Za-z ]+?)[).:;]", text):
            cites.append((str(path.relative_to(ROOT)), m.group(1)))
    assert len(cites) >= 8, cites  # the trust boundaries and the key layout are cited
    wrong = [(p, s) for p, s in cites if s not in sections]
    assert not wrong, f"cited sections missing from docs/architecture.md: {wrong}"
