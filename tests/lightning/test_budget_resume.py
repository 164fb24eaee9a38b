"""``budget:`` resumed from a checkpoint (``ckpt_path``): the calibration's measurements, its chosen plan and the
per-shape plans travel in the checkpoint, so a resumed run neither calibrates again nor runs a step above the budget."""

from __future__ import annotations

import pytest
import torch
from _lightning_models import lm_batch, step_activations, trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.demos import GPTLightningModule

MiB = 2**20
VOCAB = 96
BUDGET = 3 * MiB
STEPS = 36  # the calibration (about 20 steps at this budget), then the chosen plan and its per-shape plans


def _batch(length: int, seed: int) -> dict:
    return lm_batch(length, seed=seed, vocab=VOCAB)


class Steps(Callback):
    """Per optimizer step: its global step, the plan it ran, the activation peak measured, whether calibrating."""

    def __init__(self) -> None:
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)]
        self.rows.append((trainer.global_step, cb.plan.modes, step_activations(trainer), cb.calibration.done))


def _run(tmp_path, steps: int, ckpt_path=None, every: int = 1, **trainer_args):
    seed_everything(0)
    model = GPTLightningModule(n_layer=4, n_embd=64, n_head=4, block_size=128, vocab_size=VOCAB, dropout=0.0)
    cb, rec = ActivationCheckpointing(policy="budget:3MiB"), Steps()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1,
                            filename="{step}")
    lengths = [32, 64] * 20
    trainer = Trainer(callbacks=[cb, rec, saver], **trainer_kwargs(
        tmp_path, max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
        enable_checkpointing=True, **trainer_args))
    trainer.fit(model, DataLoader([_batch(n, i) for i, n in enumerate(lengths)], batch_size=None),
                ckpt_path=ckpt_path)
    return cb, rec.rows


@pytest.mark.parametrize("at", ["during", "after"])
def test_a_resumed_budget_goes_on_where_it_stopped(tmp_path, at):
    """Saved during the calibration, the resumed run runs only the stages left; saved after it, it runs the chosen
    plan at once (the old code calibrated again from its first stage, its half-off stages above the budget); every
    step of both runs within the budget, and the saved policy is the budget, not the plan it chose."""
    whole, rows = _run(tmp_path / "whole", steps=STEPS)
    calibration_steps = next(step for step, _, _, done in rows if done)
    assert calibration_steps >= 4
    stop = calibration_steps // 2 if at == "during" else calibration_steps + 2
    ckpt = tmp_path / "whole" / "ckpt" / f"step={stop}.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if "ActivationCheckpointing" in k]
    assert state["policy"] == "budget:3MiB" and "budget" in state

    resumed, after = _run(tmp_path / "resumed", steps=STEPS, ckpt_path=str(ckpt))
    assert [step for step, *_ in after] == list(range(stop + 1, STEPS + 1))
    assert all(peak is None or peak <= BUDGET for _, _, peak, _ in rows + after)
    # the resumed run took up the stages where the saved one stood: it ran no stage twice
    assert len(resumed.calibration.stages) == len(whole.calibration.stages)
    assert resumed.calibration.chosen.modes == whole.calibration.chosen.modes
    plans_after = {modes for step, modes, _, _ in after if step > calibration_steps + 1}
    assert plans_after <= {tuple(whole.calibration.chosen.modes), *(p.modes for p in whole.shape_plans.values())}
    if at == "after":  # no calibration step at all after the resume
        assert all(done for *_, done in after)
        assert set(resumed.shape_plans) == set(whole.shape_plans)


def test_a_budget_resumed_by_a_strategy_that_restores_after_its_setup_does_not_calibrate_again(tmp_path, monkeypatch):
    """FSDP, ``ModelParallelStrategy`` (FSDP2) and DeepSpeed restore a checkpoint after their set-up, which comes after
    fit start, where the budget's run is made: the old engine held the saved calibration for the *next* fit, so the
    resumed one calibrated again from its first stage. It goes into this fit's budget now."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    whole, rows = _run(tmp_path / "whole", steps=STEPS)
    calibration_steps = next(step for step, _, _, done in rows if done)
    stop = calibration_steps + 2
    monkeypatch.setattr(SingleDeviceStrategy, "restore_checkpoint_after_setup", property(lambda self: True))
    ckpt = str(tmp_path / "whole" / "ckpt" / f"step={stop}.ckpt")
    resumed, after = _run(tmp_path / "resumed", steps=stop + 4, ckpt_path=ckpt, strategy=SingleDeviceStrategy("cpu"))
    assert [step for step, *_ in after] == list(range(stop + 1, stop + 5))
    assert all(done for *_, done in after)  # no calibration step after the resume
    assert resumed.calibration.chosen.modes == whole.calibration.chosen.modes
    assert set(resumed.shape_plans) == set(whole.shape_plans)
    assert all(peak is None or peak <= BUDGET for _, _, peak, _ in after)
