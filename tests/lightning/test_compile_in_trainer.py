"""``torch.compile`` through a Trainer: compiled in ``configure_model`` (before the callback applies the plan), the
plan changed at run time by the auto-toggle, the budget and out-of-memory escalation. At most one compiled graph
per distinct plan; a plan that comes back reuses its graph; the math equals the eager run."""

from __future__ import annotations

import pytest
import torch
from _lightning_models import CompiledGPT, GraphCount, trainer_kwargs
from _torch_features import needs_compiler_budget
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.demos import GPTLightningModule

T = 32


class PlanSequence(Callback):
    """Switches the plan through the engine (what a decision does) before given steps."""

    def __init__(self, cb: ActivationCheckpointing, plans: dict) -> None:
        self.cb, self.plans = cb, plans
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.plans:
            self.cb._engine.change_plan(self.plans[trainer.global_step])
        self.seen.append(self.cb.plan.spec)


def _loader(model, n):
    batch = model.example_batch(2, T)
    return DataLoader([batch] * n, batch_size=None)


def _fit(tmp_path, model, callbacks, steps, **overrides):
    trainer = Trainer(callbacks=callbacks, **trainer_kwargs(tmp_path, max_steps=steps, log_every_n_steps=1,
                                                           limit_val_batches=0, num_sanity_val_steps=0, **overrides))
    accumulate = overrides.get("accumulate_grad_batches", 1)
    trainer.fit(model, train_dataloaders=_loader(model, steps * accumulate))
    return trainer


def _model(counter=None):
    seed_everything(0)
    kwargs = dict(n_layer=2, n_embd=32, n_head=2, block_size=T, dropout=0.0)
    return CompiledGPT(counter, **kwargs) if counter is not None else GPTLightningModule(**kwargs)


@pytest.mark.slow
def test_one_graph_per_distinct_plan_and_reuse_when_a_plan_comes_back(tmp_path):
    counter = GraphCount()
    model = _model(counter)
    cb = ActivationCheckpointing(policy="none")
    plans = {0: "none", 2: "every:2", 4: "all", 6: "every:2", 8: "none", 10: "all"}
    seq = PlanSequence(cb, plans)
    _fit(tmp_path, model, [cb, seq], steps=12)
    assert seq.seen == ["none"] * 2 + ["every:2"] * 2 + ["all"] * 2 + ["every:2"] * 2 + ["none"] * 2 + ["all"] * 2
    # each plan's first step is its eager reference step; its later steps run one compiled graph per plan
    assert counter.graphs == 3, counter.graphs


