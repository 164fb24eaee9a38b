"""``zero_grad_before_forward=True``: the previous step's gradients are freed before the first micro-batch's forward
(Lightning frees them only between ``training_step`` and ``backward``), and the training is bitwise the same."""

from __future__ import annotations

import pytest
import torch
from _lightning_models import TinyTransformer, params_of, trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_ckpt.lightning.callback import ActivationCheckpointing


class GradsAtForward(Callback):
    """Whether any parameter holds a gradient when each micro-batch's forward starts."""

    def __init__(self) -> None:
        self.held = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.held.append(any(p.grad is not None for p in pl_module.parameters()))


def _fit(tmp_path, zero: bool, accumulate: int):
    seed_everything(0)
    model = TinyTransformer()
    seen = GradsAtForward()
    callback = ActivationCheckpointing(policy="none", measure=False, report=False, zero_grad_before_forward=zero)
    trainer = Trainer(callbacks=[callback, seen], **trainer_kwargs(tmp_path, max_steps=3, limit_val_batches=0,
                                                                  num_sanity_val_steps=0,
                                                                  accumulate_grad_batches=accumulate))
    trainer.fit(model)
    return params_of(model), seen.held


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_previous_steps_gradients_are_gone_before_the_forward_and_the_training_is_the_same(tmp_path,
                                                                                                accumulate):
    before, held_before = _fit(tmp_path / "lightning", zero=False, accumulate=accumulate)
    after, held_after = _fit(tmp_path / "zeroed", zero=True, accumulate=accumulate)
    first = [i % accumulate == 0 for i in range(len(held_after))]
    # Lightning's order: every step after the first starts its forward holding the previous step's gradients
    assert any(h for h, f in zip(held_before, first) if f)
    assert not any(h for h, f in zip(held_after, first) if f)
    # the later micro-batches of a step hold this step's gradients either way
    assert [h for h, f in zip(held_after, first) if not f] == [h for h, f in zip(held_before, first) if not f]
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_zero_grad_before_forward_must_be_true_or_false():
    with pytest.raises(TypeError, match="zero_grad_before_forward='yes' must be True or False"):
        ActivationCheckpointing(zero_grad_before_forward="yes")
