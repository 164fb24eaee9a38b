"""A run of the auto-toggle resumed just after a move decides as the uninterrupted run does (issue 34, defect 7).

The readings are the meter's activation bytes (device independent, the same on every run of this model), so the
verdict does not depend on timing: the threshold is placed from the model's own measured peaks under each policy.
"""

from __future__ import annotations

import torch
from _lightning_models import TinyTransformer, trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ckpt import ActivationCheckpointing, get_plan

GiB = 2**30
LADDER = ["none", "all"]
RELEASE = 0.8
STEPS = 6


class Steps(Callback):
    """The policy each training step ran on, and its logged activation peak (bytes)."""

    def __init__(self):
        self.policies, self.act = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.policies.append(get_plan(pl_module).spec)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.act.append(float(trainer.callback_metrics["memory/activations_gib"]) * GiB)


def _fit(tmp_path, cb, ckpt_path=None, checkpoints=None, steps=STEPS):
    seed_everything(0)
    seen = Steps()
    callbacks = [cb, seen] + ([checkpoints] if checkpoints is not None else [])
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=steps, log_every_n_steps=1, limit_val_batches=0,
                                       num_sanity_val_steps=0, enable_checkpointing=checkpoints is not None),
                      callbacks=callbacks)
    trainer.fit(TinyTransformer(batch_size=16), ckpt_path=ckpt_path)
    return seen


def _auto(threshold):
    return ActivationCheckpointing(auto_threshold=threshold, ladder=LADDER, release=RELEASE, cooldown=2)


def test_a_run_resumed_just_after_a_move_up_does_not_step_down_where_the_uninterrupted_run_does_not(tmp_path):
    """The threshold lies under the 'none' peak and above the 'all' peak / release: the first step ('none') crosses
    it, the run moves up and, knowing from that move what 'none' costs, stays up. The old controller did not save
    the reading taken before the move: the resumed run took 'all' to cost what 'none' costs, stepped down after
    ``cooldown`` calm steps, and that step ran over the threshold."""
    peaks = {policy: _fit(tmp_path / policy, ActivationCheckpointing(policy=policy), steps=2).act[-1]
             for policy in LADDER}
    assert peaks["none"] > peaks["all"] / RELEASE, peaks  # room for a threshold between the two
    threshold = int((peaks["none"] + peaks["all"] / RELEASE) / 2)

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    whole = _fit(tmp_path / "whole", _auto(threshold), checkpoints=checkpoints)
    assert whole.policies == ["none"] + ["all"] * (STEPS - 1)
    assert whole.act[0] > threshold and all(act <= threshold for act in whole.act[1:]), (threshold, whole.act)

    after_move = tmp_path / "ckpt" / "epoch=0-step=1.ckpt"  # saved after the first step, the move up made
    saved = next(v for k, v in torch.load(after_move, weights_only=True)["callbacks"].items()
                 if "ActivationCheckpointing" in k)["controller"]
    assert saved["level"] == 1

    resumed = _fit(tmp_path / "resumed", _auto(threshold), ckpt_path=str(after_move))
    assert resumed.policies == whole.policies[1:]
    assert all(act <= threshold for act in resumed.act), (threshold, resumed.act)
