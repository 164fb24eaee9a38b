"""Issue 34's measurement defects, each against a count the callback does not own (CPU, real ``Trainer.fit`` runs).

- the end-of-fit report (text, JSON, timeline image) for every combination of ``max_steps`` and
  ``log_every_n_steps``: it reads the last measured step, never an unmeasured one's empty result;
- the step time from the step's own start: a checkpoint save after the step is no step's time (wall clocks kept by
  callbacks around the steps);
- reference (exact) steps: their per-operation instrumentation is no step's time; the point is the next ordinary
  step's figures (tokens counted independently, wall clocks around that step);
- the activation line under accumulation with micro-batches of different lengths in one bucket (against the
  step's own exact reference figure and an independent dispatch-mode live-tensor count).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from _lightning_models import TinyTransformer, trainer_kwargs
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from lightning_ckpt.lightning.callback import ActivationCheckpointing
from lightning_ckpt.lightning.engine import REPORT_FILE, TIMELINE_FILE
from lightning_ckpt.measure.timeline import matplotlib_available

# ----------------------------------------------------------------------------------------------- the report


def _logging_steps(max_steps: int, every: int) -> list:
    """Lightning's logging steps (``should_update_logs``): the optimizer steps ``x`` with ``(x + 1) % every == 0``."""
    return [x for x in range(max_steps) if (x + 1) % every == 0]


@pytest.mark.parametrize("max_steps", [1, 3, 7])
@pytest.mark.parametrize("every", [1, 2, 5, 50])
def test_the_report_is_written_for_every_max_steps_and_log_every_n_steps(tmp_path, max_steps, every):
    """On the old code the last step's empty result (a step that is not logged) replaced the last measured one:
    ``cb.report()`` said "no step has been measured yet" and no JSON or timeline was written (7 steps logging every
    5; and with no logging step at all, 3 steps every 5). The report reads the last measured step: the last logging
    step, or the fit's first step, which is always measured when the report is on."""
    cb = ActivationCheckpointing(policy="every:2")
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=max_steps, log_every_n_steps=every,
                                                       limit_val_batches=0, num_sanity_val_steps=0))
    trainer.fit(TinyTransformer())
    text = cb.report()
    assert "no step has been measured" not in text and "memory ledger" in text
    folder = trainer.log_dir or trainer.default_root_dir
    with open(os.path.join(folder, REPORT_FILE)) as fh:
        data = json.load(fh)
    logged = _logging_steps(max_steps, every)
    assert data["step"] == (logged or [0])[-1]
    assert data["logged"] == bool(logged)
    assert data["lines"]["activations"]["bytes"] > 0
    if matplotlib_available():
        assert os.path.exists(os.path.join(folder, TIMELINE_FILE))


def test_each_fit_reports_its_own_steps_and_report_false_measures_no_extra_step(tmp_path):
    """A second fit with the same callback reports its own first step, not the first fit's last one; with
    ``report=False`` a fit without a logging step measures nothing."""
    cb = ActivationCheckpointing(policy="every:2")
    for i, (steps, every) in enumerate(((3, 1), (2, 50))):
        trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path / str(i), max_steps=steps, log_every_n_steps=every,
                                                           limit_val_batches=0, num_sanity_val_steps=0))
        trainer.fit(TinyTransformer())
        with open(os.path.join(trainer.log_dir, REPORT_FILE)) as fh:
            assert (json.load(fh)["step"], cb.last_result is not None) == ((2, True), (0, True))[i]
    quiet = ActivationCheckpointing(policy="every:2", report=False)
    Trainer(callbacks=[quiet], **trainer_kwargs(tmp_path / "quiet", max_steps=2, log_every_n_steps=50,
                                                limit_val_batches=0, num_sanity_val_steps=0)).fit(TinyTransformer())
    assert quiet.last_result is None


# ------------------------------------------------------------------------------------------------- step time


