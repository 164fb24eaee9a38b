"""lightning_ckpt: activation checkpointing as a scheduling decision, for PyTorch Lightning.

The layers, each a subpackage (data flows down this list; only the last imports Lightning):

- :mod:`lightning_ckpt.core` — find the blocks, policies, checkpoint the blocks in place;
- :mod:`lightning_ckpt.measure` — the live-tensor tracker, the per-step meter, the ledger;
- :mod:`lightning_ckpt.decide` — auto-toggle, budget, replay safety, equivalence, diagnosis and report;
- :mod:`lightning_ckpt.forecast` — memory forecasts from numbers or fake tensors, the profiler;
- :mod:`lightning_ckpt.lightning` — the engine and its two ways in, the callback and the strategies.

``import lightning_ckpt`` is cheap: the names below load on first use, and the ``*_ac`` strategies
(``single_device_ac``, ``ddp_ac``, ``ddp_spawn_ac``, ``ddp_fork_ac``, ``fsdp_ac``) are registered in Lightning's
``StrategyRegistry`` as soon as Lightning is loaded (at once if it already is), so ``Trainer(strategy="ddp_ac")``
works after ``import lightning_ckpt`` in either order.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "ActivationCheckpointing": "lightning_ckpt.lightning.callback",
    "ActivationCheckpointingMixin": "lightning_ckpt.lightning.strategy",
    "CheckpointPlan": "lightning_ckpt.core.wrap",
    "DDPActivationCheckpointingStrategy": "lightning_ckpt.lightning.strategy",
    "EquivalenceError": "lightning_ckpt.decide.verify",
    "FSDPActivationCheckpointingStrategy": "lightning_ckpt.lightning.strategy",
    "ForeignCheckpointingError": "lightning_ckpt.core.wrap",
    "Ledger": "lightning_ckpt.measure.ledger",
    "OutOfMemoryDiagnosis": "lightning_ckpt.decide.diagnosis",
    "ReplaySafetyError": "lightning_ckpt.decide.safety",
    "SingleDeviceActivationCheckpointingStrategy": "lightning_ckpt.lightning.strategy",
    "StepMeter": "lightning_ckpt.measure.meter",
    "apply_policy": "lightning_ckpt.core.wrap",
    "find_blocks": "lightning_ckpt.core.blocks",
    "get_plan": "lightning_ckpt.core.wrap",
    "parse_policy": "lightning_ckpt.core.policy",
    "remove_checkpointing": "lightning_ckpt.core.wrap",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_ckpt' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_PUBLIC))


# ------------------------------------------------------------------------------- strategy registration


def _register_strategies() -> None:
    try:
        # the module registers them as it is imported; when its own import is what loaded Lightning, it is found
        # half-built here and registers them once it is done
        importlib.import_module("lightning_ckpt.lightning.strategy")
    except Exception as err:  # noqa: BLE001 - never break the user's import of Lightning
        warnings.warn(f"lightning_ckpt: could not register the *_ac strategies with Lightning ({err!r}); use the "
                      "ActivationCheckpointing callback, or import lightning_ckpt.lightning.strategy.", RuntimeWarning,
                      stacklevel=2)


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Runs :func:`_register_strategies` right after ``lightning.pytorch`` has finished importing."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "lightning.pytorch":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _uninstall()
            _register_strategies()

        spec.loader.exec_module = exec_module  # this spec's own loader instance: nothing else is affected
        return spec


def _uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterWhenLightningLoads)]


if getattr(sys.modules.get("lightning.pytorch"), "Trainer", None) is not None:
    _register_strategies()
elif not any(isinstance(f, _RegisterWhenLightningLoads) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())

