"""Output shapes shared by rapsctl commands: tables, scontrol-style Key=Value, JSON.

Text that users chose (job names, reasons, what a rank reported) reaches an admin's
terminal through these: every control character in table and text output is shown
escaped (``\\x1b``), so a job name cannot move the cursor, recolour or clear the
screen, or forge lines. JSON output is escaped by ``json.dumps`` already.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

MISSING = "-"  # what a table prints for a value that is not there (JSON keeps null)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (C0 and C1 controls, DEL,
    Unicode format and line separators) shown as an escape: ``\\x1b``, ``\\n``,
    ``\\u202e``. Text without them prints unchanged; in text with them a backslash is
    doubled, so an escape there cannot be mistaken for a literal one."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable() or ch == " ":
            out.append("\\\\" if ch == "\\" else ch)
        elif ch in _NAMED:
            out.append(_NAMED[ch])
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else
                       f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def echo(text: str, err: bool = False) -> None:
    """``click.echo`` of one line (or several) whose values may hold control characters."""
    click.echo("\n".join(printable(line) for line in text.split("\n")), err=err)


def cell_text(value: Any) -> str:
    """A table cell: ``-`` for a missing value (None, '', an empty list), else its text."""
    if value is None or value == "" or value == [] or value == ():
        return MISSING
    return printable(str(value))


def table(rows: list[dict[str, Any]], as_json: bool, columns: list[str]) -> None:
    """Print rows as JSON or as an aligned table (a missing value or key prints ``-``)."""
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    cells = [columns] + [[cell_text(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def value_text(value: Any) -> str:
    """A value as scontrol prints it: lists comma-joined, nothing as (null)."""
    if value is None or value == "" or value == []:
        return "(null)"
    if isinstance(value, (list, tuple)):
        return printable(",".join(str(v) for v in value))
    if isinstance(value, float):
        return f"{value:.3f}"
    return printable(str(value).replace(" ", "_") if isinstance(value, str) and "\n" in value
                     else str(value))


def records(blocks: Sequence[Sequence[Sequence[tuple[str, Any]]]], one_liner: bool) -> None:
    """Print records like ``scontrol show``: each a list of lines of Key=Value pairs.

    Default: the first line flush left, the others indented by three spaces, a blank
    line after each record. ``one_liner`` (``-o``): each record on one line.
    """
    for block in blocks:
        lines = [" ".join(f"{k}={value_text(v)}" for k, v in line) for line in block if line]
        if one_liner:
            click.echo(" ".join(lines))
        else:
            click.echo("\n".join([lines[0], *("   " + ln for ln in lines[1:])]) + "\n")
