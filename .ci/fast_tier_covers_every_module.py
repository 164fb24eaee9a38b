"""CI check: the fast tier (``pytest -m "not slow"``) runs code of every module of ``lightning_ckpt``.

Reads the JSON report of ``coverage run --source=lightning_ckpt -m pytest -m "not slow"`` (``coverage json``) and
exits 1 naming each module no fast test executed a line of: the edit-test loop must reach every module.
"""

from __future__ import annotations

import json
import pathlib
import sys


def main(report: str) -> int:
    files = json.loads(pathlib.Path(report).read_text())["files"]
    package = pathlib.Path(__file__).resolve().parents[1] / "lightning_ckpt"
    modules = sorted(p.relative_to(package.parent).as_posix() for p in package.rglob("*.py"))
    # a module without statements (an empty __init__.py) has nothing to run: importing it is running it
    covered = {pathlib.Path(name).as_posix() for name, data in files.items()
               if data["summary"]["covered_lines"] or not data["summary"]["num_statements"]}
    missing = [m for m in modules if not any(c.endswith(m) for c in covered)]
    for module in missing:
        print(f"the fast tier runs no line of {module}: add a test without the slow marker")
    print(f"fast tier: {len(modules) - len(missing)} of {len(modules)} modules run")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "coverage.json"))
