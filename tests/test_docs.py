"""The documentation: its snippets run, its names exist, and the site builds.

- Every Python snippet of ``README.md`` and ``docs/`` runs here, on tiny models (:func:`_namespace`: ``model``,
  ``batch``, ``Trainer`` and the names a page takes from context), unless the line right before its fence is
  ``<!-- not-run: <why> -->``. Every name a page imports from ``lightning_ckpt`` exists, and a call written in
  running text (```verify_equivalence(...)```) never shows an internal name as if it were a top-level one.
- ``mkdocs build --strict`` passes (no warning, no broken internal link or anchor, no docstring entry for a
  parameter a signature lacks), every public name has its entry in the API reference, and the docstring converter
  (``docs/_ext/rst_docstrings.py``) turns the code's reStructuredText forms into Markdown. These are skipped when
  MkDocs (with Material and mkdocstrings) is not installed: ``pip install mkdocs mkdocs-material
  "mkdocstrings[python]"``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_HAVE_MKDOCS = all(importlib.util.find_spec(m) is not None for m in ("mkdocs", "material", "mkdocstrings_handlers"))

PAGES = ("index.html", "getting-started/index.html", "policies/index.html", "measurement/index.html",
         "auto-budget-oom/index.html", "compile-precision/index.html", "distributed/index.html",
         "diagnosis/index.html", "cli/index.html", "cpu-gpu/index.html", "benchmarks/index.html",
         "frontier-history/index.html", "contributing/index.html", "changelog/index.html", "api/index.html",
         "api/public/index.html", "api/decide.verify/index.html", "api/forecast.trace/index.html",
         "api/demos/index.html")


# ------------------------------------------------------------------------------------------------ runnable snippets

DOC_PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<why>\S.*?)\s*-->\s*$")


class Snippet(NamedTuple):
    page: str
    line: int  # of the opening fence, 1-based
    code: str
    not_run: Optional[str]  # the reason given in the marker before the fence

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _snippets(text: str, page: str) -> List[Snippet]:
    """The ``python`` fenced blocks of a Markdown page (indented ones inside tabs too), each with its marker."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, end = opening["indent"], i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if opening["lang"] == "python":
            body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = _NOT_RUN.match(before)
            found.append(Snippet(page, i + 1, "\n".join(body) + "\n", marker["why"] if marker else None))
        i = end + 1
    return found


SNIPPETS = [s for page in DOC_PAGES for s in _snippets(page.read_text(), str(page.relative_to(ROOT)))]


def test_the_snippet_reader_finds_fences_tabs_and_markers():
    text = "\n".join(["# t", "```python", "a = 1", "```", "", "<!-- not-run: needs a GPU -->", "```python",
                      "b = 2", "```", "```bash", "ls", "```", '=== "Tab"', "", "    ```python", "    c = 3",
                      "        d = 4", "    ```"])
    found = _snippets(text, "p.md")
    assert [(s.line, s.code, s.not_run) for s in found] == [
        (2, "a = 1\n", None), (7, "b = 2\n", "needs a GPU"), (15, "c = 3\n    d = 4\n", None)]


def test_the_pages_have_snippets_and_every_skipped_one_says_why():
    assert len(SNIPPETS) >= 10, [s.id for s in SNIPPETS]
    for snippet in SNIPPETS:
        assert snippet.not_run is None or len(snippet.not_run) > 5, snippet.id


def _imports(code: str) -> List[tuple]:
    """``(module, name)`` for every ``from lightning_ckpt... import name`` and ``(module, None)`` for
    ``import lightning_ckpt...``."""
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning_ckpt":
            out += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "lightning_ckpt"]
    return out


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_every_name_a_snippet_imports_exists(snippet):
    for module, name in _imports(snippet.code):
        imported = importlib.import_module(module)
        assert name is None or hasattr(imported, name), \
            f"{snippet.id}: `from {module} import {name}` fails: {module} has no {name!r}"


def _defined_in_package() -> Dict[str, str]:
    """Every module-level function and class of ``lightning_ckpt``: name -> the module defining it."""
    names: Dict[str, str] = {}
    for path in sorted((ROOT / "lightning_ckpt").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                names.setdefault(node.name, module)
    return names


def _prose(text: str) -> str:
    """A page without its fenced blocks (inline code only)."""
    return re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)


def test_running_text_shows_internal_functions_with_the_module_they_come_from():
    """A call written in running text as a bare name (`verify_equivalence(...)`) reads as `from lightning_ckpt import
    ...`, which fails for a name that is not public: such names are written with their module
    (`lightning_ckpt.decide.verify.verify_equivalence(...)`)."""
    import lightning_ckpt

    internal = {n: m for n, m in _defined_in_package().items() if n not in lightning_ckpt.__all__}
    wrong = []
    for page in DOC_PAGES:
        for match in re.finditer(r"`(?:from (?P<mod>lightning_ckpt\S*) import (?P<imp>\w+)|(?P<call>\w+)\()",
                                 _prose(page.read_text())):
            if match["call"] in internal:
                wrong.append(f"{page.relative_to(ROOT)}: `{match['call']}(` is "
                             f"`{internal[match['call']]}.{match['call']}`")
            elif match["imp"] and not hasattr(importlib.import_module(match["mod"]), match["imp"]):
                wrong.append(f"{page.relative_to(ROOT)}: `from {match['mod']} import {match['imp']}` fails")
    assert not wrong, wrong


