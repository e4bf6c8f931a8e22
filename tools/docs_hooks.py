"""MkDocs hooks for the documentation site (mkdocs.yml ``hooks:``), run by ``make docs``.

Checks MkDocs' own validation cannot express (it reports a link to a missing page and a
link to a file outside ``docs/`` alike, "not found"); each failure is a warning, so an
error under ``mkdocs build --strict``:

- **Links to repository files.** A page may link to a file of the repository outside
  ``docs/`` (``../examples/train_ddp.py``), as it would on GitHub. Such a target must
  exist in the checkout; it is published with the site, verbatim, under ``_repo/`` and
  the link is rewritten to that copy, so the built site's links work offline. A link to a folder goes to its ``README.md``.
- **Pages not written yet.** A nav entry whose page does not exist is left out, said at
  INFO. A page that exists but is missing from the nav still fails the strict build
  (``validation: omitted_files: warn``), so a misspelled entry is caught.
- **Every public name in the API reference.** Each name of ``rallypoint.__all__`` and of
  the ``__all__`` of the public subpackages (read from the source, nothing imported) must
  have a rendered entry on some page.

Links between pages, and their anchors, are left to MkDocs' validation. Last, the Sphinx
roles a few docstrings use (``:class:`Name```) are rendered as code, as Sphinx would.
"""

from __future__ import annotations

import ast
import logging
import os
import posixpath
import re
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

# Under "mkdocs." so that `mkdocs build --strict` counts this logger's warnings.
log = logging.getLogger("mkdocs.hooks.rallypoint")

#: Where repository files linked from the pages are published inside the site.
REPO_PREFIX = "_repo"

# An inline Markdown link or image target, ](target) or ](target "title"), and a
# reference definition, [label]: target.
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?((?:\s+\"[^\"]*\")?\s*)\)")
_REF = re.compile(r"^(\s{0,3}\[[^\]]+\]:\s*)<?([^\s>]+)>?")
_FENCE = re.compile(r"^\s*(```|~~~)")


class _RepoFile(File):
    """A repository file published verbatim: never rendered as a page, even a ``.md``."""

    def is_documentation_page(self) -> bool:
        return False


def _repo_root(config: MkDocsConfig) -> str:
    return os.path.dirname(os.path.abspath(config.config_file_path))


def _outside_target(config: MkDocsConfig, src_uri: str, url: str) -> tuple[str, str] | None:
    """For a link ``url`` on page ``src_uri`` that leaves ``docs/``: (repository path, anchor).

    None for a link MkDocs handles itself: external, absolute, anchor-only, or inside docs/.
    """
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url) or url.startswith(("/", "#")):
        return None
    path, _, anchor = url.partition("#")
    inside = posixpath.normpath(posixpath.join(posixpath.dirname(src_uri), path))
    if not inside.startswith("../"):
        return None
    docs_abs = os.path.abspath(config.docs_dir)
    target = os.path.normpath(os.path.join(docs_abs, *inside.split("/")))
    return os.path.relpath(target, _repo_root(config)).replace(os.sep, "/"), anchor


def _published(config: MkDocsConfig, repo_path: str, warn: bool = True) -> str | None:
    """The repository file a link to ``repo_path`` publishes, or None (warned) if none."""
    problem, result = None, None
    full = os.path.join(_repo_root(config), repo_path)
    readme = posixpath.join(repo_path, "README.md")
    if repo_path.startswith("../"):
        problem = f"a docs link points outside the repository: {repo_path}"
    elif os.path.isdir(full):
        if os.path.isfile(os.path.join(full, "README.md")):
            result = readme
        else:
            problem = f"a docs link points to the folder {repo_path}, which has no README.md: link a file"
    elif os.path.isfile(full):
        result = repo_path
    else:
        problem = f"a docs link points to {repo_path}, which does not exist in the repository"
    if problem and warn:
        log.warning(problem)
    return result


def _rewrite(markdown: str, transform: Any) -> str:
    """Apply ``transform(url) -> url`` to every inline link outside fenced code blocks."""
    out, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            line = _LINK.sub(lambda m: f"]({transform(m.group(1))}{m.group(2)})", line)
            line = _REF.sub(lambda m: f"{m.group(1)}{transform(m.group(2))}", line)
        out.append(line)
    return "".join(out)


