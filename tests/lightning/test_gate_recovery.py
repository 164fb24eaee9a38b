"""A step the auto-toggle's shape gate raised (a long batch put on a higher policy before its forward) that runs out
of memory anyway: retried one policy up, and only its bucket learns it (issue 34). The controller's own policy, on
which the short batches run, is left alone; the long bucket never runs the policy that failed again."""

from __future__ import annotations

import torch
from _lightning_models import trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything
from torch._subclasses.fake_tensor import is_fake
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointing, get_plan
from lightning_ckpt.demos import GPTLightningModule

VOCAB = 96
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"


def _batch(length: int, samples: int = 4, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed * 1000 + length)
    ids = torch.randint(0, VOCAB, (samples, length + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


class FailsLongOnce(GPTLightningModule):
    """The first 256-token step runs out of memory in its forward, on whatever policy the gate put it."""

    def training_step(self, batch, batch_idx):
        if is_fake(next(self.parameters())):  # the gate tracing the bucket's shape on fake tensors
            return super().training_step(batch, batch_idx)
        self.seen = getattr(self, "seen", [])
        self.seen.append((batch["input_ids"].shape[1], get_plan(self).spec))
        if batch["input_ids"].shape[1] == 256 and not getattr(self, "fired", False):
            self.fired = True
            raise torch.OutOfMemoryError(OOM)
        return super().training_step(batch, batch_idx)


class Levels(Callback):
    def __init__(self, cb):
        self.cb, self.rows = cb, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(self.cb.controller.level)


def test_a_gated_step_that_runs_out_of_memory_raises_its_bucket_not_the_controller(tmp_path):
    seed_everything(0)
    model = FailsLongOnce(n_layer=4, n_embd=64, n_head=4, block_size=256, vocab_size=VOCAB, dropout=0.0)
    batches = [_batch(32, seed=i) for i in range(4)] + [_batch(256), _batch(32), _batch(256), _batch(32)]
    cb = ActivationCheckpointing(auto_threshold="12MiB", on_oom="escalate", cooldown=1)
    levels = Levels(cb)
    Trainer(callbacks=[cb, levels], **trainer_kwargs(tmp_path, max_steps=len(batches), limit_val_batches=0,
                                                     num_sanity_val_steps=0, log_every_n_steps=1)).fit(
        model, DataLoader(batches, batch_size=None))
    long_runs = [spec for length, spec in model.seen if length == 256]
    failed, retried, later = long_runs
    assert failed != "none" and retried != failed and later == retried  # never the failed policy again
    assert [spec for length, spec in model.seen if length == 32] == ["none"] * 6  # the controller's policy
    assert set(levels.rows) == {0} and cb.controller.state_dict()["out_of_memory"] == {}
