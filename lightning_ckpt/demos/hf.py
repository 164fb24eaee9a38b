"""A tiny Hugging Face GPT-2 built from a config (never downloaded) and its Lightning wrapper.

``transformers`` is imported inside functions so that ``lightning_ckpt.demos`` imports without it.
The model exposes ``_no_split_modules = ["GPT2Block"]`` and keeps its blocks at
``model.transformer.h``, which is what the block finder's Hugging Face hint path looks for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule

from lightning_ckpt.demos.gpt import IGNORE_INDEX
from lightning_ckpt.demos.lightning_gpt import CausalLMMixin

if TYPE_CHECKING:  # pragma: no cover
    from transformers import GPT2LMHeadModel

__all__ = ["HFCausalLMModule", "tiny_gpt2", "tiny_llama"]


def tiny_gpt2(
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_positions: int = 128,
    vocab_size: int = 96,
    dropout: float = 0.1,
) -> GPT2LMHeadModel:
    """Build a randomly initialised ``GPT2LMHeadModel`` from a ``GPT2Config``; no network access.

    Args:
        n_layer: Number of ``GPT2Block`` modules.
        n_embd: Hidden width.
        n_head: Attention heads; must divide ``n_embd``.
        n_positions: Context length.
        vocab_size: Token ids; 96 matches :class:`~lightning_ckpt.demos.CharTokenizer`.
        dropout: Used for residual, embedding and attention dropout alike.

    Returns:
        The model, in training mode, with ``use_cache=False`` in its config.

    Raises:
        ImportError: If ``transformers`` is not installed.
    """
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "tiny_gpt2 needs Hugging Face transformers; install it with "
            "`pip install 'lightning_ckpt[examples]'` or `pip install transformers`."
        ) from err
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        vocab_size=vocab_size,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        # GPT-2's defaults (50256) lie outside a small vocabulary and make transformers warn.
        bos_token_id=0,
        eos_token_id=0,
        # A KV cache is useless in training and conflicts with recomputation.
        use_cache=False,
    )
    model = GPT2LMHeadModel(config)
    model.train()
    return model


def tiny_llama(n_layer: int = 4, n_embd: int = 64, n_head: int = 4, n_positions: int = 128, vocab_size: int = 96):
    """A randomly initialised ``LlamaForCausalLM`` from a ``LlamaConfig`` (RMSNorm, SwiGLU MLP of width
    ``8/3 × n_embd`` rounded to 32, rotary positions, ``sdpa`` attention); no network access, no dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    intermediate = -(-8 * n_embd // 3 // 32) * 32
    config = LlamaConfig(hidden_size=n_embd, intermediate_size=intermediate, num_hidden_layers=n_layer,
                         num_attention_heads=n_head, num_key_value_heads=n_head, vocab_size=vocab_size,
                         max_position_embeddings=n_positions, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         use_cache=False)
    model = LlamaForCausalLM(config)
    model.train()
    return model


class HFCausalLMModule(CausalLMMixin, LightningModule):
    """A ``LightningModule`` around :func:`tiny_gpt2`, with the same batch format as the GPT demo.

    The loss is computed here from ``labels`` that are already aligned with ``input_ids`` (see
    :mod:`lightning_ckpt.demos.lightning_gpt`); the labels are deliberately *not* handed to the
    Hugging Face model, which would shift them a second time.

    Args:
        n_layer: Number of ``GPT2Block`` modules.
        n_embd: Hidden width.
        n_head: Attention heads.
        n_positions: Context length.
        vocab_size: Token ids.
        dropout: Dropout probability (GPT-2 only).
        arch: ``"gpt2"`` (:func:`tiny_gpt2`) or ``"llama"`` (:func:`tiny_llama`).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay for matrices.
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_embd: int = 64,
        n_head: int = 4,
        n_positions: int = 128,
        vocab_size: int = 96,
        dropout: float = 0.1,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        arch: str = "gpt2",
    ) -> None:
        super().__init__()
        if arch not in ("gpt2", "llama"):
            raise ValueError(f"arch={arch!r} is not a demo architecture; choose 'gpt2' or 'llama'.")
        self.save_hyperparameters()
        shape = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions, vocab_size=vocab_size)
        self.model = tiny_gpt2(dropout=dropout, **shape) if arch == "gpt2" else tiny_llama(**shape)
        self.add_validation_metrics(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self.hparams.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.hparams.n_positions

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for ``input_ids``; the KV cache stays off."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def logits_and_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, T, vocab_size]`` and their mean cross-entropy against the already-shifted ``labels``."""
        logits = self(batch["input_ids"], batch.get("attention_mask"))
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1), ignore_index=IGNORE_INDEX
        )
        return logits, loss
