"""Demo models and data for ``lightning_ckpt``: a small GPT, a tiny Hugging Face GPT-2, text, model factories.

``gpt`` and ``factories`` are plain PyTorch; ``lightning_gpt`` and ``hf`` are the Lightning wrappers. Names load
on first use, so ``lightning_ckpt.demos.gpt`` does not import Lightning, and Hugging Face ``transformers`` is
imported only when :func:`tiny_gpt2`, :class:`HFCausalLMModule` or a config factory is used. All demo batches are
dicts ``{"input_ids", "labels"[, "attention_mask"]}`` with ``labels`` already shifted by one.
"""

import importlib
from typing import Any

_WHERE = {
    "GPT": "gpt", "MLP": "gpt", "Block": "gpt", "CausalSelfAttention": "gpt", "GPTConfig": "gpt",
    "HFCausalLMModule": "hf", "tiny_gpt2": "hf", "tiny_llama": "hf",
    "DEFAULT_TEXT": "lightning_gpt", "CausalLMMixin": "lightning_gpt", "CharDataModule": "lightning_gpt",
    "CharTokenizer": "lightning_gpt", "CharWindows": "lightning_gpt", "GPTLightningModule": "lightning_gpt",
    "benchmark_gpt": "factories", "tiny_gpt": "factories", "gpt2_config": "factories",
    "llama_7b_config": "factories",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'lightning_ckpt.demos' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_ckpt.demos.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_WHERE))
