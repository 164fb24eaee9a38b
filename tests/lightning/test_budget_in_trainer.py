"""``budget:`` through a Trainer: what the run says when the budget cannot do its job."""

from __future__ import annotations

import warnings

from _lightning_models import TinyTransformer, trainer_kwargs
from lightning.pytorch import Trainer, seed_everything

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.core.units import format_bytes


def _fit(tmp_path, policy: str, steps: int) -> ActivationCheckpointing:
    seed_everything(0)
    cb = ActivationCheckpointing(policy=policy)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=steps, limit_val_batches=0,
                                                       num_sanity_val_steps=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyTransformer(batch_size=4))
    cb.caught = [str(w.message) for w in caught if "lightning_ckpt" in str(w.message)]
    return cb


def test_a_run_that_ends_before_the_calibration_finishes_says_so(tmp_path):
    cb = _fit(tmp_path, "budget:1GiB", steps=3)  # room for every stage: nine calibration steps
    assert cb.calibration.calibrating
    stages = len(cb.calibration.stages)
    said = [m for m in cb.caught if "calibration steps" in m]
    assert len(said) == 1, cb.caught
    assert f"train at least {stages + 1} steps for 'budget:1GiB'" in said[0] and "ended after 3 of its" in said[0]


def test_a_finished_calibration_says_nothing_of_the_kind(tmp_path):
    cb = _fit(tmp_path, "budget:20KiB", steps=12)
    assert cb.calibration.done and not [m for m in cb.caught if "calibration steps" in m]


def test_an_infeasible_budget_is_a_warning_once_naming_the_smallest_feasible_budget(tmp_path):
    cb = _fit(tmp_path, "budget:1KiB", steps=12)
    chosen = cb.calibration.chosen
    assert chosen is not None and not chosen.fits
    said = [m for m in cb.caught if "raise the budget" in m]
    assert len(said) == 1, cb.caught  # once, not every step
    assert f"at least {format_bytes(chosen.smallest_budget)}" in said[0] and "'budget:1KiB'" in said[0]
