"""An out-of-memory error injected in every phase of a run, across the ways a run accumulates and recovers (issue 34).

Phases: before the forward, in the forward, in the backward, in a checkpointed block's replay, in the optimizer's
first and a later step, in validation and in the sanity check. Accumulation: none, constant (``accumulate_grad_batches
=2``) and Lightning's ``GradientAccumulationScheduler``; the error in the last or the first micro-batch of a window.
``on_oom`` raise / escalate; with and without ``auto_threshold``. Eager only (compiled: test_recovery).

What must hold in every cell:

- a retried step's gradients are bitwise those of a clean run, no batch skipped or run twice once it succeeded;
- no policy is run again after it ran out of memory (the auto-toggle keeps away from it);
- an error not retried names its real phase, with advice only for that phase (no checkpointing advice for a loop
  without gradients), says why it was not retried and what to resume with, never that the escalation is exhausted
  while stronger policies exist, and never says "rung".

The default run takes a seeded sample of two cells per phase; ``-m slow`` runs the whole matrix.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from _lightning_models import TinyTransformer, trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_ckpt import ActivationCheckpointing, get_plan

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"
PHASES = ("before_forward", "forward", "backward", "replay", "first_optimizer_step", "optimizer_step", "validation",
          "sanity_check")
TRAINING = ("before_forward", "forward", "backward", "replay")  # inside a micro-batch's forward and backward
ACCUMULATION = ("none", "constant", "scheduler")
STEPS = 4
ARMED_STEP = 1  # the optimizer step whose micro-batch runs out of memory (the optimizer's state exists by then)
LABEL = {"replay": "backward"}  # a replay runs in the backward


def _cells():
    for phase, accumulation, on_oom, auto in itertools.product(PHASES, ACCUMULATION, ("raise", "escalate"),
                                                               (False, True)):
        micros = ("last", "first") if accumulation != "none" and phase in TRAINING else ("last",)
        for micro in micros:
            yield phase, accumulation, on_oom, auto, micro


ALL = list(_cells())
_rng = random.Random(34)
SAMPLE = [cell for phase in PHASES for cell in _rng.sample([c for c in ALL if c[0] == phase], 2)]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class OOMAdam(torch.optim.Adam):
    """Adam whose ``fail_at``-th step runs out of memory after the closure (the update's own allocation)."""

    def __init__(self, params, fail_at=-1, **kw):
        super().__init__(params, **kw)
        self.fail_at, self.calls = fail_at, 0

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError(OOM)
        super().step()
        return loss


class Armed(TinyTransformer):
    """Runs out of memory once, in ``phase`` of micro-batch ``at`` (training phases), or in the optimizer, the first
    validation or the sanity check. ``attempts``: (micro-batch, policy) of every training step run."""

    def __init__(self, phase: str, at: int, **kw):
        super().__init__(dropout=0.0, batch_size=8, **kw)
        self.phase, self.at, self.fired, self.attempts = phase, at, False, []
        # inside block 2 (its first linear layer): a checkpointed block's replay calls its body, not its hooks
        self.layers[2].linear1.register_forward_pre_hook(self._block_two)
        self.layers[1].register_forward_hook(self._after_block_one)

    def _armed(self, batch_idx=None) -> bool:
        return not self.fired and (batch_idx is None or batch_idx == self.at)

    def _fire(self):
        self.fired = True
        raise torch.OutOfMemoryError(OOM)

    def training_step(self, batch, batch_idx):
        self.batch_idx = batch_idx
        self.attempts.append((batch_idx, get_plan(self).spec))
        if self.phase == "before_forward" and self._armed(batch_idx):
            self._fire()
        return super().training_step(batch, batch_idx)

    def _block_two(self, module, args):
        trainer = self.trainer
        if trainer.sanity_checking:
            if self.phase == "sanity_check" and self._armed():
                self._fire()
        elif not torch.is_grad_enabled() or trainer.validating:
            if self.phase == "validation" and self._armed():
                self._fire()
        elif self._armed(self.batch_idx) and self.phase == ("replay" if _in_backward() else "forward"):
            self._fire()

    def _after_block_one(self, module, args, output):
        if self.phase == "backward" and self.training and torch.is_grad_enabled() and self._armed(self.batch_idx):
            output.register_hook(lambda grad: self._fire() if self._armed(self.batch_idx) else grad)

    def configure_optimizers(self):
        fail = {"first_optimizer_step": 1, "optimizer_step": ARMED_STEP + 1}.get(self.phase, -1)
        return OOMAdam(self.parameters(), fail, lr=1e-2)


class GradsAtStep(Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None})


def _window(accumulation: str) -> int:
    return 1 if accumulation == "none" else 2


