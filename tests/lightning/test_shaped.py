"""``budget:`` per batch shape in a Trainer (:mod:`lightning_ckpt.lightning.shaped`): the plan of each step is
chosen from its batch's shape before its forward."""

from __future__ import annotations

import pytest
import torch
from _lightning_models import lm_batch, params_of, step_activations, trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.decide.shapes import Shape
from lightning_ckpt.demos import GPTLightningModule
from lightning_ckpt.demos.hf import HFCausalLMModule
from lightning_ckpt.lightning.autotoggle import AutoToggle
from lightning_ckpt.lightning.budgeting import BudgetFeature

MiB = 2**20
VOCAB = 96


def _batch(length: int, samples: int = 4, seed: int = 0) -> dict:
    return lm_batch(length, samples, seed, VOCAB)


class Steps(Callback):
    """Per optimizer step: the plan it ran and the activation peak the meter measured (when it measured)."""

    def __init__(self) -> None:
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)]
        length = batch["input_ids"].shape[1] if isinstance(batch, dict) else batch[0].shape[1]
        self.rows.append((length, cb.plan.modes, step_activations(trainer)))


def _fit(tmp_path, model, batches, policy, steps=None, callbacks=(), **kwargs):
    seed_everything(0)
    cb = ActivationCheckpointing(policy=policy, **kwargs.pop("callback", {}))
    rec = Steps()
    trainer = Trainer(callbacks=[cb, rec, *callbacks], **trainer_kwargs(tmp_path, max_steps=steps or len(batches),
                                                             limit_val_batches=0, num_sanity_val_steps=0,
                                                             log_every_n_steps=1, **kwargs))
    trainer.fit(model, DataLoader(batches, batch_size=None))
    return cb, rec.rows


def _gpt(block_size=256):
    seed_everything(0)
    return GPTLightningModule(n_layer=4, n_embd=64, n_head=4, block_size=block_size, vocab_size=VOCAB, dropout=0.0)


def test_a_curriculum_runs_its_first_long_step_within_the_budget(tmp_path):
    """Calibrated on 32-token batches, the first 256-token batch is planned before it runs: within the budget,
    with blocks checkpointed that the short batches keep (today's single plan ran it un-checkpointed, over budget).
    """
    budget = 8 * MiB
    batches = [_batch(32, seed=i) for i in range(16)] + [_batch(256, seed=i) for i in range(3)]
    cb, rows = _fit(tmp_path, _gpt(), batches, "budget:8MiB")
    long = [(modes, peak) for length, modes, peak in rows if length == 256]
    short = [modes for length, modes, _ in rows[14:] if length == 32]  # after the calibration
    assert all(peak is not None and peak <= budget for _, peak in long), long
    assert all(m == ("off",) * 4 for m in short)  # short batches pay no recompute
    assert all(sum(m != "off" for m in modes) >= 2 for modes, _ in long)  # the long ones are checkpointed
    plans = cb.shape_plans
    assert set(plans) == {Shape(4, (32,)), Shape(4, (256,))}
    longest = plans[Shape(4, (256,))]
    assert longest.source == "fake" and longest.steps == 3 and abs(longest.error) <= 0.02
    assert longest.predicted_peak <= budget
    metrics = cb.last_metrics  # the last (256-token) step's bucket and plan, as logged
    assert metrics["shape/length"] == 256 and metrics["shape/samples"] == 4
    assert metrics["shape/blocks_off"] + metrics["shape/blocks_recompute"] + metrics["shape/blocks_selective"] == 4
    assert metrics["shape/blocks_off"] == longest.modes.count("off")


def test_without_per_shape_plans_the_long_step_would_have_run_over_the_budget(tmp_path):
    """The control of the test above: the calibration's own plan for 32 tokens, kept for a 256-token batch."""
    batches = [_batch(32, seed=i) for i in range(16)] + [_batch(256)]
    cb, rows = _fit(tmp_path, _gpt(), batches, "budget:8MiB")
    calibrated = cb.calibration.chosen.modes
    assert calibrated == ("off",) * 4  # what the 32-token plan is
    _, plain_rows = _fit(tmp_path / "plain", _gpt(), [_batch(256)] * 2, "none")
    assert plain_rows[-1][2] > 8 * MiB  # run un-checkpointed, the long batch is over the budget


