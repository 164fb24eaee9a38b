"""A griffe extension: the package's docstrings use a little reStructuredText inside Google style; render it.

The code's docstrings are Google style (``Args:``, ``Returns:``, ``Attributes:``), which mkdocstrings parses, but
their prose uses three reStructuredText forms that Markdown does not know:

- Sphinx roles (``:func:`plan_budget```, ``:class:`~lightning_ckpt.core.wrap.CheckpointPlan```): each becomes a
  cross-reference to the object when griffe knows it (resolved like Sphinx would: from the object's own scope
  outwards), rendered as code; autorefs links it when that object has a page and leaves plain code otherwise
  (``optional``: a role that names something undocumented is not a broken link);
- simple tables (``====  ====`` borders): a Markdown table, or a list when the table has no header row;
- literal blocks introduced by ``::``: the ``::`` becomes ``:`` and the indented block stays an indented code block.

Nested bullet lists indented by two spaces get the four spaces Python-Markdown needs, and an ``Args:`` entry that
documents several parameters at once (``micro_batch, seq_len: the batch shape``, as numpy style allows and griffe's
Google parser does not) becomes one entry per parameter with the same text (a ``...`` among the names is dropped).

Loaded by mkdocs.yml (``extensions: - docs/_ext/rst_docstrings.py``); it changes what the site shows, never the
code.
"""

from __future__ import annotations

import ast
import re
from typing import Any, Callable, Dict, Iterator, List, Optional

import griffe

