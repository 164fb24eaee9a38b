"""The ledger under mixed precision, through a Trainer: the activation line counts activations only, autocast's
low-precision copies of the weights get a line of their own, both within 10 % of an independent live-tensor
count, in every Lightning precision, with autocast's weight cache off (Lightning's ``bf16-mixed``) and on (Fabric,
or a ``MixedPrecision`` subclass)."""

from __future__ import annotations

import pytest
import torch
from _independent import LiveForward
from _lightning_models import SameBatch, trainer_kwargs
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.core.units import GiB, MiB, format_bytes
from lightning_ckpt.demos import GPTLightningModule, HFCausalLMModule

B, T = 2, 64


class CachedBF16(MixedPrecision):
    """``bf16-mixed`` with autocast's weight cache on (``torch.autocast``'s default, and Fabric's)."""

    def __init__(self) -> None:
        super().__init__("bf16-mixed", "cpu")

    def autocast_context_manager(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True)


PRECISIONS = {"32-true": "32-true", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed", "bf16-true": "bf16-true",
              "bf16-mixed, cache on": CachedBF16}
MODELS = {
    "demo GPT": lambda: GPTLightningModule(n_layer=4, n_embd=64, n_head=4, block_size=T, dropout=0.0),
    "HF Llama": lambda: HFCausalLMModule(arch="llama", n_layer=4, n_embd=64, n_head=4, n_positions=T,
                                         vocab_size=512),
}


def _fit(tmp_path, model, precision, cb, steps=2):
    batch = model.example_batch(B, T)
    loader = DataLoader(SameBatch(batch, n=4), batch_size=None)
    plugin = precision() if isinstance(precision, type) else None
    kwargs = trainer_kwargs(tmp_path, max_steps=steps, log_every_n_steps=1, limit_val_batches=0,
                            num_sanity_val_steps=0)
    if plugin is not None:
        kwargs["plugins"] = [plugin]
    else:
        kwargs["precision"] = precision
    trainer = Trainer(callbacks=[cb], **kwargs)
    trainer.fit(model, train_dataloaders=loader)
    return trainer, batch


def _reference(trainer, model, batch):
    """The same step outside the Trainer, under the run's own precision context, counted independently."""
    model.zero_grad(set_to_none=True)
    with LiveForward() as live:
        with trainer.precision_plugin.forward_context():
            loss = model.compute_loss(batch)
        loss.backward()
        del loss
    return live.peak


@pytest.mark.slow
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_activation_and_copies_lines_match_a_live_tensor_count(tmp_path, model_name, precision, capsys):
    rows = []
    for policy in ("none", "every:2", "all"):
        seed_everything(0)
        model = MODELS[model_name]()
        cb = ActivationCheckpointing(policy=policy)
        trainer, batch = _fit(tmp_path / policy, model, PRECISIONS[precision], cb, steps=3)
        logged = cb.last_metrics  # step 2: a default-mode step corrected by step 1's exact reference (steady state)
        assert cb.last_result.reading.reference is False
        act, copies = logged["memory/activations_gib"] * GiB, logged["memory/autocast_copies_gib"] * GiB
        peak = _reference(trainer, model, batch)
        rows.append(f"{model_name} {precision:<20} {policy:<8} activations {act / MiB:7.3f} vs "
                    f"{peak['activations'] / MiB:7.3f} MiB   copies {copies / MiB:6.3f} vs {peak['copies'] / MiB:6.3f}")
        assert act == pytest.approx(peak["activations"], rel=0.10), rows[-1]
        if peak["copies"]:
            assert copies == pytest.approx(peak["copies"], rel=0.10), rows[-1]
        else:
            assert copies == 0, rows[-1]
    with capsys.disabled():
        print("\n" + "\n".join(rows))


