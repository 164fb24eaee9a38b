"""``budget:`` never runs a step above the budget, the calibration's included: a seeded sample of the matrix of
models (the demo GPT, a Hugging Face Llama), budgets (25, 50, 75 % of the way from ``all`` to ``none``), eager and
``compile_blocks=True``, float32 and bf16-mixed, accumulation 1 and 2, lengths that vary from the first steps on.
Every step's activation peak is checked against the budget as it ends: a step above it fails the test whether or not
it would have run out of memory."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from _lightning_models import lm_batch, step_activations, trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.demos import GPTLightningModule
from lightning_ckpt.demos.hf import HFCausalLMModule

VOCAB = 96
LENGTHS = [32, 48, 32, 64, 32, 32, 48, 32] * 4  # another length within the first steps, and again and again

MATRIX = list(itertools.product(("gpt", "llama"), (0.25, 0.5, 0.75), (False, True), ("32-true", "bf16-mixed"),
                                (1, 2)))
_SAMPLE = random.Random(33).sample(MATRIX, 6)
FAST, SLOW = _SAMPLE[1:2], _SAMPLE[:1] + _SAMPLE[2:]  # the default run: one eager case; the rest marked slow


def _model(name: str):
    seed_everything(0)
    if name == "gpt":
        return GPTLightningModule(n_layer=4, n_embd=64, n_head=4, block_size=128, vocab_size=VOCAB, dropout=0.0)
    return HFCausalLMModule(n_layer=4, n_embd=64, n_head=4, n_positions=128, vocab_size=VOCAB, arch="llama")


def _batch(length: int, seed: int) -> dict:
    return lm_batch(length, seed=seed, vocab=VOCAB)


class Watch(Callback):
    """Every optimizer step's activation peak, as the step ends."""

    def __init__(self) -> None:
        self.peaks = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop._should_accumulate():
            return
        peak = step_activations(trainer)
        if peak is not None:
            self.peaks.append(peak)


def _fit(tmp_path, name: str, policy: str, compiled: bool, precision: str, accumulate: int, lengths):
    cb, watch = ActivationCheckpointing(policy=policy, compile_blocks=compiled), Watch()
    trainer = Trainer(callbacks=[cb, watch], **trainer_kwargs(
        tmp_path, max_steps=len(lengths) // accumulate, accumulate_grad_batches=accumulate, precision=precision,
        limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1))
    trainer.fit(_model(name), DataLoader([_batch(n, i) for i, n in enumerate(lengths)], batch_size=None))
    return cb, watch.peaks


def _case(tmp_path, name, fraction, compiled, precision, accumulate):
    if compiled:
        torch._dynamo.reset()
    # the budget between the activation peaks of 'all' and 'none' at the longest length the data has
    _, low = _fit(tmp_path / "all", name, "all", False, precision, 1, [64] * 2)
    _, high = _fit(tmp_path / "none", name, "none", False, precision, 1, [64] * 2)
    budget = int(max(low) + fraction * (max(high) - max(low)))
    cb, peaks = _fit(tmp_path / "budget", name, f"budget:{budget}", compiled, precision, accumulate, LENGTHS)
    assert cb.calibration.done, (len(cb.calibration.stages), cb.calibration.stage)
    over = [(i, peak, round(peak / budget, 3)) for i, peak in enumerate(peaks) if peak > budget]
    assert not over, over
    assert len(peaks) >= len(LENGTHS) // accumulate // 2


@pytest.mark.parametrize("name, fraction, compiled, precision, accumulate", FAST)
def test_no_step_above_the_budget(tmp_path, name, fraction, compiled, precision, accumulate):
    _case(tmp_path, name, fraction, compiled, precision, accumulate)


@pytest.mark.slow
@pytest.mark.parametrize("name, fraction, compiled, precision, accumulate", SLOW)
def test_no_step_above_the_budget_more_of_the_matrix(tmp_path, name, fraction, compiled, precision, accumulate):
    _case(tmp_path, name, fraction, compiled, precision, accumulate)
