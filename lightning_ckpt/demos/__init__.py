"""Demo models and data for ``lightning_ckpt``: a small GPT, a tiny Hugging Face GPT-2, and text.

``gpt`` is plain PyTorch; ``lightning_gpt`` and ``hf`` are the Lightning wrappers. Hugging Face
``transformers`` is imported only when :func:`tiny_gpt2` or :class:`HFCausalLMModule` is used.
All demo batches are dicts ``{"input_ids", "labels"[, "attention_mask"]}`` with ``labels`` already
shifted by one.
"""

from lightning_ckpt.demos.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from lightning_ckpt.demos.hf import HFCausalLMModule, tiny_gpt2
from lightning_ckpt.demos.lightning_gpt import (
    DEFAULT_TEXT,
    CausalLMMixin,
    CharDataModule,
    CharTokenizer,
    CharWindows,
    GPTLightningModule,
)

__all__ = [
    "DEFAULT_TEXT",
    "GPT",
    "MLP",
    "Block",
    "CausalLMMixin",
    "CausalSelfAttention",
    "CharDataModule",
    "CharTokenizer",
    "CharWindows",
    "GPTConfig",
    "GPTLightningModule",
    "HFCausalLMModule",
    "tiny_gpt2",
]