def _prune_nav(items: list[Any], docs_dir: str) -> list[Any]:
    kept: list[Any] = []
    for item in items:
        title, value = next(iter(item.items())) if isinstance(item, dict) else (None, item)
        if isinstance(value, list):
            value = _prune_nav(value, docs_dir)
            if not value:
                continue
        elif isinstance(value, str) and "://" not in value and not os.path.isfile(os.path.join(docs_dir, value)):
            log.info("nav: %s is not written yet; left out of the navigation", value)
            continue
        kept.append({title: value} if title is not None else value)
    return kept


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Leave nav entries whose page does not exist out of the navigation."""
    if config.nav:
        config.nav = _prune_nav(config.nav, config.docs_dir)
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Publish every repository file outside docs/ that a page links to, under ``_repo/``."""
    wanted: set[str] = set()
    for f in files.documentation_pages():
        text = f.content_string

        def collect(url: str, src_uri: str = f.src_uri) -> str:
            found = _outside_target(config, src_uri, url)
            if found is not None:
                published = _published(config, found[0])
                if published is not None:
                    wanted.add(published)
            return url

        _rewrite(text, collect)
    root = _repo_root(config)
    for repo_path in sorted(wanted):
        files.append(_RepoFile.generated(config, f"{REPO_PREFIX}/{repo_path}",
                                         abs_src_path=os.path.join(root, repo_path)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Point links to repository files at their published copies under ``_repo/``."""
    src_uri = page.file.src_uri

    def to_copy(url: str) -> str:
        found = _outside_target(config, src_uri, url)
        if found is None:
            return url
        repo_path, anchor = found
        published = _published(config, repo_path, warn=False)  # on_files has warned
        if published is None:
            return url
        rel = posixpath.relpath(f"{REPO_PREFIX}/{published}", posixpath.dirname(src_uri) or ".")
        return f"{rel}#{anchor}" if anchor else rel

    return _rewrite(markdown, to_copy)



# A Sphinx cross-reference role left in a docstring, as Markdown renders it:
# :class:<code>~pkg.mod.Name</code>.
_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj|const):<code>(~?)([^<]*)</code>")


def _role_to_code(m: re.Match[str]) -> str:
    name = m.group(2)
    if m.group(1):  # Sphinx's "~": show the last component only
        name = name.rsplit(".", 1)[-1]
    return f"<code>{name}</code>"


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Render the Sphinx roles some docstrings use (``:class:`X```) as plain code, as Sphinx would."""
    return _ROLE.sub(_role_to_code, html)


#: The packages whose ``__all__`` the API reference must cover, name by name.
PUBLIC_PACKAGES = ("rallypoint", "rallypoint.integrations", "rallypoint.process_groups", "rallypoint.transports")
#: Public names that are not objects with a page entry of their own.
NOT_DOCUMENTED = {"__version__"}

# The ids mkdocstrings gives the headings of the objects it renders, by page.
_HEADING_ID = re.compile(r'<h[1-6][^>]*\bid="(rallypoint\.[A-Za-z0-9_.]+)"')
_rendered: set[str] = set()


def public_names(root: str, package: str) -> list[str]:
    """The names of ``package.__all__`` (for ``rallypoint``: its lazily loaded ``_LAZY`` too), read by ``ast``."""
    path = os.path.join(root, *package.split("."), "__init__.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names: list[str] = []
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if not isinstance(target, ast.Name) or value is None:
            continue
        if target.id == "__all__" and isinstance(value, ast.List):
            names += [e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        elif target.id == "_LAZY" and isinstance(value, ast.Dict) and package == "rallypoint":
            names += [k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return sorted(set(names))


def on_pre_build(config: MkDocsConfig) -> None:
    """Forget the previous build's entries (``mkdocs serve`` rebuilds in one process)."""
    _rendered.clear()


def on_post_page(output: str, page: Page, config: MkDocsConfig) -> str:
    """Note the short name of every object the page renders an entry for."""
    _rendered.update(m.rsplit(".", 1)[-1] for m in _HEADING_ID.findall(output))
    return output


def on_post_build(config: MkDocsConfig) -> None:
    """Warn about each public name the API reference has no entry for."""
    root = _repo_root(config)
    for package in PUBLIC_PACKAGES:
        for name in public_names(root, package):
            if name not in NOT_DOCUMENTED and name not in _rendered:
                log.warning("API reference: %s.%s has no entry in docs/api/", package, name)
