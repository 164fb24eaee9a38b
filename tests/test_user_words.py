"""What a user reads is in the user's words (issue 34): the report's JSON, the messages the package raises or prints,
and the pages of the docs say "policy" and "way", not the project's own words for them ("rung", "door", "the seed").
Internal identifiers (``next_rung``, the ``seed`` part of gpu_check) stay as they are."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

from lightning_ckpt.lightning.gate import ShapeGate

ROOT = Path(__file__).resolve().parents[1]
JARGON = re.compile(r"\b(rungs?|doors?|seed's|the seed|seed essay)\b", re.IGNORECASE)
DEVELOPER_PAGES = {"contributing.md"}  # written for those who work on the package, in its own words


def _docstrings(tree: ast.AST) -> set:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, nodes) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _attribute_docs(tree: ast.AST) -> set:
    """A string right after an assignment documents that name (read by Sphinx, not printed)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for before, after in zip(body, body[1:]):
                if isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(after, ast.Expr) and \
                        isinstance(after.value, ast.Constant):
                    found.add(id(after.value))
    return found


def test_the_reports_shape_gate_names_each_buckets_policy():
    """The report's ``shape_gate`` said ``{"rung": "all", ...}`` per bucket."""
    port = SimpleNamespace(settings=SimpleNamespace(ladder=("none", "every:2", "all")))
    gate = ShapeGate.__new__(ShapeGate)
    gate.port, gate.threshold, gate._unit = port, 1024, 1.0
    gate.needed, gate.predicted = {(4, 256): 2, (4, 128): 1}, {(4, 256): 900, (4, 128): 700}
    buckets = gate.report()["buckets"]
    assert buckets == {str((4, 128)): {"policy": "every:2", "predicted_peak": 700},
                       str((4, 256)): {"policy": "all", "predicted_peak": 900}}


def test_no_message_of_the_package_uses_the_projects_jargon():
    """Every string the code can print or raise (docstrings and attribute notes aside) is free of "rung", "door"
    and "the seed" (old: "is not a rung of ladder", "a budget policy cannot be a rung", "the seed's arithmetic")."""
    found = []
    for path in sorted((ROOT / "lightning_ckpt").rglob("*.py")):
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree) | _attribute_docs(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip and \
                    JARGON.search(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:80]!r}")
    assert not found, "\n".join(found)


def test_no_users_page_uses_the_projects_jargon():
    """README and docs/ (the contributors' page aside) say "policy", "way" and "a worked example"."""
    pages = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name not in DEVELOPER_PAGES)
    found = [f"{page.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for page in pages
             for n, line in enumerate(page.read_text().splitlines(), 1) if JARGON.search(line)]
    assert not found, "\n".join(found)


def _rendered_docstrings(path: Path):
    """The docstrings the API pages render from ``path``: the module's, and those of its public classes, functions
    and methods (mkdocstrings leaves names that start with an underscore out)."""
    tree = ast.parse(path.read_text())
    found = [(1, ast.get_docstring(tree))]

    def visit(body):
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
                found.append((node.lineno, ast.get_docstring(node)))
                if isinstance(node, ast.ClassDef):
                    visit(node.body)
            elif isinstance(node, ast.FunctionDef) and node.name == "__init__":
                found.append((node.lineno, ast.get_docstring(node)))

    visit(tree.body)
    return [(n, doc) for n, doc in found if doc]


def test_no_docstring_the_api_pages_or_the_cli_help_show_uses_the_projects_jargon():
    """The API pages render the docstrings of the modules they name (and LightningCLI's help reads the callback's):
    the seed, its "arithmetic" and "advice" reached the callback's docstring and the anatomy's page; the report's
    JSON said ``seed_arithmetic``."""
    modules = {m for page in (ROOT / "docs" / "api").glob("*.md")
               for m in re.findall(r"^::: (lightning_ckpt[\w.]*)", page.read_text(), re.MULTILINE)}
    assert "lightning_ckpt.lightning.callback" in modules
    found = []
    paths = set()
    for name in modules:  # a module, or an object in one: its module's file
        parts = name.split(".")
        while parts:
            stem = ROOT.joinpath(*parts)
            found_file = next((f for f in (stem.with_suffix(".py"), stem / "__init__.py") if f.exists()), None)
            if found_file:
                paths.add(found_file)
                break
            parts.pop()
    for path in sorted(paths):
        for line, doc in _rendered_docstrings(path):
            for n, text in enumerate(doc.splitlines()):
                if JARGON.search(text):
                    found.append(f"{path.relative_to(ROOT)}:{line + n}: {text.strip()[:80]}")
    assert not found, "\n".join(found)
