"""``budget:`` under DDP (2 gloo processes) with batches of different lengths on each rank: every step of every
rank within the budget (the calibration's included), and every rank runs the same plan in the same step."""

from __future__ import annotations

import sys

import pytest
import torch
from _lightning_models import CleanDistributedExit, lm_batch, step_activations, trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.demos import GPTLightningModule

MiB = 2**20
VOCAB = 96
STEPS = 16


def _batch(length: int, seed: int) -> dict:
    return lm_batch(length, seed=seed, vocab=VOCAB)


class PerRankData(GPTLightningModule):
    """Rank 0 sees 32-token batches, rank 1 lengths that vary (32, 64, 48 …) from the first step."""

    def train_dataloader(self):
        rank = self.trainer.global_rank
        lengths = [32] * STEPS if rank == 0 else [(32, 64, 48)[i % 3] for i in range(STEPS)]
        return DataLoader([_batch(n, i + 100 * rank) for i, n in enumerate(lengths)], batch_size=None)


class Rows(Callback):
    def __init__(self, folder: str) -> None:
        self.folder, self.rows = folder, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)]
        self.rows.append((tuple(cb.plan.modes), step_activations(trainer), batch["input_ids"].shape[1]))

    def on_train_end(self, trainer, pl_module):
        torch.save(self.rows, f"{self.folder}/rank{trainer.global_rank}.pt")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="gloo ddp_spawn on CPU is not tested on Windows")
def test_budget_under_ddp_with_different_lengths_per_rank_holds_on_every_rank(tmp_path):
    budget = 3 * MiB
    seed_everything(0)
    model = PerRankData(n_layer=4, n_embd=64, n_head=4, block_size=128, vocab_size=VOCAB, dropout=0.0)
    cb = ActivationCheckpointing(policy="budget:3MiB")
    trainer = Trainer(callbacks=[cb, Rows(str(tmp_path)), CleanDistributedExit()], **trainer_kwargs(
        tmp_path, devices=2, strategy=DDPStrategy(start_method="spawn"), max_steps=STEPS, limit_val_batches=0,
        num_sanity_val_steps=0, log_every_n_steps=1, use_distributed_sampler=False))
    trainer.fit(model)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(len(rows) == STEPS for rows in ranks)
    # DDP rebuilds its gradient buckets once, in the second iteration, in the order the gradients became ready:
    # that step's figure holds one more gradient-sized buffer, DDP's, not an activation (a known limit: the meter
    # does not yet tell it apart, docs/auto-budget-oom.md)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    for r, rows in enumerate(ranks):
        over = [(i, peak) for i, (_, peak, _) in enumerate(rows)
                if peak is not None and peak > budget + (grads if i == 1 else 0)]
        assert not over, (r, over, rows)
    assert [modes for modes, _, _ in ranks[0]] == [modes for modes, _, _ in ranks[1]]  # one plan per step
