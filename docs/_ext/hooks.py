"""MkDocs hooks: pages that show a file of the repository kept outside ``docs/`` (the changelog, the frontier history).

A page line ``--8<-- "CHANGELOG.md"`` (the snippet syntax, a path from the repository root) is replaced by that
file's text when the page is read, with the file's relative links re-rooted: a link to a file under ``docs/``
points to its page, a link to the README points to the home page (the README's content lives in these pages), and
any other relative link is left as written, so ``mkdocs build --strict`` reports it if it does not resolve. The
file stays the one source: the site shows it as it is at build time.
"""

from __future__ import annotations

import os
import re
from typing import Any

_INCLUDE = re.compile(r'^--8<-- "(?P<path>[^"]+)"[ \t]*$', re.MULTILINE)
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _rebase(target: str, source_dir: str, docs_dir: str, page_dir: str, root: str) -> str:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return target  # absolute URL, mailto:, an anchor of the same page, or site-absolute
    path, _, anchor = target.partition("#")
    where = os.path.normpath(os.path.join(source_dir, path))
    if where.startswith(docs_dir + os.sep):
        rebased = os.path.relpath(where, page_dir)
        return rebased + (f"#{anchor}" if anchor else "")
    if where == os.path.join(root, "README.md"):
        return os.path.relpath(os.path.join(docs_dir, "index.md"), page_dir)
    return target


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs_dir = os.path.normpath(config["docs_dir"])
    root = os.path.dirname(os.path.normpath(config["config_file_path"]))
    page_dir = os.path.dirname(os.path.join(docs_dir, page.file.src_path))

    def include(match: re.Match) -> str:
        source = os.path.join(root, match["path"])
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
        source_dir = os.path.dirname(source)
        return _LINK.sub(lambda m: f"]({_rebase(m['target'], source_dir, docs_dir, page_dir, root)})", text)

    return _INCLUDE.sub(include, markdown)
