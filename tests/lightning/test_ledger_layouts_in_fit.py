"""The ledger's optimizer line inside a real ``Trainer.fit`` with a compressed optimizer state (torchao's
``AdamW8bit``): the figure the callback logs is the state's storage (codes, scales, code maps), not the float32
its subclass appears to be (3.89x that before). The layouts one by one are in ``tests/measure/test_ledger_layouts.py``.
"""

import pytest
import torch
from _lightning_models import trainer_kwargs
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_ckpt.core.units import GiB
from lightning_ckpt.demos import GPTLightningModule
from lightning_ckpt.lightning.callback import ActivationCheckpointing


def _adamw8bit_known(params) -> int:
    """torchao's 8-bit AdamW: a tensor of at least 4096 values (a multiple of the 256-value block) keeps per moment
    uint8 codes, an fp32 scale per block and a 256-entry fp32 code map; smaller ones fp32 moments; a step each."""
    total = 0
    for p in params:
        n = p.numel()
        total += 4 + (2 * (n + n // 256 * 4 + 256 * 4) if n >= 4096 and n % 256 == 0 else 2 * 4 * n)
    return total


def test_a_fit_with_torchao_adamw8bit_logs_the_states_storage(tmp_path, monkeypatch):
    optim = pytest.importorskip("torchao.optim")
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn)  # its per-parameter step, run eagerly

    class GPT8bit(GPTLightningModule):
        def configure_optimizers(self):
            return optim.AdamW8bit(self.parameters(), lr=1e-3)

    seed_everything(0)
    model = GPT8bit(n_layer=2, n_embd=64, n_head=4, block_size=32, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 96, (2, 33), generator=g)
    batch = {"input_ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}
    cb = ActivationCheckpointing(policy="none")
    Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=2, log_every_n_steps=1, limit_val_batches=0,
                                             num_sanity_val_steps=0)).fit(
        model, train_dataloaders=DataLoader([batch] * 4, batch_size=None))

    logged = cb.last_metrics["memory/optimizer_gib"] * GiB
    params = list(model.parameters())
    assert logged == pytest.approx(_adamw8bit_known(params), rel=0.03)
    assert logged < 0.5 * 8 * sum(p.numel() for p in params)  # an fp32 Adam's 8 bytes per parameter


def test_a_module_returning_two_optimizers_logs_their_sum(tmp_path):
    """A Muon + AdamW pair from configure_optimizers (manual optimization): the optimizer line is both states."""

    class TwoOptimizers(GPTLightningModule):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def configure_optimizers(self):
            matrices = [p for p in self.parameters() if p.ndim == 2]
            return [torch.optim.Muon(matrices, lr=1e-3),
                    torch.optim.AdamW([p for p in self.parameters() if p.ndim != 2], lr=1e-3)]

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            optimizers = self.optimizers()
            for opt in optimizers:
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in optimizers:
                opt.step()
            return loss

    seed_everything(0)
    model = TwoOptimizers(n_layer=2, n_embd=64, n_head=4, block_size=32, dropout=0.0)
    tok = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}
    cb = ActivationCheckpointing(policy="none")
    Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=2, log_every_n_steps=1, limit_val_batches=0,
                                             num_sanity_val_steps=0)).fit(
        model, train_dataloaders=DataLoader([batch] * 4, batch_size=None))

    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim != 2]
    muon = sum(4 * p.numel() for p in matrices)  # one fp32 momentum buffer per matrix
    adamw = sum(2 * 4 * p.numel() + 4 for p in vectors)  # two moments and a step per vector
    assert round(cb.last_metrics["memory/optimizer_gib"] * GiB) == muon + adamw


def test_a_fit_with_a_paged_optimizer_says_in_its_report_that_the_allocator_cannot_see_its_state(tmp_path):
    """bitsandbytes' paged optimizers keep their state in CUDA managed memory, which the allocator's lines do not
    show: the end-of-fit report (its text and its JSON's advice) says so, naming the optimizer."""
    import json

    bnb = pytest.importorskip("bitsandbytes")
    from lightning.pytorch.loggers import CSVLogger

    class PagedGPT(GPTLightningModule):
        def configure_optimizers(self):
            return bnb.optim.PagedAdamW8bit(self.parameters(), lr=1e-3)  # on a CPU: ordinary tensors, still paged

    seed_everything(0)
    model = PagedGPT(n_layer=2, n_embd=64, n_head=4, block_size=32, dropout=0.0)
    tok = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}
    cb = ActivationCheckpointing(policy="none")
    kwargs = trainer_kwargs(tmp_path, max_steps=2, log_every_n_steps=1, limit_val_batches=0, num_sanity_val_steps=0)
    kwargs["logger"] = CSVLogger(tmp_path, name="csv")
    trainer = Trainer(callbacks=[cb], **kwargs)
    trainer.fit(model, train_dataloaders=DataLoader([batch] * 4, batch_size=None))

    assert "PagedAdamW8bit is a paged optimizer" in cb.report(trainer)
    written = json.loads((tmp_path / "csv" / "version_0" / "lightning_ckpt_report.json").read_text())
    assert any("PagedAdamW8bit" in line and "managed memory" in line for line in written["advice"])