_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|data|attr|exc|obj|const):`(?P<target>[^`]+)`")
_BORDER = re.compile(r"^(?P<indent> *)=+(?: +=+)+ *$")
_NESTED_ITEM = re.compile(r"^( {2,3})([-*] )")
_ARGS_SECTION = re.compile(
    r"^(?P<indent> *)(?:Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters):$")
_MULTI_NAME = re.compile(
    r"^(?P<indent> +)(?P<names>[\w*]+(?: *, *(?:[\w*]+|\.\.\.))+)(?P<rest>(?: *\([^)]*\))?:(?: .*)?)$")


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


def _resolver(obj: griffe.Object, lookup: Callable[[str], Optional[str]]) -> Callable[[re.Match], str]:
    def replace(match: re.Match) -> str:
        target = match["target"].strip()
        short = target.startswith("~")
        target = target.lstrip("~").removesuffix("()")
        title = target.rsplit(".", 1)[-1] if short else target
        path = None
        scope: Optional[griffe.Object] = obj
        while scope is not None and path is None:  # the object's own scope outwards, then absolute
            path = lookup(f"{scope.path}.{target}")
            scope = scope.parent
        path = path or lookup(target)
        if path is None:
            return f"`{title}`"
        return f'<autoref identifier="{path}" optional>`{title}`</autoref>'

    return replace


def _cells(line: str, spans: List[tuple]) -> List[str]:
    cells = []
    for i, (start, _stop) in enumerate(spans):
        end = None if i == len(spans) - 1 else spans[i + 1][0]
        cells.append(line[start:end].strip() if len(line) > start else "")
    return cells


def _join(parts: List[str]) -> str:
    text = ""
    for part in parts:
        if not part:
            continue
        # a cell's words wrapped inside an identifier or a path (``scaled_dot_`` / ``product``) join without a space
        glued = not text or text.endswith(("-", "_", "/")) or part.startswith(".")
        text = f"{text}{part}" if glued else f"{text} {part}"
    return text.replace("|", r"\|")


def _table(lines: List[str], start: int) -> Optional[tuple]:
    """The simple table whose top border is ``lines[start]``: (markdown lines, index after it), or None."""
    border = _BORDER.match(lines[start])
    if not border:
        return None
    indent = border["indent"]
    spans = [(m.start(), m.end()) for m in re.finditer(r"=+", lines[start])]
    borders = [start]
    i = start + 1
    while i < len(lines):
        if lines[i].strip() == "":
            return None  # simple tables have no blank lines here; not a table we understand
        if lines[i].strip() and set(lines[i].strip()) <= {"=", " "} and _BORDER.match(lines[i]):
            borders.append(i)
            if len(borders) == 3 or (len(borders) == 2 and not _has_border_after(lines, i)):
                break
        i += 1
    else:
        return None
    rows: List[List[List[str]]] = []
    header_rows = 0
    for j in range(start + 1, borders[-1]):
        if j in borders:
            header_rows = len(rows)
            continue
        cells = _cells(lines[j], spans)
        if rows and not cells[0]:  # a continuation line: its first column is blank
            for k, cell in enumerate(cells):
                rows[-1][k].append(cell)
        else:
            rows.append([[cell] for cell in cells])
    joined = [[_join(cell) for cell in row] for row in rows]
    out: List[str] = []
    if len(borders) == 3 and header_rows:
        head, body = joined[:header_rows], joined[header_rows:]
        out.append(indent + "| " + " | ".join(" ".join(r[k] for r in head).strip() for k in range(len(spans))) + " |")
        out.append(indent + "|" + "---|" * len(spans))
        out += [indent + "| " + " | ".join(row) + " |" for row in body]
    else:  # no header row: a list, the first column as written
        out += [f"{indent}- {row[0]}: " + " ".join(c for c in row[1:] if c) for row in joined]
    return [""] + out + [""], borders[-1] + 1


def _has_border_after(lines: List[str], i: int) -> bool:
    for line in lines[i + 1:]:
        if not line.strip():
            return False
        if _BORDER.match(line):
            return True
    return False


def _split_multi_names(lines: List[str]) -> List[str]:
    """``a, b: text`` entries of an ``Args:`` section, one entry per name (continuation lines repeated)."""
    out: List[str] = []
    section: Optional[int] = None
    i = 0
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        if line.strip() and section is not None and indent <= section:
            section = None
        header = _ARGS_SECTION.match(line)
        if header:
            section = len(header["indent"])
        multi = _MULTI_NAME.match(line) if section is not None else None
        if multi is None:
            out.append(line)
            i += 1
            continue
        entry_indent = len(multi["indent"])
        j = i + 1
        while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > entry_indent:
            j += 1
        for name in (n.strip() for n in multi["names"].split(",")):
            if name != "...":
                out += [f"{multi['indent']}{name}{multi['rest']}", *lines[i + 1:j]]
        i = j
    return out


def convert(text: str, resolve: Callable[[re.Match], str]) -> str:
    """The docstring ``text`` with roles, simple tables, ``::`` blocks and 2-space nested lists made Markdown."""
    lines = _split_multi_names(text.split("\n"))
    out: List[str] = []
    i = 0
    while i < len(lines):
        table = _table(lines, i) if _BORDER.match(lines[i]) else None
        if table is not None:
            out += table[0]
            i = table[1]
            continue
        line = lines[i]
        if line.rstrip().endswith("::") and i + 1 < len(lines) and not lines[i + 1].strip():
            stripped = line.rstrip()[:-2].rstrip()
            line = stripped + ":" if stripped else ""
        line = _NESTED_ITEM.sub(lambda m: "    " + m[2], line)
        out.append(line)
        i += 1
    return _ROLE.sub(resolve, "\n".join(out))


def _public_names(pkg: griffe.Module) -> Dict[str, str]:
    """``{name: defining module}`` from the package's ``_PUBLIC`` dict (its lazily loaded ``__all__``)."""
    table = pkg.members.get("_PUBLIC")
    try:
        value = ast.literal_eval(str(table.value)) if table is not None else {}
    except (ValueError, SyntaxError):
        return {}
    return value if isinstance(value, dict) else {}


class RstDocstrings(griffe.Extension):
    """Rewrite every docstring of the loaded package once its object tree is complete."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        public = _public_names(pkg)

        def lookup(path: str) -> Optional[str]:
            head, _, name = path.rpartition(".")
            if head == pkg.path and name in public:  # a lazily exported top-level name: where it is defined
                path = f"{public[name]}.{name}"
            try:
                found = loader.modules_collection.get_member(path)
            except Exception:  # noqa: BLE001 - any failure of the lookup means "not known"
                return None
            return found.path if found is not None else None

        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = convert(obj.docstring.value, _resolver(obj, lookup))