def test_the_configs_maximum_positions_never_refuse_a_run_and_the_longest_length_is_found_before_step_1(tmp_path):
    """The model declares 256 positions; the data has 32 tokens. A budget no plan meets at 256 but met at 32 is not
    refused (it was: 'cannot be met at the longest shape this run can see, 4 x 256'): before step 1 the longest
    length the budget holds at this micro-batch is found on fake tensors, reported, and true: every block recomputed
    fits there and not much further (the next 8 tokens do not)."""
    import logging

    records, checked = [], {}
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())

    class Check(Callback):  # after the first step, while the run's batch is at hand: every block recomputed, traced
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            (cb,) = [c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)]
            shapes = cb._engine.feature(BudgetFeature).shapes
            if batch_idx == 0 and shapes.longest is not None:
                n = shapes.longest.lengths[0]
                checked.update({length: shapes.trace(Shape(4, (length,)), [("recompute",) * 4])[0]
                                for length in (n, n + 8)})

    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    try:
        cb, rows = _fit(tmp_path, _gpt(), [_batch(32, seed=i) for i in range(4)], "budget:3MiB", callbacks=[Check()])
    finally:
        logging.getLogger("lightning.pytorch.utilities.rank_zero").removeHandler(handler)
    longest, target = cb._engine.feature(BudgetFeature).shapes.longest, cb.calibration.target
    assert longest is not None and longest.samples == 4 and 32 <= longest.lengths[0] < 256
    n = longest.lengths[0]
    assert checked[n] <= target < checked[n + 8] / 0.97  # it holds there, and the search stopped near the limit
    said = [m for m in records if "holds micro-batch 4 up to" in m]
    assert len(said) == 1 and f"up to {longest.lengths[0]:,} tokens" in said[0], records
    assert all(peak is None or peak <= 3 * MiB for _, _, peak in rows)
    # the report: the worst step against the budget (the calibration's included), the longest length, pricing time
    import json

    figures = json.loads((tmp_path / "csv" / "version_0" / "lightning_ckpt_report.json").read_text())["budget"]
    assert figures["worst_step"] == max(peak for _, _, peak in rows if peak is not None)
    assert figures["worst_step_ratio"] <= 1 and figures["longest"] == str(longest) and figures["pricing_s"] > 0
    assert figures["calibration_steps"] >= 13 and not cb.calibration.done  # said while it calibrates too


def test_an_explicit_max_shape_no_plan_meets_fails_before_the_first_step(tmp_path):
    model = _gpt()
    before = params_of(model)
    with pytest.raises(ValueError, match=r"raise the budget to at least .* MiB, pass a shorter max_shape .* "
                                         r"max_shape='4 x 256'"):
        _fit(tmp_path, model, [_batch(32)] * 4, "budget:3MiB", callback=dict(max_shape="4x256"))
    assert all(torch.equal(v, params_of(model)[k]) for k, v in before.items())  # no step ran
    # the same budget with the data's own longest shape named: it fits there
    _fit(tmp_path / "capped", _gpt(), [_batch(32)] * 2, "budget:3MiB", callback=dict(max_shape="4x32"))


def test_plans_switching_per_step_train_bitwise_as_the_plain_model(tmp_path):
    lengths = [32] * 14 + [128, 32, 256, 64, 128, 32]
    batches = [_batch(n, seed=i) for i, n in enumerate(lengths)]
    shaped, plain = _gpt(), _gpt()
    _, rows = _fit(tmp_path / "shaped", shaped, batches, "budget:6MiB")
    _fit(tmp_path / "plain", plain, batches, "none")
    assert len({modes for _, modes, _ in rows[14:]}) >= 2  # the plan did change between steps
    for k, v in params_of(plain).items():
        assert torch.equal(v, params_of(shaped)[k]), k


