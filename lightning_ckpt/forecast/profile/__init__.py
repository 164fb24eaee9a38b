"""Profile a LightningModule's training step per policy, micro-batch and sequence length; recommend one.

``lightning-ckpt profile pkg.module:Class`` (or :func:`profile`) follows the seed's "What to do on Monday
morning": a representative step (the module's own ``training_step`` and ``configure_optimizers``), warm-up
first, then several identical measured steps; one dimension varied at a time (micro-batch at a fixed length,
length at a fixed micro-batch), each under every policy, plus the gradient-accumulation baseline (micro-batch 1 ×
k steps, no checkpointing). The step runs in plain PyTorch, without a Trainer::

    optimizer.zero_grad(set_to_none=True)
    for each micro-batch:  loss = module.training_step(batch, 0); (loss / k).backward()
    optimizer.step()

Every configuration starts from the module's initial weights and a fresh optimizer (the state dict is reloaded
and ``configure_optimizers()`` called again), with the same seed, so configurations never contaminate each other.
An out-of-memory error (``torch.OutOfMemoryError`` or anything :func:`lightning_ckpt.decide.diagnosis.is_out_of_memory`
recognises) is a *result*: the configuration is reported with ``"oom": true`` and the run goes on.

**The batch hook.** The module provides ``example_batch(micro_batch: int, seq_len: int) -> batch``: a batch its
``training_step`` accepts, on the module's device, holding ``micro_batch`` sequences of ``seq_len`` tokens (the
demos' :class:`~lightning_ckpt.demos.GPTLightningModule` and :class:`~lightning_ckpt.demos.HFCausalLMModule` have
it). It must not move the global RNG (use a private ``torch.Generator``). Without the hook, pass a datamodule
(``datamodule=`` / ``--datamodule pkg.module:Class``, arguments from ``--datamodule-args`` JSON or the ``data:``
section of ``--config``): its own ``example_batch`` hook if it has one, else it is built with ``batch_size`` and
``seq_len`` (or ``seq_length``/``max_length``/``block_size``/``sequence_length``) set to the configuration,
``setup("fit")`` and the first batch of ``train_dataloader()`` is used.

**Injecting an out-of-memory configuration** (to test a report, or a pipeline around it): any module whose
``training_step`` (or ``example_batch``) raises ``torch.OutOfMemoryError`` for some sizes is reported that way,
e.g. ``if batch["input_ids"].numel() > limit: raise torch.OutOfMemoryError("CUDA out of memory (injected)")``.

**What is recorded** per configuration (medians over the measured steps; bytes as ``int``): ``activations`` (the
activation peak from :class:`~lightning_ckpt.measure.meter.StepMeter`, default mode), ``peak_allocated`` and
``peak_reserved`` over the whole step, optimizer step included (CUDA only, else ``None``), ``model_state``
(parameters + gradients + optimizer state, from :func:`~lightning_ckpt.measure.ledger.model_state_bytes`), ``peak`` (the
figure compared with the budget: ``peak_reserved`` on CUDA, ``model_state + activations`` elsewhere; ``peak_source``
says which), ``forward_s``, ``backward_s``, ``optimizer_s``, ``step_s``, ``tokens_per_step``, ``tokens_per_sec``,
``fits``, ``oom``, ``error``.

**Outputs** (under ``out``): ``profile.json``, ``profile.md``, ``profile.png`` (activation peak vs tokens per step,
and tokens/s vs tokens per step, per policy), ``tb/<configuration>/`` (one TensorBoard run per configuration,
scalars ``memory/activations_gib``, ``memory/peak_allocated_gib``, ``memory/peak_reserved_gib``,
``memory/model_state_gib``, ``throughput/tokens_per_sec``, ``time/step_s``, ``time/forward_s``,
``time/backward_s`` per measured step, and a text summary), and on the terminal a progress bar and a ``rich`` table.

**The recommendation** is the configuration with the highest tokens/s whose ``peak`` fits the budget (``budget``,
else ``capacity``, else the device's memory; on a CPU without either, every configuration that ran is eligible).
**The reading of the slopes** (:func:`read_slopes`), on the ``none`` policy (the first policy when ``none`` was not
profiled): the peak against tokens in the micro-batch sweep (barely changes → activations are not the problem;
grows → checkpointing is a credible target), and the log-log exponent of the activation peak against length in
the length sweep (≈1: linear; ≈2: grows with the square of length → attention is materialized).
"""


from lightning_ckpt.forecast.profile.analysis import ProfileReport, ProfileResult, read_slopes, recommend
from lightning_ckpt.forecast.profile.output import conclusions, markdown, table
from lightning_ckpt.forecast.profile.run import DEFAULT_POLICIES, PRECISIONS, profile

__all__ = [
    "DEFAULT_POLICIES",
    "PRECISIONS",
    "ProfileReport",
    "ProfileResult",
    "conclusions",
    "markdown",
    "profile",
    "read_slopes",
    "recommend",
    "table",
]
