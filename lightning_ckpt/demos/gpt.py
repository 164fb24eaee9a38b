"""A small GPT decoder in plain PyTorch, used as the demo and benchmark model.

The layout follows nanoGPT on purpose: the repeated blocks live in
``model.transformer.h`` (an ``nn.ModuleList`` of :class:`Block`), which is exactly the shape the
block finder in :mod:`lightning_ckpt.core.blocks` is meant to discover without any hints. Nothing here
imports Lightning.

Example:
    >>> import torch
    >>> model = GPT(GPTConfig.tiny())
    >>> idx = torch.randint(0, 96, (2, 16))
    >>> logits, loss = model(idx, targets=idx)
    >>> tuple(logits.shape)
    (2, 16, 96)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "GPTConfig"]

# Cross-entropy ignores this label, matching the Hugging Face convention for padding.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of :class:`GPT`; plain numbers only, so YAML and the CLI can carry them.

    Attributes:
        vocab_size: Number of token ids.
        n_layer: Number of repeated :class:`Block` modules.
        n_head: Attention heads per block; must divide ``n_embd``.
        n_embd: Residual stream width.
        block_size: Longest sequence the position embedding supports.
        dropout: Dropout probability for embeddings, attention weights and residual branches.
        bias: Whether Linear and LayerNorm layers carry a bias.
    """

    vocab_size: int = 96
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd!r} must be divisible by n_head={self.n_head!r}; "
                "pick n_head from the divisors of n_embd."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout!r} must be in [0, 1).")

    @classmethod
    def tiny(cls, **overrides) -> GPTConfig:
        """A model that trains in milliseconds per step on a CPU; for tests and smoke runs."""
        return cls(**{**dict(vocab_size=96, n_layer=4, n_head=4, n_embd=64, block_size=64), **overrides})

    @classmethod
    def benchmark(cls, **overrides) -> GPTConfig:
        """The benchmark model: 12 blocks, width 512, 8 heads, context 512, vocab 512, no dropout."""
        base = dict(vocab_size=512, n_layer=12, n_head=8, n_embd=512, block_size=512, dropout=0.0)
        return cls(**{**base, **overrides})

    @classmethod
    def from_name(cls, name: str, **overrides) -> GPTConfig:
        """Build a preset by name (``"tiny"`` or ``"benchmark"``), so a string can select a model.

        Raises:
            ValueError: If ``name`` is not a known preset.
        """
        presets = {"tiny": cls.tiny, "benchmark": cls.benchmark}
        if name not in presets:
            raise ValueError(
                f"GPTConfig.from_name: unknown preset {name!r}; choose one of {sorted(presets)}."
            )
        return presets[name](**overrides)

    def as_dict(self) -> dict:
        """The fields as a plain dict (handy for ``GPTLightningModule(**cfg.as_dict())``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on top of ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # One fused projection for q, k, v: one matmul instead of three.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally over ``x`` of shape ``[B, T, C]``; returns the same shape."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # Attention-weight dropout only while training; SDPA does not look at module.training.
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: ``c_fc -> gelu -> c_proj -> dropout``.

    Plain attributes rather than an ``nn.Sequential`` so that the MLP's two Linears never look
    like a "repeated block" container to the block finder.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the feed-forward to ``x`` of shape ``[B, T, C]``."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm Transformer block; ``forward`` takes and returns a single tensor."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual attention then residual MLP on ``x`` of shape ``[B, T, C]``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only language model: embeddings, ``n_layer`` :class:`Block` s, LayerNorm, LM head.

    The LM head shares its weight with the token embedding (weight tying), so
    ``state_dict()`` holds both keys but ``parameters()`` yields the tensor once.

    Args:
        config: Model hyper-parameters.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scaling: residual projections shrink with depth so the stream's variance stays put.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Number of parameters; position embeddings are excluded when ``non_embedding``."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute logits and, when ``targets`` is given, the mean next-token cross-entropy.

        Args:
            idx: Token ids, ``LongTensor[B, T]`` with ``T <= block_size``.
            targets: Target ids aligned with ``idx`` (already shifted by one), ``LongTensor[B, T]``;
                positions equal to ``-100`` are ignored.

        Returns:
            ``(logits, loss)``: ``logits`` is ``[B, T, vocab_size]``; ``loss`` is a scalar or ``None``.

        Raises:
            ValueError: If the sequence is longer than ``block_size``.
        """
        _, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"GPT.forward: sequence length {T!r} exceeds block_size={self.config.block_size!r}; "
                "shorten the input or build the model with a larger block_size."
            )
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX
        )
        return logits, loss