def test_each_micro_batch_of_an_accumulation_window_gets_its_bucket_plan(tmp_path):
    lengths = [32] * 20 + [32, 256, 256, 32, 64, 256]
    batches = [_batch(n, seed=i) for i, n in enumerate(lengths)]
    shaped, plain = _gpt(), _gpt()
    cb, rows = _fit(tmp_path / "shaped", shaped, batches, "budget:8MiB", steps=len(lengths) // 2,
                    accumulate_grad_batches=2)
    _fit(tmp_path / "plain", plain, batches, "none", steps=len(lengths) // 2, accumulate_grad_batches=2)
    by_length = {}
    for length, modes, _ in rows[20:]:
        by_length.setdefault(length, set()).add(modes)
    assert by_length[256] != by_length[32]  # micro-batches of one step ran different plans
    for k, v in params_of(plain).items():
        assert torch.equal(v, params_of(shaped)[k]), k


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_prediction_for_lengths_never_run_holds_on_a_hugging_face_llama(tmp_path, attention):
    """Eager attention keeps a (length x length) score matrix per head: the quadratic term is traced, not assumed,
    so the first step of each longer bucket reads within 2 % of its prediction."""
    pytest.importorskip("transformers")
    seed_everything(0)
    model = HFCausalLMModule(n_layer=3, n_embd=64, n_head=4, n_positions=256, vocab_size=VOCAB, arch="llama")
    model.model.config._attn_implementation = attention
    batches = [_batch(32, seed=i) for i in range(14)] + [_batch(128), _batch(256), _batch(64)]
    cb, _ = _fit(tmp_path, model, batches, "budget:20MiB")
    errors = {b: p.error for b, p in cb.shape_plans.items() if p.source == "fake"}
    assert set(errors) == {Shape(4, (64,)), Shape(4, (128,)), Shape(4, (256,))}
    assert all(e is not None and abs(e) <= 0.02 for e in errors.values()), errors


def test_a_shape_no_plan_fits_is_named_before_its_step_and_the_plan_says_which_bucket_it_runs(tmp_path):
    """max_shape says 64 tokens at most; a 256-token batch arrives anyway: before it runs, a warning names the
    smallest budget that fits it and the shape, and it runs under the plan with the lowest predicted peak."""
    batches = [_batch(32, seed=i) for i in range(24)] + [_batch(256)]
    with pytest.warns(UserWarning, match=r"raise the budget to at least .* MiB, or shorten batches of shape 4 x 256 "
                                         r"\(micro-batch x length\): no plan meets 'budget:3MiB' there"):
        cb, rows = _fit(tmp_path, _gpt(), batches, "budget:3MiB", callback=dict(max_shape="4x64"))
    assert rows[-1][1] == ("recompute",) * 4 and not cb.shape_plans[Shape(4, (256,))].fits
    assert "planned per batch shape (buckets: each dimension rounded up to a power of two" in cb.plan.summary()
    assert "bucket 4 x 256" in cb.plan.summary()


def test_the_allocators_cache_over_varying_shapes_is_reported_with_the_fix_when_it_grew(tmp_path):
    """On CUDA every measured step logs memory/cache_gib; fed here as a GPU run would (the CPU has no cache)."""
    batches = [_batch(32, seed=i) for i in range(15)]
    cb, _ = _fit(tmp_path, _gpt(), batches, "budget:8MiB")
    shapes, key = cb._engine.feature(BudgetFeature).shapes, cb._engine.measurement.key
    cb._engine.capacity = 4 * 2**30
    assert shapes.cache_report() is None  # no allocator on the CPU: nothing invented
    for cache in (0.10, 0.12, 0.11):
        shapes.after_step(None, None, None, {key("memory/cache_gib"): cache}, key)
    steady = shapes.cache_report()
    assert steady["readings"] == 3 and steady["advice"] is None  # 20 MiB of movement: no fragmentation
    shapes.after_step(None, None, None, {key("memory/cache_gib"): 0.45}, key)
    grew = shapes.cache_report()
    assert abs(grew["max"] - 0.45 * 2**30) <= 1 and "expandable_segments:True" in grew["advice"]
    assert "expandable_segments" in cb.report()


def test_the_auto_toggle_raises_a_long_batch_before_it_runs_and_short_ones_stay_on_the_controllers_rung(tmp_path):
    """auto_threshold at 6 MiB: 32-token batches stay on 'none'; the first 256-token batch is put on the rung its
    shape needs before its forward and reads under the threshold; the next short batch runs 'none' again. With
    per_shape=False the same long batch runs on 'none' and crosses the threshold (the controller reacts after)."""
    batches = [_batch(32, seed=i) for i in range(6)] + [_batch(256), _batch(32), _batch(256)]
    cb, rows = _fit(tmp_path, _gpt(), batches, None, callback=dict(auto_threshold="6MiB"))
    by_step = [(length, sum(m != "off" for m in modes), peak) for length, modes, peak in rows]
    assert all(n == 0 for length, n, _ in by_step if length == 32)  # the controller's rung: none
    long = [(n, peak) for length, n, peak in by_step if length == 256]
    assert all(n > 0 and peak <= 6 * MiB for n, peak in long), long
    assert cb.controller.level == 0  # raised steps taught the controller nothing about its rung
    gate = cb._engine.feature(AutoToggle).gate.report()
    assert "2 x" not in str(gate) and "4 x 256" in gate["buckets"]
    after, plain = _fit(tmp_path / "after", _gpt(), batches[:7], None,
                        callback=dict(auto_threshold="6MiB", per_shape=False))
    assert plain[6][0] == 256 and plain[6][2] > 6 * MiB  # ran on 'none', over the threshold
    assert after.controller.level == 1  # and the controller moved up after it


def test_blocks_compiled_one_by_one_get_per_shape_plans_without_running_out_of_dynamos_cache(tmp_path, monkeypatch):
    """A block compiled with block.compile() takes one graph per mode and per static/dynamic lengths: per-shape plans
    over lengths 32..256 stay compiled (no frame falls back to eager at dynamo's recompile limit), the limit the
    user had comes back after the run, and the predictions hold. The compiler's full-recompute budget is priced
    cheapest, so the longer buckets take it: their eager reference steps (where those blocks run ``off``) are
    corrected by what the compiled blocks save at *their* shape, not at the calibration's (a 128-token step read
    +184 % against its prediction that way, whenever the measured times made the solver pick ``compiler:0``)."""
    import torch._dynamo
    import torch._dynamo.config as dynamo_config
    from _lightning_models import BlockCompiledGPT
    from torch._dynamo.utils import counters

    from lightning_ckpt.core.policy import compiler_budget_unavailable
    from lightning_ckpt.decide import block_timing

    real_seconds, real_kept = block_timing.time_block_modes, block_timing.saved_block_bytes
    monkeypatch.setattr(block_timing, "time_block_modes", lambda *a, **k: {
        m: (0.0 if m.startswith("compiler:") else max(s, 1e-3)) for m, s in real_seconds(*a, **k).items()})
    monkeypatch.setattr(block_timing, "saved_block_bytes", lambda *a, **k: {
        m: (0 if m == "compiler:0" else kept) for m, kept in real_kept(*a, **k).items()})
    torch._dynamo.reset()
    counters.clear()
    limit = dynamo_config.recompile_limit
    seed_everything(0)
    model = BlockCompiledGPT(n_layer=4, n_embd=64, n_head=4, block_size=256, vocab_size=VOCAB, dropout=0.0)
    lengths = [32] * 12 + [256, 32, 64, 128, 256, 32, 64, 128]
    cb, rows = _fit(tmp_path, model, [_batch(n, seed=i) for i, n in enumerate(lengths)], "budget:6MiB")
    assert counters["frames"]["total"] == counters["frames"]["ok"]  # every frame compiled: none hit the limit
    assert dynamo_config.recompile_limit == limit
    assert len({modes for _, modes, _ in rows[12:]}) >= 2
    if compiler_budget_unavailable() is None:  # torch 2.11 has no compiler budgets: recompute stands in for them
        assert "compiler:0" in cb.shape_plans[Shape(4, (128,))].modes
    errors = {str(b): p.error for b, p in cb.shape_plans.items() if p.source == "fake"}
    assert all(e is not None and abs(e) <= 0.02 for e in errors.values()), errors
    torch._dynamo.reset()


def _t5_module():
    transformers = pytest.importorskip("transformers")
    from lightning.pytorch import LightningModule

    class T5Module(LightningModule):
        def __init__(self):
            super().__init__()
            config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2,
                                           num_decoder_layers=2, dropout_rate=0.0, decoder_start_token_id=0)
            self.model = transformers.T5ForConditionalGeneration(config)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    seed_everything(0)
    return T5Module()


