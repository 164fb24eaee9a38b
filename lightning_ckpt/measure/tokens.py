"""Tokens and samples in a batch, counted without synchronizing the device.

The rule for tokens: a batch has tokens only when it carries **token ids** or an **attention mask**.

- Token ids are an integer tensor of exactly two dimensions, ``[batch, sequence]``: in a mapping the value of
  ``input_ids`` (or ``tokens``, ``idx``, ``input``), else any other 2-D integer value (``labels`` of a captioning
  batch); in a tuple or list the first 2-D integer tensor, depth first; or the batch itself.
- An attention mask is a mapping's 2-D ``attention_mask`` (integer or bool), at any depth of the batch (the first
  found, depth first: ``({"input_ids": ..., "attention_mask": ...}, labels)`` has one): its non-zero entries are the
  tokens (padding left out), and it takes precedence over the ids' size.
- Anything else has no sequence dimension and so no tokens: a float image batch ``[B, C, H, W]`` (its ``shape[1]``
  is channels, not positions), a float waveform or embeddings, a 1-D integer tensor (class labels), a 3-D integer
  tensor (segmentation masks). Such steps log ``samples/s`` and no ``tokens/s``; pass ``tokens_fn`` to count
  tokens of your own.

Samples are the leading dimension of the token tensor, else of the batch's first tensor (the images).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional, Union

import torch

__all__ = ["count_samples", "count_tokens", "sequence_length"]

_TOKEN_KEYS = ("input_ids", "tokens", "idx", "input")


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a batch, depth first (a mapping's values, a tuple's or list's items, or the tensor)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)


def _is_token_ids(t: Any) -> bool:
    """An integer ``[batch, sequence]`` tensor (bool is a mask, float is data: neither is ids)."""
    return (isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype != torch.bool and not t.is_floating_point()
            and not t.is_complex())


def _mask(batch: Any) -> Optional[torch.Tensor]:
    """The first 2-D ``attention_mask`` of a mapping in the batch, depth first (a nested ``(inputs, labels)`` one
    too), or ``None``."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            return mask
        items = batch.values()
    elif isinstance(batch, (tuple, list)):
        items = batch
    else:
        return None
    return next((m for m in map(_mask, items) if m is not None), None)


def _token_ids(batch: Any) -> Optional[torch.Tensor]:
    """The batch's token ids by the module's rule, or ``None``."""
    if isinstance(batch, Mapping):
        for key in _TOKEN_KEYS:
            if _is_token_ids(batch.get(key)):
                return batch[key]
    return next((t for t in _tensors(batch) if _is_token_ids(t)), None)


def sequence_length(batch: Any) -> Optional[int]:
    """The sequence dimension of the token ids (or attention mask); ``None`` for a batch without one."""
    t = _token_ids(batch)
    if t is None:
        t = _mask(batch)
    return int(t.shape[-1]) if t is not None else None


def count_samples(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its token ids, else of its first tensor; 0 without a tensor."""
    t = _token_ids(batch)
    if t is None:
        t = next(_tensors(batch), None)
    if t is None:
        return 0
    return int(t.shape[0]) if t.dim() >= 1 else 1


def count_tokens(batch: Any, tokens_fn: Optional[Callable[[Any], Any]] = None) -> Union[int, torch.Tensor, None]:
    """Tokens in a batch by the module's rule, never synchronizing the device.

    - ``tokens_fn(batch)`` when given (its result is returned as is, or as ``int`` if it is a Python number);
    - a 2-D ``attention_mask`` in a mapping, at any depth: its non-zero entries (non-padding tokens);
    - token ids (a 2-D integer tensor): their ``numel``;
    - ``None`` for a batch without a sequence dimension (images, waveforms, embeddings): it has samples, no tokens.

    Returns:
        An ``int`` when the count is known on the host (sizes, CPU masks), else a 0-dim ``int64`` tensor on the
        mask's device, computed asynchronously: add such counts up and call ``int()`` only on logging steps.
        ``None`` when the batch has no tokens.
    """
    if tokens_fn is not None:
        n = tokens_fn(batch)
        return n if isinstance(n, torch.Tensor) else int(n)
    mask = _mask(batch)
    if mask is not None:
        total = torch.count_nonzero(mask)
        return int(total) if total.device.type == "cpu" else total
    t = _token_ids(batch)
    return int(t.numel()) if t is not None else None
