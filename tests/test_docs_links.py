"""Every relative link in the user docs points at something that exists.

README.md, docs/*.md, bench/README.md and examples/**/README.md are read as a newcomer reads
them on GitHub: a relative markdown link must name an existing file or folder, and a
``#anchor`` into a markdown file (or within the same file) must name one of its headings,
slugged as GitHub slugs them. External links (``http(s)://``, ``mailto:``) are not fetched.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files() -> list[Path]:
    """The markdown files whose links are checked."""
    files = [REPO / "README.md", REPO / "bench" / "README.md"]
    files += sorted((REPO / "docs").glob("*.md"))
    files += sorted((REPO / "examples").glob("**/README.md"))
    return [f for f in files if f.is_file()]


def slugify(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline markup dropped, lower case, punctuation
    other than ``-`` and ``_`` removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text, duplicates numbered ``-1``, ``-2`` as GitHub does."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = slugify(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(text: str) -> list[str]:
    """The targets of the markdown links (and images) in a text, outside code."""
    found: list[str] = []
    for line in _prose_lines(text):
        found += _LINK.findall(_CODE_SPAN.sub("", line))
    return found


def _shown(path: Path) -> str:
    """A path as the repository names it, when it is inside the repository."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def broken_links(path: Path) -> list[str]:
    """The relative links of one markdown file that point at nothing, each with why."""
    text = path.read_text(encoding="utf-8")
    bad: list[str] = []
    for target in links(text):
        if _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file {_shown(dest)}")
            continue
        if anchor and dest.suffix == ".md" and dest.is_file():
            if anchor not in anchors(dest.read_text(encoding="utf-8")):
                bad.append(f"{target}: no heading #{anchor} in {_shown(dest)}")
    return bad


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Quick start", "quick-start"),
        ("`rallypoint run`: a replica group that restarts itself", "rallypoint-run-a-replica-group-that-restarts-itself"),
        ("torchft's own integration tests", "torchfts-own-integration-tests"),
        ("Leases: the lighthouse off the step path", "leases-the-lighthouse-off-the-step-path"),
        ("HSDP: FSDP2 inside a replica group", "hsdp-fsdp2-inside-a-replica-group"),
        ("The `min_replicas` flag", "the-min_replicas-flag"),
        ("A / B", "a--b"),
        ("[Link](x.md) text", "link-text"),
        ("**Bold** and 1.5x", "bold-and-15x"),
    ],
)
def test_slugify_matches_github(heading: str, slug: str) -> None:
    assert slugify(heading) == slug


def test_checker_finds_missing_files_and_anchors(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## Real heading\n", encoding="utf-8")
    page.write_text(
        "# Page\n\n## Same heading\n## Same heading\n\n"
        "[ok](other.md) [ok](other.md#real-heading) [ok](#same-heading-1) [ok](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [bad here](#nope)\n"
        "`[in code](missing2.md)`\n```\n[in a fence](missing3.md)\n```\n",
        encoding="utf-8",
    )
    bad = broken_links(page)
    assert len(bad) == 3, bad
    assert any(b.startswith("missing.md:") for b in bad)
    assert any(b.startswith("other.md#nope:") for b in bad)
    assert any(b.startswith("#nope:") for b in bad)


def test_the_docs_are_found() -> None:
    names = {str(f.relative_to(REPO)) for f in doc_files()}
    assert {"README.md", "bench/README.md", "docs/environment.md"} <= names


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path: Path) -> None:
    bad = broken_links(path)
    assert not bad, f"broken links in {path.relative_to(REPO)}:\n  " + "\n  ".join(bad)