class Writes(Logger):
    """A logger that keeps every ``log_metrics`` call: ``{tag: {step: value}}`` (a step written twice fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.series: dict = {}

    @property
    def name(self) -> str:
        return "writes"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        for tag, value in metrics.items():
            series = self.series.setdefault(tag, {})
            assert step not in series, (tag, step)
            series[step] = value


class StepStart(Callback):
    """Put before ActivationCheckpointing: the wall clock at each optimizer step's first micro-batch, and the
    step's tokens counted here (the ids' size: these batches have no padding)."""

    def __init__(self) -> None:
        self.start, self.tokens = {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        self.start.setdefault(step, time.perf_counter())
        self.tokens[step] = self.tokens.get(step, 0) + batch[0].numel()


class StepEnd(Callback):
    """Put after ActivationCheckpointing: the wall clock when its ``on_train_batch_end`` is over (before a
    ``ModelCheckpoint``, which Lightning runs last), and what it measured."""

    def __init__(self, cb) -> None:
        self.cb, self.end, self.results = cb, {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop._should_accumulate():
            return
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        self.end[step] = time.perf_counter()
        self.results[step] = self.cb.last_result  # every step is logged, so measured, here


_SAVE_S = 0.3


class SlowSave(ModelCheckpoint):
    """A checkpoint save that takes ``_SAVE_S`` seconds more (a large model on a slow disk)."""

    def _save_checkpoint(self, trainer, filepath) -> None:
        time.sleep(_SAVE_S)
        super()._save_checkpoint(trainer, filepath)


class GrowingBatches(TinyTransformer):
    """Step ``x`` trains on ``x + 5`` samples (one shape bucket, up to 8): each step's token count is its own, so a
    logged point says which step it was timed on."""

    def train_dataloader(self):
        from _lightning_models import token_dataset

        data = token_dataset(64, 0)
        sizes = range(5, 9)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return DataLoader([(data.tensors[0][a:a + n], data.tensors[1][a:a + n]) for a, n in zip(starts, sizes)],
                          batch_size=None)


def _fit_timed(tmp_path, steps: int, **kwargs):
    cb = ActivationCheckpointing(policy="every:2")
    start, end, writes = StepStart(), StepEnd(cb), Writes()
    callbacks = [start, cb, end, *kwargs.pop("callbacks", [])]
    Trainer(callbacks=callbacks, **trainer_kwargs(tmp_path, max_steps=steps, log_every_n_steps=1,
                                                  limit_val_batches=0, num_sanity_val_steps=0, logger=writes,
                                                  **kwargs)).fit(GrowingBatches())
    return cb, start, end, writes.series


def test_a_checkpoint_save_is_no_step_s_time(tmp_path):
    """A save after every step (``ModelCheckpoint``, after the callback's ``on_train_batch_end``) that sleeps
    0.3 s: each logged step time lies inside the wall clocks kept around that step's own hooks, which the save is
    outside of. On the old code a step's time ran from the previous step's end, so it held the save."""
    steps = 5
    save = SlowSave(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
    cb, start, end, series = _fit_timed(tmp_path, steps, callbacks=[save], enable_checkpointing=True)
    assert len(os.listdir(tmp_path / "ckpt")) == steps  # the saves happened, between the steps
    step_s = series["time/step_s"]
    ordinary = [x for x in range(steps) if not end.results[x].reading.exact]
    assert ordinary and ordinary[-1] == steps - 1
    for x in ordinary:
        assert 0 < step_s[x] == end.results[x].step_s <= end.end[x] - start.start[x], x


def test_a_reference_step_logs_the_time_and_throughput_of_the_next_ordinary_step(tmp_path):
    """Reference steps (here the first two: the optimizer state appears at the first) run the per-operation
    instrumentation, 3-4x slow: their points carry the figures of the first ordinary step after them — its tokens,
    counted here, over a time inside the wall clocks around it. On the old code a reference step logged its own
    time, instrumentation included (the first point of every run 3.8x low)."""
    steps = 4
    cb, start, end, series = _fit_timed(tmp_path, steps)
    instrumented = [x for x in range(steps) if end.results[x].reading.exact]
    assert instrumented == [0, 1]
    tps, sps, step_s = (series[k] for k in ("throughput/tokens_per_sec", "throughput/samples_per_sec",
                                           "time/step_s"))
    assert sorted(tps) == sorted(sps) == sorted(step_s) == list(range(steps))  # every logged step has its point
    assert sorted(series["train_loss"]) == list(range(steps))
    for x in range(steps):
        timed_on = 2 if x in instrumented else x  # the first ordinary step
        assert tps[x] * step_s[x] == pytest.approx(start.tokens[timed_on], rel=1e-6), x
        assert sps[x] * step_s[x] == pytest.approx(timed_on + 5, rel=1e-6), x
        assert 0 < step_s[x] <= end.end[timed_on] - start.start[timed_on], x
    assert cb.last_metrics["time/step_s"] == step_s[steps - 1]
    assert [x for x in range(steps) if end.results[x].instrumented] == instrumented


# ------------------------------------------------------------------------ activations under uneven accumulation

_SHORT, _LONG = 36, 64  # one bucket (lengths up to 64): one key, one reference step


def _gpt_batch(T: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 2048, (4, T + 1), generator=g)
    return {"input_ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}


@pytest.mark.parametrize("policy", ["none", "all"])
def test_uneven_micro_batches_in_one_bucket_read_the_activation_line_of_the_longest(tmp_path, policy):
    """Two micro-batches per step, 36 and 64 tokens long, in one shape bucket, their order alternating: the
    reference step (step 1, the first with optimizer state) and the later steps report the same activation line,
    the longest micro-batch's, which an independent live-tensor tracker (MemTracker's ACT peak) confirms. On the old
    code a later step scaled the reference's correction (the logits' float32 upcast: large with a 2048-token
    vocabulary) by its *first* micro-batch's tokens over the reference's first: 64/36 too high when the long one
    came first."""
    pytest.importorskip("torch.distributed._tools.mem_tracker")
    from _independent import benchmark_common
    from lightning.pytorch import seed_everything

    from lightning_ckpt.demos import GPTLightningModule

    seed_everything(0)
    model = GPTLightningModule(vocab_size=2048, n_layer=2, n_embd=32, n_head=4, block_size=_LONG)
    lengths = [_SHORT, _LONG, _SHORT, _LONG, _LONG, _SHORT, _SHORT, _LONG]  # steps: (s, l), (s, l), (l, s), (s, l)
    batches = [_gpt_batch(T, i) for i, T in enumerate(lengths)]
    cb = ActivationCheckpointing(policy=policy)
    end = StepEnd(cb)
    Trainer(callbacks=[cb, end], **trainer_kwargs(tmp_path, max_steps=4, log_every_n_steps=1,
                                                  accumulate_grad_batches=2, limit_val_batches=0,
                                                  num_sanity_val_steps=0)).fit(
        model, train_dataloaders=DataLoader(batches, batch_size=None))
    readings = [end.results[x].reading for x in range(4)]
    assert [r.reference for r in readings] == [True, True, False, False]  # steps 1-3: one key
    reference = readings[1].activations
    assert [r.activations for r in readings[2:]] == pytest.approx([reference] * 2, rel=0.01)

    long = batches[-1]
    model.zero_grad(set_to_none=True)

    def step() -> None:
        model.compute_loss(long).backward()

    tracked = benchmark_common().measure_memory(step, external=(model, long["input_ids"], long["labels"])).act_peak
    assert reference == pytest.approx(tracked, rel=0.10)


# --------------------------------------------------------------------------- every logged line, one matrix run


def _padded(T: int, real: int, seed: int) -> dict:
    batch = _gpt_batch(T, seed)
    batch["attention_mask"] = (torch.arange(T) < real).long().expand(4, T).contiguous()
    return batch


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("policy", ["none", "every:2"])
def test_every_logged_line_against_an_independent_count_uneven_accumulation_with_saves(tmp_path, policy):
    """Two padded micro-batches of different lengths per step (64 then 36 tokens, reversed at steps 2 and 4; one
    bucket), a checkpoint saved after every step, every step logged. Against counts the plugin does not own:

    - ``activations``: a dispatch-mode live-tensor count (``_independent.LiveForward``) of the longest micro-batch's
      forward and backward, on reference and ordinary steps alike;
    - ``params``, ``grads``, ``optimizer``: ``numel x element_size`` sums over the real tensors;
    - ``tokens_per_sec``, ``samples_per_sec``, ``step_s``: the masks' non-padding tokens and the samples counted by
      a callback, over a time inside the wall clocks around the step (a reference step's point: the next ordinary
      step's), the saves outside it;
    - ``checkpointing/blocks``: the plan's count.
    """
    from _independent import LiveForward
    from lightning.pytorch import seed_everything

    from lightning_ckpt.demos import GPTLightningModule

    seed_everything(0)
    model = GPTLightningModule(vocab_size=2048, n_layer=2, n_embd=32, n_head=4, block_size=_LONG)
    order = [(_LONG, _SHORT), (_LONG, _SHORT), (_SHORT, _LONG), (_LONG, _SHORT), (_SHORT, _LONG)]
    batches = [_padded(T, T - 3 * i - 1, 10 * i + j) for i, pair in enumerate(order) for j, T in enumerate(pair)]
    steps = len(order)

    class MaskTokens(StepStart):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            self.start.setdefault(step, time.perf_counter())
            self.tokens[step] = self.tokens.get(step, 0) + int(batch["attention_mask"].sum())

    cb = ActivationCheckpointing(policy=policy)
    start, end, writes = MaskTokens(), StepEnd(cb), Writes()
    save = SlowSave(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
    Trainer(callbacks=[start, cb, end, save], **trainer_kwargs(
        tmp_path, max_steps=steps, log_every_n_steps=1, accumulate_grad_batches=2, limit_val_batches=0,
        num_sanity_val_steps=0, logger=writes, enable_checkpointing=True)).fit(
        model, train_dataloaders=DataLoader(batches, batch_size=None))
    series = writes.series

    long = batches[-1]  # the longest micro-batch's shape: the step's activation peak
    model.zero_grad(set_to_none=True)
    with LiveForward() as live:
        model.compute_loss(long).backward()
    expected_act = live.peak["activations"]
    params = list(model.parameters())
    state = [t for s in model.trainer.optimizers[0].state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    reference = [x for x in range(steps) if end.results[x].reading.exact]
    assert reference == [0, 1]
    gib = 2**30
    for x in range(steps):
        timed_on = next(t for t in range(x, steps) if t not in reference)
        assert round(series["memory/activations_gib"][x] * gib) == pytest.approx(expected_act, rel=0.01), x
        assert round(series["memory/params_gib"][x] * gib) == _nbytes(params)
        assert round(series["memory/grads_gib"][x] * gib) == _nbytes(params)
        assert round(series["memory/optimizer_gib"][x] * gib) == _nbytes(state)
        assert series["checkpointing/blocks"][x] == cb.plan.num_checkpointed
        step_s = series["time/step_s"][x]
        assert series["throughput/tokens_per_sec"][x] * step_s == pytest.approx(start.tokens[timed_on], rel=1e-6)
        assert series["throughput/samples_per_sec"][x] * step_s == pytest.approx(8, rel=1e-6)
        assert 0 < step_s <= end.end[timed_on] - start.start[timed_on], x
    assert len(set(start.tokens.values())) == steps  # each step's own count: a point says which step timed it
