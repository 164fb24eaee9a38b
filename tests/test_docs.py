"""The documentation site: ``mkdocs build --strict`` passes (no warning, no broken internal link or anchor, no
docstring entry for a parameter a signature lacks), every public name has its entry in the API reference, and the
docstring converter (``docs/_ext/rst_docstrings.py``) turns the code's reStructuredText forms into Markdown.

Skipped when MkDocs (with Material and mkdocstrings) is not installed:
``pip install mkdocs mkdocs-material "mkdocstrings[python]"``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_HAVE_MKDOCS = all(importlib.util.find_spec(m) is not None for m in ("mkdocs", "material", "mkdocstrings_handlers"))

PAGES = ("index.html", "getting-started/index.html", "policies/index.html", "measurement/index.html",
         "auto-budget-oom/index.html", "compile-precision/index.html", "distributed/index.html",
         "diagnosis/index.html", "cli/index.html", "cpu-gpu/index.html", "benchmarks/index.html",
         "frontier-history/index.html", "contributing/index.html", "changelog/index.html", "api/index.html",
         "api/public/index.html", "api/decide.verify/index.html", "api/forecast.trace/index.html",
         "api/demos/index.html")


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
