"""Lightning wrappers for the demo GPT and a character-level data module.

Batches everywhere in the demos are dicts::

    {"input_ids": LongTensor[B, T], "labels": LongTensor[B, T], "attention_mask": ...optional}

``labels[b, t]`` is the target for position ``t`` (already shifted by one) and ``-100`` is ignored,
so the loss is a plain cross-entropy over aligned positions for every demo model.

The validation metrics are ``torchmetrics`` objects logged the Lightning way (``self.log(name, metric)``), the idiom
to copy into a model of your own; the plugin's own figures take a different road (one collective for all of them,
see :mod:`lightning_ckpt.lightning.metrics`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from lightning_ckpt.demos.gpt import GPT, IGNORE_INDEX, GPTConfig

__all__ = [
    "DEFAULT_TEXT",
    "CausalLMMixin",
    "CharDataModule",
    "CharTokenizer",
    "CharWindows",
    "GPTLightningModule",
]

# Ships with the package (see ``[tool.setuptools.package-data]``), so the demos never download.
DEFAULT_TEXT = Path(__file__).parent / "data" / "ledger_essay.txt"


class CausalLMMixin:
    """Shared training logic for the demo language models (one implementation, two models).

    A subclass provides ``logits_and_loss(batch) -> (logits, loss)``, ``vocab_size`` and ``max_seq_len``, saves
    ``lr`` and ``weight_decay`` among its hyper-parameters, and calls :meth:`add_validation_metrics` in its
    ``__init__``.

    Logged keys: ``train_loss`` (step, progress bar); ``val_loss`` (epoch, progress bar: the mean of the batches'
    mean losses); ``val_ppl`` (epoch, progress bar: token perplexity, the exponential of the mean cross-entropy over
    every labelled token of the validation set); ``val_acc`` (epoch: next-token accuracy over the same tokens).
    Positions labelled ``-100`` count in none of them. ``exp(val_loss)`` equals ``val_ppl`` only when every batch
    holds the same number of labelled tokens.
    """

    def logits_and_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy of a batch dict."""
        return self.logits_and_loss(batch)[1]

    def add_validation_metrics(self, num_classes: int) -> None:
        """Register ``val_ppl`` and ``val_acc`` as attributes of the module.

        As attributes (not in a plain dict or list) they are child modules: Lightning moves them with the model and
        finds them when they are logged. Their states are not persistent, so ``state_dict()`` and checkpoints are
        the same as without them.

        Args:
            num_classes: The vocabulary size (the number of classes next-token accuracy chooses from).
        """
        self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, ignore_index=IGNORE_INDEX, average="micro")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["input_ids"].size(0))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits, loss = self.logits_and_loss(batch)
        labels = batch["labels"]
        # update(), not forward: only the epoch value is logged, so nothing is computed per batch. Perplexity gets
        # float32 logits because it takes the log of a softmax: on bf16 logits (bf16-true, or CPU autocast, which
        # keeps softmax in bf16) that is off by about 1 %. .float() is free on float32 logits; the copies it and the
        # softmax make are freed when update() returns, and the metric keeps two scalars.
        self.val_ppl.update(logits.float(), labels)
        # classes on dim 1, as torchmetrics expects: [B * T, V] is a view of the logits, not a copy
        self.val_acc.update(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        # sync_dist: an epoch-level metric should be the mean over ranks, not rank 0's share.
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].size(0))
        # The metric objects themselves, not their values: Lightning calls compute() at the epoch end (torchmetrics
        # sums the states over ranks there), logs the result and resets the metric for the next epoch.
        self.log("val_ppl", self.val_ppl, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val_acc", self.val_acc, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW; biases, norms and embeddings of rank < 2 are exempt from weight decay."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # beta2=0.95 is the usual choice for short, small-batch language-model runs like these demos.
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))

    def example_batch(self, micro_batch: int, seq_len: int) -> dict[str, torch.Tensor]:
        """A synthetic batch of the shape training uses, on the module's device.

        Profilers and memory planners call this to run a representative step without a data
        module. Token ids are drawn from a private, fixed-seed generator so that calling it never
        moves the global RNG that training (and dropout replay) depends on.

        Args:
            micro_batch: Number of sequences ``B``.
            seq_len: Tokens per sequence ``T``; at most the model's context length.

        Returns:
            ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}`` where ``labels`` is
            ``input_ids`` shifted left by one.

        Raises:
            ValueError: If ``micro_batch`` or ``seq_len`` is not positive or ``seq_len`` is too long.
        """
        if micro_batch < 1 or seq_len < 1:
            raise ValueError(
                f"example_batch: micro_batch={micro_batch!r} and seq_len={seq_len!r} must both be >= 1."
            )
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"example_batch: seq_len={seq_len!r} exceeds the model's context length "
                f"{self.max_seq_len!r}; pass a smaller seq_len or build a model with a longer context."
            )
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab_size, (micro_batch, seq_len + 1), generator=gen)
        tokens = tokens.to(self.device)
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


