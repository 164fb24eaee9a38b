"""Small modules for tests/test_profile.py: an injected out-of-memory configuration, modules without a batch
hook."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule

from lightning_ckpt.demos.lightning_gpt import GPTLightningModule


class OOMAboveGPT(GPTLightningModule):
    """The demo GPT whose ``training_step`` runs out of memory when a micro-batch holds more than
    ``oom_above_tokens`` tokens: it does the forward (allocating, as a real step would) and then raises
    ``torch.OutOfMemoryError``, which ``lightning-ckpt profile`` must report as ``"oom": true``."""

    def __init__(self, oom_above_tokens: int = 32, **kwargs) -> None:
        super().__init__(**kwargs)
        self.oom_above_tokens = oom_above_tokens

    def training_step(self, batch, batch_idx):
        if batch["input_ids"].numel() > self.oom_above_tokens:
            self.compute_loss(batch)  # memory is in use when the allocator gives up
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 64.00 GiB (injected by tests/_profile_models.py)")
        return super().training_step(batch, batch_idx)


class NoHookGPT(GPTLightningModule):
    """The demo GPT without its ``example_batch`` hook: batches must come from a datamodule."""

    example_batch = None


class NoHookModule(LightningModule):
    """A LightningModule with neither ``example_batch`` nor a datamodule: profile must refuse it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