def test_exact_mode_under_a_trainer_measures_the_forward_run_inside_the_optimizer_closure(tmp_path):
    """Lightning runs forward and backward inside ``optimizer.step(closure)``: exact steps must still count them
    (they logged 0.0 when counting stopped at the optimizer's pre-hook)."""
    seed_everything(0)
    model = MODELS["demo GPT"]()
    cb = ActivationCheckpointing(policy="every:2", exact_every_n_steps=1)
    trainer, batch = _fit(tmp_path, model, "bf16-mixed", cb, steps=3)
    reading = cb.last_result.reading
    assert reading.exact and reading.activations > 0
    peak = _reference(trainer, model, batch)
    assert reading.activations == pytest.approx(peak["activations"], rel=0.10)
    assert reading.autocast_copies == pytest.approx(peak["copies"], rel=0.10)


@pytest.mark.slow
def test_under_torch_compile_the_lines_are_the_eager_figures_of_the_same_plan(tmp_path):
    """The model compiled in configure_model: replays happen inside the compiled backward, so compiled steps report
    the exact figures of their eager reference step (one step per plan and batch shape runs eagerly)."""

    class Compiled(GPTLightningModule):
        def configure_model(self):
            self.model = torch.compile(self.model, backend="aot_eager")

    figures = {}
    for name, cls in (("eager", GPTLightningModule), ("compiled", Compiled)):
        seed_everything(0)
        model = cls(n_layer=2, n_embd=32, n_head=2, block_size=T, dropout=0.0)
        cb = ActivationCheckpointing(policy="all")
        _fit(tmp_path / name, model, "bf16-mixed", cb, steps=3)
        figures[name] = (cb.last_metrics["memory/activations_gib"], cb.last_metrics["memory/autocast_copies_gib"],
                         cb.last_result.reading.replays)
    (eager_act, eager_copies, eager_replays), (act, copies, replays) = figures["eager"], figures["compiled"]
    assert eager_replays == 2 and replays == 0  # the compiled step's replays were not seen by Python
    assert act == pytest.approx(eager_act, rel=0.10) and copies == pytest.approx(eager_copies, rel=0.10)


def test_the_report_says_when_the_copies_line_is_large_and_what_removes_it(tmp_path, capsys):
    seed_everything(0)
    model = MODELS["HF Llama"]()
    cb = ActivationCheckpointing(policy="all")
    _fit(tmp_path, model, CachedBF16, cb)
    printed = capsys.readouterr().out
    copies = cb.last_metrics["memory/autocast_copies_gib"]
    assert "autocast_copies" in printed and format_bytes(round(copies * GiB)) in printed  # the unit that fits
    assert "bf16-true" in printed and "checkpointing cannot remove them" in printed
    seed_everything(0)
    fp32 = ActivationCheckpointing(policy="all")
    _fit(tmp_path / "fp32", MODELS["HF Llama"](), "32-true", fp32)
    assert "bf16-true" not in capsys.readouterr().out  # no copies in float32: nothing to say


def test_decisions_read_the_activation_line_not_the_copies(tmp_path):
    """Autocast's cache on and off: the same activations, different copies. The auto-toggle must decide alike, and
    a threshold between the activations and activations + copies must not trigger it."""
    seed_everything(0)
    probe = ActivationCheckpointing(policy="none")
    _fit(tmp_path / "probe", MODELS["HF Llama"](), CachedBF16, probe)
    act = probe.last_metrics["memory/activations_gib"] * GiB
    copies = probe.last_metrics["memory/autocast_copies_gib"] * GiB
    assert copies > 0.1 * act
    for threshold, expect_rise in ((int(act + copies / 2), False), (int(act * 0.9), True)):
        levels = {}
        for name, precision in (("cache on", CachedBF16), ("cache off", "bf16-mixed")):
            seed_everything(0)
            cb = ActivationCheckpointing(auto_threshold=threshold, cooldown=100)
            _fit(tmp_path / f"{threshold}-{name.replace(' ', '_')}", MODELS["HF Llama"](), precision, cb, steps=4)
            levels[name] = cb.controller.level
        assert levels["cache on"] == levels["cache off"], (threshold, levels)
        assert (levels["cache on"] > 0) == expect_rise, (threshold, levels)