def _seq2seq(source: int, target: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed * 1000 + source * 7 + target)
    return {"input_ids": torch.randint(1, VOCAB, (4, source), generator=g),
            "labels": torch.randint(1, VOCAB, (4, target), generator=g)}


def test_an_encoder_decoder_is_planned_per_source_and_target_length(tmp_path):
    pairs = [(32, 16)] * 16 + [(128, 16), (32, 64), (128, 64), (32, 16)]
    batches = [_seq2seq(s, t, seed=i) for i, (s, t) in enumerate(pairs)]
    shaped, plain = _t5_module(), _t5_module()
    cb, rows = _fit(tmp_path / "shaped", shaped, batches, "budget:3MiB")
    _fit(tmp_path / "plain", plain, batches, "none")
    plans = cb.shape_plans
    assert {Shape(4, (128, 16)), Shape(4, (32, 64)), Shape(4, (128, 64))} <= set(plans)
    # blocks 0-1 are the encoder's, 2-3 the decoder's: a long source recomputes encoder blocks, a long target decoder
    assert plans[Shape(4, (32, 16))].modes == ("off",) * 4
    assert plans[Shape(4, (128, 16))].modes[:2] != ("off", "off") and plans[Shape(4, (128, 16))].modes[2:] == (
        "off", "off")
    assert plans[Shape(4, (32, 64))].modes[:2] == ("off", "off") and plans[Shape(4, (32, 64))].modes[2:] != (
        "off", "off")
    assert all(p.error is not None and abs(p.error) <= 0.02 for p in plans.values() if p.source == "fake"), plans
    for k, v in params_of(plain).items():
        assert torch.equal(v, params_of(shaped)[k]), k


