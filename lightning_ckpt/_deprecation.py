"""Old names and old module paths, kept importable for one release with a ``DeprecationWarning``.

Two mechanisms, both lazy (nothing is imported until an old name is used):

- :func:`renamed` builds a module ``__getattr__`` that answers an old attribute name with the new object;
- :func:`install_module_aliases` lets ``import lightning_ckpt.wrap`` (a module that moved into a layer
  subpackage) load ``lightning_ckpt.core.wrap`` under the old name.

Remove both after the 0.2 release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable, Dict

__all__ = ["MOVED_MODULES", "install_module_aliases", "renamed"]

MOVED_MODULES: Dict[str, str] = {
    "lightning_ckpt.units": "lightning_ckpt.core.units",
    "lightning_ckpt.blocks": "lightning_ckpt.core.blocks",
    "lightning_ckpt.policy": "lightning_ckpt.core.policy",
    "lightning_ckpt.wrap": "lightning_ckpt.core.wrap",
    "lightning_ckpt.meter": "lightning_ckpt.measure.meter",
    "lightning_ckpt.ledger": "lightning_ckpt.measure.ledger",
    "lightning_ckpt.monitor": "lightning_ckpt.measure.monitor",
    "lightning_ckpt.controller": "lightning_ckpt.decide.controller",
    "lightning_ckpt.budget": "lightning_ckpt.decide.budget",
    "lightning_ckpt.safety": "lightning_ckpt.decide.safety",
    "lightning_ckpt.verify": "lightning_ckpt.decide.verify",
    "lightning_ckpt.oom": "lightning_ckpt.decide.diagnosis",
    "lightning_ckpt.report": "lightning_ckpt.decide.report",
    "lightning_ckpt.planner": "lightning_ckpt.forecast.numbers",
    "lightning_ckpt.trace": "lightning_ckpt.forecast.trace",
    "lightning_ckpt.profile": "lightning_ckpt.forecast.profile",
    "lightning_ckpt.callback": "lightning_ckpt.lightning.callback",
    "lightning_ckpt.strategy": "lightning_ckpt.lightning.strategy",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in lightning_ckpt 0.2; use {new}.", DeprecationWarning,
                  stacklevel=3)


def renamed(module: str, names: Dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__``: ``names`` maps an old attribute to ``"package.module:new_name"``."""

    def __getattr__(name: str) -> Any:
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, _, new = target.partition(":")
        _warn(f"{module}.{name}", f"{where}.{new}")
        return getattr(importlib.import_module(where), new)

    return __getattr__


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module under its old name: the module object is the new one (one copy of the code)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        _warn(f"module {spec.name}", new)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """Nothing to run: the new module was executed when it was imported."""


def install_module_aliases() -> None:
    """Let the old module paths import (idempotent)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
