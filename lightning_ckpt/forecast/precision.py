"""Lightning's precision names, as what a forecast or a profile must do to reproduce them in plain PyTorch.

========================  =================================================================================
``32-true``               float32 parameters, no autocast
``bf16-mixed``            float32 parameters, ``torch.autocast(bfloat16)`` around the forward with the weight
                          cache **off** (Lightning's Trainer); ``bf16-mixed+cache``: cache on (``torch.autocast``'s
                          default, Fabric)
``16-mixed``              the same with float16 (``16-mixed+cache``: cache on)
``bf16-true``             bfloat16 parameters, no autocast (``16-true``: float16)
========================  =================================================================================
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager, Optional

import torch

__all__ = ["PRECISIONS", "Precision", "parse_precision"]


@dataclass(frozen=True)
class Precision:
    """What a Lightning precision name means for a step (see the module docstring)."""

    name: str
    autocast_dtype: Optional[torch.dtype] = None
    cache: bool = False
    param_dtype: Optional[torch.dtype] = None

    def forward_context(self, device_type: str = "cpu") -> ContextManager:
        """The context the forward (and the loss) runs in: autocast for the mixed precisions, nothing otherwise."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype, cache_enabled=self.cache)


_TABLE = {
    "32-true": Precision("32-true"),
    "bf16-mixed": Precision("bf16-mixed", torch.bfloat16),
    "bf16-mixed+cache": Precision("bf16-mixed+cache", torch.bfloat16, cache=True),
    "16-mixed": Precision("16-mixed", torch.float16),
    "16-mixed+cache": Precision("16-mixed+cache", torch.float16, cache=True),
    "bf16-true": Precision("bf16-true", param_dtype=torch.bfloat16),
    "16-true": Precision("16-true", param_dtype=torch.float16),
}
PRECISIONS = tuple(_TABLE)


def parse_precision(name: str, arg: str = "--precision") -> Precision:
    """``"bf16-mixed"`` → :class:`Precision`; a ``ValueError`` naming ``arg`` and listing the valid names."""
    key = str(name).strip().lower()
    if key not in _TABLE:
        raise ValueError(f"{arg}={name!r} is not a precision this forecast knows; choose one of {list(PRECISIONS)} "
                         "(Lightning's names; '+cache' keeps autocast's weight cache on, as Fabric and "
                         "torch.autocast do by default).")
    return _TABLE[key]
