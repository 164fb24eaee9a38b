"""Tokens and samples in a batch, counted without synchronizing the device."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch

__all__ = ["count_samples", "count_tokens", "sequence_length"]



_TOKEN_KEYS = ("input_ids", "tokens", "idx", "input")


def _first_tensor(x: Any) -> Optional[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, Mapping):
        values = list(x.values())
    elif isinstance(x, (tuple, list)):
        values = list(x)
    else:
        return None
    for v in values:
        t = _first_tensor(v)
        if t is not None:
            return t
    return None


def _token_tensor(batch: Any) -> Optional[torch.Tensor]:
    if isinstance(batch, Mapping):
        for key in _TOKEN_KEYS:
            t = batch.get(key)
            if isinstance(t, torch.Tensor):
                return t
        for t in batch.values():
            if isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex():
                return t
    return _first_tensor(batch)


def sequence_length(batch: Any) -> Optional[int]:
    """The token tensor's last dimension (``None`` for a batch without a 2-D token tensor)."""
    t = _token_tensor(batch)
    return int(t.shape[-1]) if t is not None and t.dim() >= 2 else None


def count_samples(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its token (or first) tensor; 0 when it holds no tensor."""
    t = _token_tensor(batch)
    if t is None:
        return 0
    return int(t.shape[0]) if t.dim() >= 1 else 1


def count_tokens(batch: Any, tokens_fn: Optional[Callable[[Any], Any]] = None) -> Union[int, torch.Tensor]:
    """Tokens in a batch, never synchronizing the device.

    - ``tokens_fn(batch)`` when given (its result is returned as is, or as ``int`` if it is a Python number);
    - a mapping with a 2-D ``attention_mask``: its non-zero entries (non-padding tokens);
    - otherwise the token tensor's size: ``input_ids`` (or ``tokens``/``idx``/``input``, else the first integer
      tensor) of a mapping, the first tensor of a tuple/list, or the tensor itself; ``numel`` for 1-D/2-D
      tensors, ``shape[0] * shape[1]`` for wider ones (e.g. ``[B, T, C]`` embeddings).

    Returns:
        An ``int`` when the count is known on the host (sizes, CPU masks), else a 0-dim ``int64`` tensor on the
        mask's device, computed asynchronously: add such counts up and call ``int()`` only on logging steps.
    """
    if tokens_fn is not None:
        n = tokens_fn(batch)
        return n if isinstance(n, torch.Tensor) else int(n)
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            total = torch.count_nonzero(mask)
            return int(total) if total.device.type == "cpu" else total
    t = _token_tensor(batch)
    if t is None:
        return 0
    if t.dim() <= 2:
        return int(t.numel())
    return int(t.shape[0] * t.shape[1])