def _run(tmp_path, model, cb, accumulation, phase):
    grads = GradsAtStep()
    callbacks = [cb, grads]
    extra = {}
    if accumulation == "constant":
        extra["accumulate_grad_batches"] = 2
    elif accumulation == "scheduler":  # it sets the accumulation at the first epoch's start, after the fit started
        callbacks.append(GradientAccumulationScheduler({0: 2}))
    validating = phase in ("validation", "sanity_check")
    trainer = Trainer(callbacks=callbacks, **trainer_kwargs(
        tmp_path, max_steps=STEPS, log_every_n_steps=1, limit_val_batches=1 if validating else 0,
        num_sanity_val_steps=1 if phase == "sanity_check" else 0,
        val_check_interval=(ARMED_STEP + 1) * _window(accumulation) if phase == "validation" else None,
        check_val_every_n_epoch=None if phase == "validation" else 1, **extra))
    trainer.fit(model)
    return trainer, grads.grads


_CLEAN = {}


def _clean(tmp_path_factory, accumulation):
    """The gradients of a run without the error (checkpointed gradients are bitwise the plain ones on the CPU)."""
    if accumulation not in _CLEAN:
        seed_everything(0)
        _, grads = _run(tmp_path_factory.mktemp(f"clean_{accumulation}"), Armed("none", -1),
                        ActivationCheckpointing(policy="none"), accumulation, "none")
        _CLEAN[accumulation] = grads
    return _CLEAN[accumulation]


def _check(tmp_path, tmp_path_factory, phase, accumulation, on_oom, auto, micro):
    window = _window(accumulation)
    at = ARMED_STEP * window + (window - 1 if micro == "last" else 0)
    policy = "every:2" if phase == "replay" else "none"  # a replay needs block 2 checkpointed
    kwargs = dict(auto_threshold="1TiB", cooldown=2) if auto else {}  # far under: it would step down when it may
    seed_everything(0)
    model = Armed(phase, at)
    cb = ActivationCheckpointing(policy=policy, on_oom=on_oom, **kwargs)
    retried = on_oom == "escalate" and phase in TRAINING and micro == "last"
    if retried:
        trainer, got = _run(tmp_path, model, cb, accumulation, phase)
        assert model.fired and trainer.global_step == STEPS
        runs = [b for b, _ in model.attempts]
        assert runs == sorted(runs) and runs.count(at) == 2 and len(set(runs)) == STEPS * window  # none skipped
        failed = next(i for i, (b, _) in enumerate(model.attempts) if b == at)
        failed_policy = model.attempts[failed][1]
        assert all(spec != failed_policy for _, spec in model.attempts[failed + 1:]), model.attempts
        expected = _clean(tmp_path_factory, accumulation)
        assert len(got) == len(expected) == STEPS
        for step, (mine, theirs) in enumerate(zip(got, expected)):
            assert mine.keys() == theirs.keys()
            for name, grad in theirs.items():
                assert torch.equal(mine[name], grad), f"step {step} {name}"
        return
    with pytest.raises(torch.OutOfMemoryError) as err:
        _run(tmp_path, model, cb, accumulation, phase)
    assert model.fired or "optimizer" in phase  # the optimizer raises its own
    text = str(err.value) + "\n".join(getattr(err.value, "__notes__", []))
    label = LABEL.get(phase, phase).replace("_", " ")
    assert f"during the {label} phase" in text, text
    assert "exhausted" not in text and "rung" not in text, text
    if phase in ("validation", "sanity_check"):
        assert "checkpointing cannot help" in text and "Checkpoint more" not in text, text
    if phase == "forward":
        assert "Checkpoint more" in text, text
    if on_oom == "escalate" and phase in TRAINING:  # the first micro-batch of a window: outside the step
        assert "resume from the last checkpoint with policy='every:2'" in text or \
            "resume from the last checkpoint with policy='all'" in text, text
    if on_oom == "raise":
        assert "Not retried" not in text and "resume from" not in text, text


@pytest.mark.parametrize("phase, accumulation, on_oom, auto, micro", SAMPLE)
def test_an_oom_in_every_phase_sampled(tmp_path, tmp_path_factory, phase, accumulation, on_oom, auto, micro):
    _check(tmp_path, tmp_path_factory, phase, accumulation, on_oom, auto, micro)


@pytest.mark.slow
@pytest.mark.parametrize("phase, accumulation, on_oom, auto, micro", [c for c in ALL if c not in SAMPLE])
def test_an_oom_in_every_phase_the_rest_of_the_matrix(tmp_path, tmp_path_factory, phase, accumulation, on_oom, auto,
                                                      micro):
    _check(tmp_path, tmp_path_factory, phase, accumulation, on_oom, auto, micro)