class GPTLightningModule(CausalLMMixin, LightningModule):
    """The demo :class:`~lightning_ckpt.demos.gpt.GPT` as a ``LightningModule``.

    Every argument is a plain number or bool so that ``LightningCLI`` and YAML can carry it. The
    repeated blocks are at ``self.model.transformer.h``.

    Args:
        vocab_size: Token ids; 96 matches :class:`CharTokenizer`.
        n_layer: Number of Transformer blocks.
        n_head: Attention heads per block.
        n_embd: Residual width.
        block_size: Context length (longest sequence accepted).
        dropout: Dropout probability.
        bias: Whether Linear and LayerNorm layers carry a bias.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay for matrices.
    """

    def __init__(
        self,
        vocab_size: int = 96,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 64,
        block_size: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(
            vocab_size=vocab_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            block_size=block_size,
            dropout=dropout,
            bias=bias,
        )
        self.model = GPT(self.config)
        self.add_validation_metrics(vocab_size)

    @classmethod
    def from_config(cls, config: GPTConfig, **kwargs: Any) -> GPTLightningModule:
        """Build from a :class:`GPTConfig`, e.g. ``from_config(GPTConfig.benchmark(), lr=1e-3)``."""
        return cls(**config.as_dict(), **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.block_size

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        """Delegate to :meth:`GPT.forward`; returns ``(logits, loss)``."""
        return self.model(input_ids, labels)

    def logits_and_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, T, vocab_size]`` and mean next-token cross-entropy of a batch dict (``attention_mask`` is
        implied causal)."""
        return self.model(batch["input_ids"], batch["labels"])


class CharTokenizer:
    """A fixed 96-symbol character vocabulary: newline plus printable ASCII.

    A fixed table (rather than one built from the text) keeps ids stable across files, so a model
    trained on one text can be evaluated on another. Characters outside the table map to space.
    """

    vocab_size = 96

    def __init__(self) -> None:
        self.itos = ["\n"] + [chr(c) for c in range(32, 127)]
        self.stoi = {ch: i for i, ch in enumerate(self.itos)}
        self._unknown = self.stoi[" "]

    def encode(self, text: str) -> torch.Tensor:
        """Text to ``LongTensor[N]`` of ids in ``[0, 96)``."""
        return torch.tensor([self.stoi.get(ch, self._unknown) for ch in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Ids back to text."""
        return "".join(self.itos[int(i)] for i in ids)


class CharWindows(Dataset):
    """Fixed-length next-token windows over one token stream.

    Item ``i`` starts at ``i * stride``; ``input_ids`` are ``seq_len`` tokens and ``labels`` the same
    span shifted by one.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int) -> None:
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"CharWindows: seq_len={seq_len!r} needs at least {seq_len + 1} tokens but the split has "
                f"{tokens.numel()}; use a smaller seq_len or a longer text."
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride

    def __len__(self) -> int:
        return (self.tokens.numel() - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = self.tokens[i * self.stride : i * self.stride + self.seq_len + 1]
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


class CharDataModule(LightningDataModule):
    """Character-level next-token windows from a small text file that ships with the package.

    The first ``1 - val_fraction`` of the text trains, the tail validates, so the two never share a
    window. Training windows overlap by half (``stride = seq_len // 2``) to get more samples out of a
    short text; validation windows do not overlap.

    Args:
        batch_size: Sequences per batch.
        seq_len: Tokens per sequence; must not exceed the model's ``block_size``.
        num_workers: DataLoader workers (0 keeps everything in-process, fine for this size).
        path: Text file to read; ``None`` uses the bundled essay (:data:`DEFAULT_TEXT`).
        val_fraction: Fraction of characters held out for validation.
    """

    def __init__(
        self,
        batch_size: int = 16,
        seq_len: int = 64,
        num_workers: int = 0,
        path: str | None = None,
        val_fraction: float = 0.1,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"CharDataModule: val_fraction={val_fraction!r} must be in (0, 1).")
        self.save_hyperparameters()
        self.tokenizer = CharTokenizer()
        self.train_set: CharWindows | None = None
        self.val_set: CharWindows | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        path = Path(self.hparams.path) if self.hparams.path else DEFAULT_TEXT
        tokens = self.tokenizer.encode(path.read_text(encoding="utf-8"))
        split = int(tokens.numel() * (1.0 - self.hparams.val_fraction))
        seq_len = self.hparams.seq_len
        self.train_set = CharWindows(tokens[:split], seq_len, stride=max(1, seq_len // 2))
        self.val_set = CharWindows(tokens[split:], seq_len, stride=seq_len)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: CharWindows | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("CharDataModule: call setup() before asking for a dataloader.")
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            num_workers=self.hparams.num_workers,
            # drop_last keeps every step the same shape, so per-step memory readings are comparable.
            drop_last=shuffle,
        )