def test_tensorboard_gets_each_bucket_plan_as_text_and_the_steps_bucket_as_scalars(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    batches = [_batch(32, seed=i) for i in range(15)] + [_batch(256), _batch(64)]
    seed_everything(0)
    cb = ActivationCheckpointing(policy="budget:8MiB")
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=len(batches), limit_val_batches=0,
                                                       num_sanity_val_steps=0, log_every_n_steps=1, logger=logger))
    trainer.fit(_gpt(), DataLoader(batches, batch_size=None))
    logger.experiment.flush()
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("lightning_ckpt/shape_plans/text_summary")]
    assert any(t.startswith("bucket 4 x 256: 0: ") for t in texts), texts
    lengths = [e.value for e in acc.Scalars("shape/length")]
    assert lengths[-2:] == [256.0, 64.0]
    assert [e.value for e in acc.Scalars("shape/blocks_off")][-1] == 4.0


@pytest.mark.parametrize("lengths, accumulate", [
    ([32] * 6 + [64] + [32] * 23, 1),  # one batch of another length during the calibration
    ([32, 64] * 15, 1),  # lengths alternating every step
    ([32, 64] * 20, 2),  # every accumulation window mixes the two lengths
], ids=["one-other", "alternating", "accumulation-mixed"])
def test_lengths_that_vary_during_the_calibration_neither_crash_nor_stall_nor_cross_the_budget(tmp_path, lengths,
                                                                                                accumulate):
    """The old code restored the previous, counted stage's snapshot when a batch of another length came (then
    crashed: "mode 'selective' has no measured cost for this block"), and never finished calibrating when every
    accumulation window held a micro-batch of another length (stage 0 of 9 after 40 steps)."""
    budget = 3 * MiB
    cb, rows = _fit(tmp_path, _gpt(), [_batch(n, seed=i) for i, n in enumerate(lengths)], "budget:3MiB",
                    steps=len(lengths) // accumulate, accumulate_grad_batches=accumulate)
    calibration = cb.calibration
    assert calibration.done and calibration.chosen.fits
    measured = [peak for _, _, peak in rows if peak is not None]
    assert len(measured) >= len(lengths) // accumulate // 2 and max(measured) <= budget
    # the plan for the calibration's own length trains on: the steps after it read within the budget too
    assert cb.shape_plans and all(p.predicted_peak <= budget for p in cb.shape_plans.values())


def test_an_encoder_decoder_batch_whose_labels_are_as_long_as_its_inputs_is_planned_too(tmp_path):
    """A batch whose labels are as long as its input ids reads as one length; the old code resized the stored
    two-length batch to it and crashed ("cannot resize a batch of shape 4 x 32 x 16 to 4 x 32")."""
    pairs = [(32, 16)] * 16 + [(32, 32), (64, 64), (32, 16)]
    batches = [_seq2seq(s, t, seed=i) for i, (s, t) in enumerate(pairs)]
    cb, rows = _fit(tmp_path, _t5_module(), batches, "budget:3MiB")
    plans = cb.shape_plans
    assert {Shape(4, (32, 16)), Shape(4, (32,)), Shape(4, (64,))} <= set(plans)
    assert all(p.error is None or abs(p.error) <= 0.02 for p in plans.values()), plans
    assert all(peak is None or peak <= 3 * MiB for _, _, peak in rows)


class FeatureSequenceModule(GPTLightningModule):
    """The demo GPT fed float features ``[B, T, D]`` instead of token ids (a projection in place of the embedding)."""

    def __init__(self) -> None:
        super().__init__(n_layer=4, n_embd=64, n_head=4, block_size=512, vocab_size=VOCAB, dropout=0.0)
        self.project = torch.nn.Linear(16, 64)

    def training_step(self, batch, batch_idx):
        features, targets = batch
        x = self.project(features)
        for block in self.model.transformer.h:
            x = block(x)
        return torch.nn.functional.mse_loss(x.mean(-1), targets)


def test_a_float_sequence_batch_is_read_by_its_length_with_one_warning_naming_shape_fn(tmp_path):
    """``[B, T, D]`` features: the old code read D (16) as the length, so 24- and 64-step batches shared one bucket
    and the long one ran the short one's plan far over the budget, without a word."""
    def batch(steps: int, seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(4, steps, 16, generator=g), torch.randn(4, steps, generator=g)

    seed_everything(0)
    model = FeatureSequenceModule()
    with pytest.warns(UserWarning, match=r"pass shape_fn .* its float tensor \[4, 24, 16\] is read as \[samples, "
                                         r"length, features\], length 24"):
        cb, rows = _fit(tmp_path, model, [batch(24, i) for i in range(16)] + [batch(64, 99)] * 2, "budget:2MiB")
    assert Shape(4, (64,)) in cb.shape_plans and cb.calibration.done
    assert all(peak is None or peak <= 2 * MiB for _, _, peak in rows)


def test_a_batch_longer_than_the_budget_holds_warns_once_and_one_past_the_device_stops_before_its_forward(tmp_path):
    """Without max_shape: a batch longer than the longest length found runs the lowest plan with one warning naming
    its shape, its predicted peak and the budget; with the device's capacity known and that prediction (with the
    model state) past it, the run stops before the batch's forward, naming the length and the fixes, and the
    weights are those of the steps before it."""
    batches = [_batch(32, seed=i) for i in range(16)] + [_batch(256, seed=1)] * 2
    with pytest.warns(UserWarning, match=r"raise the budget to at least .* or shorten batches of shape 4 x 256 "
                                         r"\(micro-batch x length\): no plan meets 'budget:3MiB' there, so they run "
                                         r"under the plan with the lowest predicted activation peak"):
        cb, rows = _fit(tmp_path / "warn", _gpt(), batches, "budget:3MiB")
    assert rows[-1][1] == ("recompute",) * 4 and not cb.shape_plans[Shape(4, (256,))].fits

    model, seen = _gpt(), {}

    class Weights(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.update(params_of(pl_module))

    with pytest.raises(RuntimeError, match=r"shorten batches of shape 4 x 256 \(micro-batch x length\) to at most "
                                           r"4 x \d+, .* past the device's 8.0 MiB; it was stopped before its forward"):
        _fit(tmp_path / "stop", model, batches, "budget:3MiB", callback=dict(capacity="8MiB"), callbacks=[Weights()])
    assert all(torch.equal(v, params_of(model)[k]) for k, v in seen.items())  # nothing ran after the last step
