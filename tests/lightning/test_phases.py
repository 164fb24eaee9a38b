"""The step's peak per phase, through a Trainer: the forward, backward and optimizer peaks the callback logs on a
CPU step equal what ``lightning-ckpt plan --model`` forecasts for the same LightningModule (within 10 %), with
AdamW's ``foreach`` step off and on, and the end-of-fit report names the phase and the seed's advice for it."""

from __future__ import annotations

import json

import pytest
from _lightning_models import SameBatch, trainer_kwargs
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.core.units import GiB, MiB
from lightning_ckpt.demos import GPTLightningModule
from lightning_ckpt.forecast.trace import forecast_model

B, T = 2, 64
SMALL = dict(n_layer=4, n_embd=64, n_head=4, block_size=T, dropout=0.0)
PHASES = ("forward", "backward", "optimizer")


class ForeachGPT(GPTLightningModule):
    """The demo module with the optimizer's ``foreach`` chosen (torch's CPU default is off)."""

    def __init__(self, foreach: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.foreach = foreach

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        for group in opt.param_groups:
            group["foreach"] = self.foreach
        return opt


def _fit(tmp_path, model, policy, steps=3):
    cb = ActivationCheckpointing(policy=policy)
    loader = DataLoader(SameBatch(model.example_batch(B, T)), batch_size=None)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=steps, log_every_n_steps=1,
                                                        limit_val_batches=0, num_sanity_val_steps=0))
    trainer.fit(model, train_dataloaders=loader)
    cb.trainer = trainer
    return cb


@pytest.mark.slow
@pytest.mark.parametrize("foreach", [False, True], ids=["foreach off", "foreach on"])
def test_logged_phase_peaks_match_the_forecast(tmp_path, foreach, capsys):
    policies = ("none", "every:2", "all")
    forecast = forecast_model(ForeachGPT, dict(SMALL, foreach=foreach),
                              micro_batch=B, seq_len=T, policies=policies)
    rows = []
    for policy in policies:
        seed_everything(0)
        cb = _fit(tmp_path / policy, ForeachGPT(foreach=foreach, **SMALL), policy)
        logged = {phase: cb.last_metrics[f"memory/peak_{phase}_gib"] * GiB for phase in PHASES}
        for phase in PHASES:
            planned = forecast.phase_peaks[policy][phase]
            rows.append(f"foreach={foreach} {policy:<8} {phase:<9} planned {planned / MiB:7.3f} MiB  logged "
                        f"{logged[phase] / MiB:7.3f} MiB  error {planned / logged[phase] - 1:+.2%}")
            assert planned == pytest.approx(logged[phase], rel=0.10), rows[-1]
        assert forecast.peak_phase[policy] == max(logged, key=logged.get), rows
        ledger = cb.last_result.ledger
        assert ledger.peak_phase == forecast.peak_phase[policy]
    with capsys.disabled():
        print("\n" + "\n".join(rows))


@pytest.mark.parametrize("policy, foreach, phase, words", [
    ("none", False, "forward", "checkpointing (or a smaller micro-batch) is the lever"),
    ("all", False, "backward", "replay adds its interior"),
    ("all", True, "optimizer", "Checkpointing will not help here"),
])
def test_the_report_names_the_peak_phase_its_largest_line_and_the_advice(tmp_path, policy, foreach, phase, words):
    seed_everything(0)
    cb = _fit(tmp_path, ForeachGPT(foreach=foreach, **SMALL), policy)
    text = cb.report(cb.trainer)
    data = json.loads((tmp_path / "csv" / "version_0" / "lightning_ckpt_report.json").read_text())
    assert data["peak_phase"] == phase and set(data["phases"]) == set(PHASES)
    assert f"The step peaks in the {phase} phase" in text and words in text
    assert f"{phase:<14}" in text and "<- the step's peak" in text
    # the largest line at the optimizer peak of a small model is the model state, never the activations
    assert data["phases"]["optimizer"]["dominant"] in ("params", "grads", "optimizer", "temporaries")


def _fit_kwargs(tmp_path, steps, **extra):
    return trainer_kwargs(tmp_path, max_steps=steps, log_every_n_steps=1, limit_val_batches=0,
                          num_sanity_val_steps=0, **extra)


@pytest.mark.slow
def test_phase_peaks_in_bf16_mixed_match_the_forecast_in_that_precision(tmp_path):
    """Under Lightning's bf16-mixed (autocast, weight cache off) the phase peaks include autocast's weight copies
    while they live; the forecast traced in the same precision agrees within 10 %."""
    forecast = forecast_model(ForeachGPT, dict(SMALL), micro_batch=B, seq_len=T, policies=("none", "all"),
                              precision="bf16-mixed")
    for policy in ("none", "all"):
        seed_everything(0)
        model = ForeachGPT(**SMALL)
        cb = ActivationCheckpointing(policy=policy)
        loader = DataLoader(SameBatch(model.example_batch(B, T)), batch_size=None)
        Trainer(callbacks=[cb], precision="bf16-mixed", **_fit_kwargs(tmp_path / policy, 3)).fit(
            model, train_dataloaders=loader)
        for phase in PHASES:
            logged = cb.last_metrics[f"memory/peak_{phase}_gib"] * GiB
            assert forecast.phase_peaks[policy][phase] == pytest.approx(logged, rel=0.10), (policy, phase)


def test_with_gradient_accumulation_each_phase_is_the_highest_over_the_micro_batches(tmp_path):
    """Two micro-batches per optimizer step: the forward and backward phases repeat and each logged peak is the
    highest of its repetitions. The forward and the optimizer step peak as without accumulation (the gradients
    exist through the forward in the steady state either way); the second backward holds each parameter's incoming
    gradient beside the accumulated one, so backward rises by less than the parameters' bytes."""
    logged = {}
    for accumulate in (1, 2):
        seed_everything(0)
        model = ForeachGPT(**SMALL)
        cb = ActivationCheckpointing(policy="every:2")
        loader = DataLoader(SameBatch(model.example_batch(B, T), n=16), batch_size=None)
        Trainer(callbacks=[cb], accumulate_grad_batches=accumulate,
                **_fit_kwargs(tmp_path / str(accumulate), 3)).fit(model, train_dataloaders=loader)
        logged[accumulate] = {p: cb.last_metrics[f"memory/peak_{p}_gib"] * GiB for p in PHASES}
        params = sum(p.numel() * p.element_size() for p in model.parameters())
    for phase in ("forward", "optimizer"):
        assert logged[2][phase] == pytest.approx(logged[1][phase], rel=0.02), (phase, logged)
    assert logged[1]["backward"] < logged[2]["backward"] < logged[1]["backward"] + params, logged
