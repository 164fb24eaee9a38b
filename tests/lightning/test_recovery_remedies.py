"""The remedies priced from a real fit's measured ledger: a capacity given to the callback that the optimizer line
crosses names that line and an 8-bit state that fits, in the report's JSON and text and in an out-of-memory
diagnosis (CPU, a few seconds)."""

from __future__ import annotations

import pytest
import torch
from _lightning_models import TinyTransformer, trainer_kwargs
from lightning.pytorch import Trainer, seed_everything

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.decide.diagnosis import OutOfMemoryDiagnosis
from lightning_ckpt.decide.report import ledger_report, report_text
from lightning_ckpt.lightning.recovery import measured_remedies_of, run_facts_of

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"


class FailAtStep(TinyTransformer):
    """Runs out of memory in the forward of optimizer step ``at`` (after measured steps)."""

    def __init__(self, at: int = 2, **kw):
        super().__init__(**kw)
        self.at = at

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.at:
            raise torch.OutOfMemoryError(OOM)
        return super().training_step(batch, batch_idx)


def _fit(tmp_path, model, steps=3):
    """Adam on a 4-block, width-128 model with micro-batches of 2: the optimizer state (two fp32 moments) is the
    largest line. The capacity, 3.5 times the weights' bytes, is below the lines' total (about 4.2 times) and above
    an 8-bit state's step (about 2.7 times)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cb = ActivationCheckpointing(policy="none", capacity=int(3.5 * weights))
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=steps, limit_val_batches=0,
                                                       num_sanity_val_steps=0, log_every_n_steps=1))
    return trainer, cb


def test_a_fit_whose_optimizer_line_crosses_the_capacity_names_it_and_an_8_bit_state_that_fits(tmp_path):
    seed_everything(0)
    model = TinyTransformer(num_layers=4, d_model=128, batch_size=2)
    trainer, cb = _fit(tmp_path, model)
    trainer.fit(model)
    engine = cb._engine
    facts = run_facts_of(engine.port)
    assert (facts.blocks, facts.micro_batch, facts.width, facts.optimizer) == (4, 2, 128, "adam")
    assert facts.params == sum(p.numel() for p in model.parameters())
    section = measured_remedies_of(engine.port)
    data = ledger_report(engine.last_result.ledger, "none", ("none", "all"), remedies=section)
    assert data["remedy"]["line"] == "optimizer state" and data["remedy"]["crosses"]
    eight = next(r for r in data["remedies"] if r["name"] == "8-bit optimizer state")
    assert eight["fits"] and not data["remedies"][0]["fits"]
    assert eight["lines"]["optimizer state"] < data["remedies"][0]["lines"]["optimizer state"] / 3
    assert data["recommended"] is not None and data["recommended_any"] is not None
    text = report_text(data)
    assert "- The optimizer state line crosses" in text and ": checkpointing cannot help. Try first:" in text
    assert any(line.startswith("  8-bit optimizer state") and "fits, changes the training" in line
               for line in text.splitlines())
    # the end-of-fit report itself (text and JSON file) carries the same rows and the sentence
    import json
    import os

    shown = cb.report(trainer)
    written = json.loads(open(os.path.join(trainer.log_dir or trainer.default_root_dir,
                                           "lightning_ckpt_report.json")).read())
    for key in ("remedies", "recommended", "recommended_any", "remedy"):
        assert written[key] == json.loads(json.dumps(data[key])), key
    assert ": checkpointing cannot help. Try first:" in shown


def test_an_out_of_memory_error_after_a_measured_step_says_which_remedy_to_try_first(tmp_path):
    seed_everything(0)
    model = FailAtStep(at=2, num_layers=4, d_model=128, batch_size=2)
    trainer, _ = _fit(tmp_path, model)
    with pytest.raises(OutOfMemoryDiagnosis) as err:
        trainer.fit(model)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("lightning_ckpt: CUDA out of memory during the before forward phase")
    assert lines[1].startswith("Try ") and " first: in the last measured step the optimizer state line crosses " \
        in lines[1]
    assert lines[1].count(". ") <= 1  # one or two sentences


def test_an_evaluation_loops_out_of_memory_prices_no_training_remedy(tmp_path):
    class FailInValidation(TinyTransformer):
        def validation_step(self, batch, batch_idx):
            raise torch.OutOfMemoryError(OOM)

    seed_everything(0)
    model = FailInValidation(num_layers=4, d_model=128, batch_size=2)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cb = ActivationCheckpointing(policy="none", capacity=int(3.5 * weights))
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=2, limit_val_batches=1,
                                                       val_check_interval=2, num_sanity_val_steps=0,
                                                       log_every_n_steps=1))
    with pytest.raises(torch.OutOfMemoryError) as err:  # noted on the error itself, outside the training step
        trainer.fit(model)
    text = "\n".join(getattr(err.value, "__notes__", []))
    assert text.startswith("lightning_ckpt: CUDA out of memory during the validation phase")
    assert "Try " not in text and "To make room" not in text


class FirstStepAdam(torch.optim.Adam):
    """Runs out of memory at its first step, before allocating its moments (as a real first step would)."""

    def step(self, closure=None):
        if closure is not None:
            closure()
        raise torch.OutOfMemoryError(OOM)


class FailsAtTheFirstOptimizerStep(TinyTransformer):
    def configure_optimizers(self):
        return FirstStepAdam(self.parameters(), lr=1e-3)


def test_an_out_of_memory_error_at_the_first_optimizer_step_prices_the_state_adam_is_about_to_allocate(tmp_path):
    """No step was measured yet: the model state is walked at the error, Adam's two moments counted as it will
    allocate them (twice the weights), so the optimizer line crosses 3.5 times the weights."""
    seed_everything(0)
    model = FailsAtTheFirstOptimizerStep(num_layers=4, d_model=128, batch_size=2)
    trainer, _ = _fit(tmp_path, model)
    with pytest.raises(OutOfMemoryDiagnosis) as err:
        trainer.fit(model)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("lightning_ckpt: CUDA out of memory during the first optimizer step phase")
    assert lines[1].startswith("Try ") and " first: in this run's model state (no step measured yet) the optimizer " \
        "state line crosses " in lines[1]