def test_compiled_training_with_auto_toggle_equals_the_eager_run(tmp_path):
    results = {}
    for name, counter in (("eager", None), ("compiled", GraphCount())):
        model = _model(counter)
        cb = ActivationCheckpointing(auto_threshold=1, cooldown=100)  # 1 byte: up one rung per step
        _fit(tmp_path / name, model, [cb], steps=5)
        params = {k.replace("_orig_mod.", ""): v.detach().clone() for k, v in model.state_dict().items()}
        results[name] = (cb.controller.level, params,
                         counter.graphs if counter else None)
    (eager_level, eager_params, _), (level, params, graphs) = results["eager"], results["compiled"]
    assert level == eager_level == 2 and graphs <= 3
    for key, value in eager_params.items():
        torch.testing.assert_close(params[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.slow
def test_budget_under_compile_calibrates_eagerly_and_compiles_the_chosen_plan_once(tmp_path):
    counter = GraphCount()
    model = _model(counter)
    cb = ActivationCheckpointing(policy="budget:200KiB")
    calibration_steps = 5  # every block recomputed, then a bytes step per mode and parity; no time steps
    warning = r"whole model under torch.compile.*eager reference.*block\.compile.*activation_memory_budget"
    with pytest.warns(UserWarning, match=warning):
        _fit(tmp_path, model, [cb], steps=calibration_steps + 3)
    assert cb.calibration.done and cb.calibration.chosen is not None and len(cb.calibration.stages) == 5
    # the modes are priced on one block compiled alone with the model's own backend: one graph per mode
    assert set(cb.calibration.block_seconds["Block"]) == {"recompute", "selective"}
    # the calibration steps run eagerly (block hooks), the next is the chosen plan's eager reference, the rest run
    # compiled; a correction after the verify step adds at most one more plan
    assert 3 + 1 <= counter.graphs <= 3 + 2, counter.graphs


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inductor"])
def test_the_cpp_backend_trains_with_a_changing_plan(tmp_path, backend):
    class Inductor(GPTLightningModule):
        def configure_model(self):
            if not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
                self.model = torch.compile(self.model, backend=backend)

    seed_everything(0)
    model = Inductor(n_layer=2, n_embd=32, n_head=2, block_size=T, dropout=0.0)
    cb = ActivationCheckpointing(policy="none")
    _fit(tmp_path, model, [cb, PlanSequence(cb, {2: "all", 4: "selective"})], steps=6)
    assert cb.last_metrics["memory/activations_gib"] > 0


@pytest.mark.slow
@needs_compiler_budget
@pytest.mark.timeout(400)
@pytest.mark.parametrize("precision, accumulate", [("32-true", 1), ("bf16-mixed", 2)])
def test_budget_mixes_the_compilers_per_block_budgets_when_blocks_compile_one_by_one(tmp_path, monkeypatch, precision,
                                                                                      accumulate):
    """Blocks compiled one by one: the budget also offers ``compiler:<f>`` (priced and measured on the compiled block);
    with the compiler's full-recompute budget priced cheapest, a tight budget takes it; the graphs stay within
    dynamo's recompile limit; the activation line is the eager reference less the compiler blocks' savings; the
    weights equal those of the same compiled model trained without checkpointing (float32)."""
    from _lightning_models import BlockCompiledGPT

    from lightning_ckpt.decide import block_timing
    from lightning_ckpt.decide.calibration import COMPILER_FRACTIONS

    real_seconds, real_kept = block_timing.time_block_modes, block_timing.saved_block_bytes

    # measured, then the costs constructed so that the verdict cannot hang on noise: the compiler's budgets are
    # the cheapest (every other mode strictly dearer), and its full-recompute budget keeps nothing beyond the
    # block's input, so under a budget nothing meets it ties recompute's peak and wins on time
    def cheap_compiler(*args, **kwargs):
        seconds = real_seconds(*args, **kwargs)
        return {m: (0.0 if m.startswith("compiler:") else max(s, 1e-3)) for m, s in seconds.items()}

    def lean_compiler(*args, **kwargs):
        return {m: (0 if m == "compiler:0" else kept) for m, kept in real_kept(*args, **kwargs).items()}

    monkeypatch.setattr(block_timing, "time_block_modes", cheap_compiler)
    monkeypatch.setattr(block_timing, "saved_block_bytes", lean_compiler)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    seed_everything(0)
    model = BlockCompiledGPT(n_layer=2, n_embd=32, n_head=2, block_size=T, dropout=0.0)
    # per_shape=False: an infeasible budget at the model's longest shape would stop the run before its first step
    cb = ActivationCheckpointing(policy="budget:1KiB", per_shape=False)
    _fit(tmp_path, model, [cb], steps=5 + 3, precision=precision, accumulate_grad_batches=accumulate)
    calibration = cb.calibration
    modes = {f"compiler:{f:g}" for f in COMPILER_FRACTIONS}
    assert modes <= set(calibration.block_seconds["Block"])
    assert modes | {"off"} == set(calibration.compiled_kept["Block"])
    assert calibration.done and "compiler:0" in calibration.chosen.modes
    savings = calibration.compiled_savings(cb.plan.modes)
    assert savings > 0 and calibration.measured is not None
    assert cb.last_metrics["memory/activations_gib"] * 2**30 == pytest.approx(calibration.measured, rel=1e-6)
    # only the blocks are compiled: every graph is the block class's, within the recompile limit (7: three modes and
    # four compiler budgets; the plan's blocks reuse them)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= torch._dynamo.config.recompile_limit
    if precision == "32-true":
        seed_everything(0)
        plain = BlockCompiledGPT(n_layer=2, n_embd=32, n_head=2, block_size=T, dropout=0.0)
        _fit(tmp_path / "plain", plain, [ActivationCheckpointing(policy="none")], steps=5 + 3)
        for (name, value), expected in zip(model.state_dict().items(), plain.state_dict().values()):
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=name)


@needs_compiler_budget
def test_the_compilers_per_block_budget_is_refused_in_a_whole_model_graph_and_warned_about_eagerly(tmp_path):
    model = _model(GraphCount())
    cb = ActivationCheckpointing(policy="modes:off,compiler:0.5")
    with pytest.raises(ValueError, match=r"modes \['compiler:0.5'\], but the whole model is one compiled graph.*"
                                         r"block\.compile\(\)"):
        _fit(tmp_path, model, [cb], steps=2)
    cb = ActivationCheckpointing(policy="modes:off,compiler:0.5")
    with pytest.warns(RuntimeWarning, match=r"act only on blocks compiled one by one.*run as 'off'"):
        _fit(tmp_path / "eager", _model(), [cb], steps=2)
