"""Model factories for ``lightning-ckpt plan --model`` and the tests: the demo GPTs and Hugging Face configs.

``lightning-ckpt plan --model lightning_ckpt.demos.factories:llama_7b_config --seq-len 4096`` forecasts a 7B
Llama on a laptop (built under fake tensors, nothing allocated).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["benchmark_gpt", "gpt2_config", "llama_7b_config", "tiny_gpt"]


def benchmark_gpt(**overrides: Any) -> nn.Module:
    """The demo benchmark GPT (12 blocks, width 512, 8 heads, context 512, vocab 512); fields overridable."""
    from lightning_ckpt.demos.gpt import GPT, GPTConfig

    return GPT(GPTConfig.benchmark(**overrides))


def tiny_gpt(**overrides: Any) -> nn.Module:
    """The demo tiny GPT (4 blocks, width 64, context 64, vocab 96); fields overridable."""
    from lightning_ckpt.demos.gpt import GPT, GPTConfig

    return GPT(GPTConfig.tiny(**overrides))


def gpt2_config(n_layer: int = 4, n_embd: int = 64, n_head: int = 4, n_positions: int = 128, vocab_size: int = 96,
                dropout: float = 0.1, **extra: Any):
    """A Hugging Face ``GPT2Config`` with the demo's defaults (:func:`lightning_ckpt.demos.hf.tiny_gpt2`).

    ``gpt2_config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)`` is GPT-2 small.
    """
    from transformers import GPT2Config

    return GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions, vocab_size=vocab_size,
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
                      use_cache=False, **extra)


def llama_7b_config(**overrides: Any):
    """A Hugging Face ``LlamaConfig`` of the 7-billion-parameter Llama-2 shape (6.74 B parameters)."""
    from transformers import LlamaConfig

    base = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
    return LlamaConfig(**{**base, **overrides})

