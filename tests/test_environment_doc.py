"""docs/environment.md lists every ``RALLYPOINT_*`` variable the code reads.

The code's variables are the ``RALLYPOINT_*`` names inside string literals of the package's
Python files (``os.environ.get("RALLYPOINT_X")``, ``X_ENV = "RALLYPOINT_X"``, help texts);
a name ending in ``_`` is a family mentioned in prose (``RALLYPOINT_TLS_*``) and Python
identifiers (``RALLYPOINT_USE_BUCKETIZATION_ENV = ...``) are not strings, so neither counts.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "environment.md"
NAME = re.compile(r"RALLYPOINT_[A-Z0-9_]+")


def names_in_strings(source: str) -> set[str]:
    """``RALLYPOINT_*`` names in the string literals of a Python source."""
    found: set[str] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            found.update(n for n in NAME.findall(tok.string) if not n.endswith("_"))
    return found


def code_variables() -> dict[str, list[str]]:
    """Each variable the package names, with the files that name it."""
    where: dict[str, list[str]] = {}
    for path in sorted((ROOT / "rallypoint").rglob("*.py")):
        for name in names_in_strings(path.read_text()):
            where.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return where


def documented() -> set[str]:
    """The names in the first column of the first table of docs/environment.md."""
    text = DOC.read_text()
    table = text.split("| variable |", 1)[1].split("\n\n", 1)[0]
    return {m for line in table.splitlines() if line.startswith("| `")
            for m in NAME.findall(line.split("|")[1])}


def test_the_scanner_sees_strings_not_identifiers() -> None:
    src = 'A_ENV = "RALLYPOINT_ALPHA"\nRALLYPOINT_BETA_ENV = 1\nx = f"{y} RALLYPOINT_GAMMA"\n"""RALLYPOINT_TLS_*"""\n'
    assert names_in_strings(src) == {"RALLYPOINT_ALPHA", "RALLYPOINT_GAMMA"}


def test_every_variable_the_code_reads_is_in_the_table() -> None:
    code, doc = code_variables(), documented()
    assert len(code) >= 20, sorted(code)  # the scan finds the package's variables at all
    missing = {name: files for name, files in code.items() if name not in doc}
    assert not missing, f"RALLYPOINT_* variables read by the code but not in docs/environment.md: {missing}"


def test_the_table_lists_no_variable_the_code_does_not_read() -> None:
    stale = documented() - set(code_variables())
    assert not stale, f"docs/environment.md lists variables no code reads: {sorted(stale)}"