def _doc_model():
    """The ``model`` of the snippets: the demo GPT with 12 tiny blocks and a two-batch training set."""
    from lightning_ckpt.demos.lightning_gpt import GPTLightningModule

    class DocGPT(GPTLightningModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader([self.example_batch(2, 16)] * 2, batch_size=None)

    torch.manual_seed(0)
    return DocGPT(n_layer=12, n_head=2, n_embd=16, block_size=16)


def _quiet_trainer(tmp_path):
    """``Trainer`` on the CPU for two steps, quiet; the snippet's own arguments win (``devices=2`` builds a
    trainer that is never fitted)."""
    import lightning.pytorch as pl

    class DocTrainer(pl.Trainer):
        def __init__(self, **kwargs):
            settings = dict(accelerator="cpu", max_steps=2, limit_val_batches=0, num_sanity_val_steps=0,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, default_root_dir=str(tmp_path))
            super().__init__(**{**settings, **kwargs})

    return DocTrainer


def _namespace(tmp_path) -> dict:
    """What a snippet may use without importing it: the names its page takes from context."""
    import lightning.pytorch as pl

    from lightning_ckpt import ActivationCheckpointing

    model = _doc_model()
    return {"__name__": "__doc_snippet__", "torch": torch, "nn": torch.nn, "Trainer": _quiet_trainer(tmp_path),
            "LightningModule": pl.LightningModule, "ActivationCheckpointing": ActivationCheckpointing,
            "model": model, "batch": model.example_batch(2, 16)}


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.not_run is None], ids=lambda s: s.id)
def test_every_snippet_runs(snippet, tmp_path, monkeypatch):
    import lightning
    import lightning.pytorch

    namespace = _namespace(tmp_path)
    for module in (lightning, lightning.pytorch):  # `from lightning.pytorch import Trainer` gets the quiet one too
        monkeypatch.setattr(module, "Trainer", namespace["Trainer"])
    monkeypatch.chdir(tmp_path)  # TensorBoardLogger("runs") and friends write here
    code = compile(snippet.code, snippet.id, "exec")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice for tiny CPU runs is not the page's business
        exec(code, namespace)  # noqa: S102 - the documentation's own code


# ------------------------------------------------------------------------------------------------------ the site


def _converter():
    pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location("rst_docstrings", ROOT / "docs" / "_ext" / "rst_docstrings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if not _HAVE_MKDOCS:
        pytest.skip("mkdocs, mkdocs-material and mkdocstrings[python] are not installed")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-6000:]
    return out


@pytest.mark.slow
def test_the_site_builds_strict_with_every_page(site):
    missing = [page for page in PAGES if not (site / page).is_file()]
    assert not missing, missing
    home = (site / "index.html").read_text()
    assert "ActivationCheckpointing" in home and "getting-started/" in home
    assert (site / "frontier.png").is_file() and (site / "memory_curves.png").is_file()
    assert "## [0.1.0]" not in (site / "changelog/index.html").read_text()  # CHANGELOG.md rendered, not raw
    assert "0.1.0" in (site / "changelog/index.html").read_text()


@pytest.mark.slow
def test_every_public_name_has_an_entry_in_the_api_reference(site):
    import lightning_ckpt

    public = (site / "api/public/index.html").read_text()
    anchors = set(re.findall(r'id="(lightning_ckpt\.[\w.]+)"', public))
    missing = [name for name in lightning_ckpt.__all__
               if f"{lightning_ckpt._PUBLIC[name]}.{name}" not in anchors]
    assert not missing, f"add these to docs/api/public.md: {missing}"


def test_sphinx_roles_become_cross_references_or_code():
    conv = _converter()
    known = {"pkg.mod.Plan"}

    def resolve(match):
        target = match["target"].lstrip("~")
        title = target.rsplit(".", 1)[-1] if match["target"].startswith("~") else target
        if target in known:
            return f'<autoref identifier="{target}" optional>`{title}`</autoref>'
        return f"`{title}`"

    text = conv.convert("See :class:`~pkg.mod.Plan` and :func:`elsewhere` and ``code``.", resolve)
    assert text == 'See <autoref identifier="pkg.mod.Plan" optional>`Plan`</autoref> and `elsewhere` and ``code``.'


def test_simple_tables_become_markdown_tables_or_lists():
    conv = _converter()
    headed = conv.convert("\n".join([
        "Intro:",
        "",
        "======  ===========",
        "mode    meaning",
        "======  ===========",
        "``a``   first line",
        "        continued",
        "``b``   second",
        "======  ===========",
        "",
        "After.",
    ]), lambda m: m[0])
    assert "| mode | meaning |" in headed
    assert "| ``a`` | first line continued |" in headed
    assert "| ``b`` | second |" in headed
    assert headed.rstrip().endswith("After.")
    headless = conv.convert("\n".join(["====  ======", "``x``  the x", "``y``  the y", "====  ======"]),
                            lambda m: m[0])
    assert "- ``x``: the x" in headless and "- ``y``: the y" in headless


def test_literal_blocks_nested_lists_and_multi_name_args():
    conv = _converter()
    literal = conv.convert("Use it like this::\n\n    x = 1\n", lambda m: m[0])
    assert literal.startswith("Use it like this:\n\n    x = 1")
    nested = conv.convert("- outer\n\n  - inner\n", lambda m: m[0])
    assert "\n    - inner" in nested
    args = conv.convert("Summary.\n\nArgs:\n    a, b: the shape\n        continued.\n    c: alone.\n", lambda m: m[0])
    assert "    a: the shape\n        continued.\n    b: the shape\n        continued.\n    c: alone." in args
    dots = conv.convert("Args:\n    policy, blocks, ...: as the callback's.\n", lambda m: m[0])
    assert "    policy: as the callback's.\n    blocks: as the callback's." in dots and "..." not in dots
