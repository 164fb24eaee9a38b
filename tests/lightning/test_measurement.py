"""Per-step measurement of the ActivationCheckpointing callback inside real ``Trainer.fit`` runs (CPU).

What is checked against what (each figure against an instrument the callback does not own):

- the activation line against PyTorch's live-tensor tracker (``MemTracker`` ACT peak, as in ``benchmarks/``);
- params / grads / optimizer lines against ``numel × element_size`` sums over the real tensors;
- tokens/s against tokens counted and wall-clock time measured by a second callback;
- multi-process reductions against each rank's own, unreduced figures.

The TensorBoard side (tags, steps, layout, the server) is in ``tests/test_tensorboard.py``.
"""

from __future__ import annotations

import glob
import math
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from _independent import benchmark_common
from _lightning_models import CleanDistributedExit, TinyTransformer, trainer_kwargs
from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.data._utils.collate import default_collate

from lightning_ckpt.core.units import GiB
from lightning_ckpt.demos import GPTLightningModule
from lightning_ckpt.lightning.callback import ActivationCheckpointing
from lightning_ckpt.measure.ledger import model_state_bytes

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ helpers


def _events(logdir) -> EventAccumulator:  # noqa: F821
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(os.path.join(str(logdir), "**", "events.out.tfevents.*"), recursive=True)
    assert len(files) == 1, files
    acc = EventAccumulator(files[0], size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _series(acc, tag) -> dict:
    """``{step: value}`` of one scalar tag (each step must appear once)."""
    events = acc.Scalars(tag)
    steps = [e.step for e in events]
    assert len(steps) == len(set(steps)), f"{tag}: a step was written twice: {steps}"
    return {e.step: e.value for e in events}


def _bytes(gib: float) -> int:
    """A logged GiB figure back to bytes (float32 in the event file: exact to well under a byte here)."""
    return round(gib * GiB)


class Record(Callback):
    """Put after ActivationCheckpointing: keeps, per optimizer step, what the callback measured and logged."""

    def __init__(self, cb: ActivationCheckpointing) -> None:
        self.cb = cb
        self.results = {}  # log step -> StepResult (this rank, unreduced)
        self.metrics = {}  # log step -> the metrics dict the callback logged (reduced over ranks)
        self.optimizer_state_before_first_step = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.optimizer_state_before_first_step is None:
            self.optimizer_state_before_first_step = (
                len(optimizer.state),
                model_state_bytes(pl_module, [optimizer]).optimizer,
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step Lightning logs this batch under
        self.results[step] = self.cb.last_result
        if self.cb.last_result is not None and self.cb.last_result.ledger is not None:
            self.metrics[step] = dict(self.cb.last_metrics)


def _batch(B: int, T: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 96, (B, T + 1), generator=g)
    return {"input_ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}


class SameBatch(LightningDataModule):
    """The same batch at every step (so every step's activation figure is the same quantity)."""

    def __init__(self, batch: dict, n: int = 8) -> None:
        super().__init__()
        self.batch, self.n = batch, n

    def train_dataloader(self):
        return DataLoader([self.batch] * self.n, batch_size=None)


def _gpt(n_layer: int = 4, n_embd: int = 64, T: int = 64) -> GPTLightningModule:
    seed_everything(0)
    return GPTLightningModule(n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=T, dropout=0.0)


# -------------------------------------------------------------------------------- activations vs a tracker


@pytest.mark.parametrize("policy", ["none", "every:2", "all"])
def test_activation_line_within_10_percent_of_a_live_tensor_tracker(tmp_path, policy):
    """The logged ``memory/activations_gib`` of a step vs MemTracker's ACT peak for the same step.

    Reference: ``torch.distributed._tools.mem_tracker.MemTracker`` (via ``benchmarks/_common``), which follows
    every storage an operator creates and labels it; its ACT line (forward outputs and checkpoint replays) is
    watched for its running maximum over one forward+backward of the same model, weights, policy and batch.
    """
    pytest.importorskip("torch.distributed._tools.mem_tracker")
    common = benchmark_common()
    B, T = 4, 64
    batch = _batch(B, T)
    model = _gpt(T=T)
    cb = ActivationCheckpointing(policy=policy)
    rec = Record(cb)
    Trainer(
        callbacks=[cb, rec],
        **trainer_kwargs(
            tmp_path,
            max_steps=2,
            log_every_n_steps=1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=TensorBoardLogger(str(tmp_path), name="tb"),
        ),
    ).fit(model, datamodule=SameBatch(batch))
    logged = _series(_events(tmp_path), "memory/activations_gib")
    assert sorted(logged) == [0, 1]
    measured = _bytes(logged[1])  # step 1: the replay interiors were calibrated at step 0 and are reused
    assert measured == rec.results[1].reading.activations
    assert logged[0] == logged[1]  # same batch, same figure, calibration step or not

    # the reference: the plan stays on the model after fit, so the same policy runs here
    assert cb.plan.spec == policy
    model.zero_grad(set_to_none=True)

    def step() -> None:
        model.compute_loss(batch).backward()

    reference = common.measure_memory(step, external=(model, batch["input_ids"], batch["labels"])).act_peak
    error = measured / reference - 1
    print(
        f"{policy}: callback {measured / 2**20:.3f} MiB, MemTracker ACT peak {reference / 2**20:.3f} MiB, "
        f"error {error:+.1%}"
    )
    assert abs(error) <= 0.10


def test_activation_line_falls_with_checkpointing(tmp_path):
    batch = _batch(4, 64)
    figures = {}
    for policy in ("none", "every:2", "all"):
        cb = ActivationCheckpointing(policy=policy)
        Trainer(
            callbacks=[cb],
            **trainer_kwargs(
                tmp_path / policy,
                max_steps=1,
                log_every_n_steps=1,
                limit_val_batches=0,
                num_sanity_val_steps=0,
            ),
        ).fit(_gpt(), datamodule=SameBatch(batch))
        figures[policy] = cb.last_metrics["memory/activations_gib"]
    assert figures["none"] > figures["every:2"] > figures["all"] > 0, figures


# ------------------------------------------------------------------------------ model-state lines, exact


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def test_model_state_lines_equal_numel_times_element_size_and_adam_state_appears_after_the_first_step(
    tmp_path,
):
    """GPT (tied embedding) + AdamW with two parameter groups, every step logged.

    The ledger is built after the optimizer step of the step it reports (gradients are still there, Lightning
    zeroes them before the next forward). So the *first logged* optimizer figure (step 0) already holds
    AdamW's state, which the step itself created: ``exp_avg`` + ``exp_avg_sq`` (each a float32 copy of the
    parameter) and a float32 scalar ``step`` per parameter. Right before that first ``optimizer.step()`` the
    state is empty.
    """
    model = _gpt(n_layer=2, n_embd=32, T=32)
    cb = ActivationCheckpointing(policy="every:2")
    rec = Record(cb)
    Trainer(
        callbacks=[cb, rec],
        **trainer_kwargs(
            tmp_path,
            max_steps=3,
            log_every_n_steps=1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=TensorBoardLogger(str(tmp_path), name="tb"),
        ),
    ).fit(model, datamodule=SameBatch(_batch(2, 32)))

    params = list(model.parameters())
    assert model.model.transformer.wte.weight is model.model.lm_head.weight  # tied: counted once
    param_bytes = _nbytes(params)
    assert param_bytes == 4 * sum(p.numel() for p in params)
    optimizer = model.trainer.optimizers[0]
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    state_bytes = _nbytes(state)
    assert state_bytes == 2 * param_bytes + 4 * len(params)  # exp_avg, exp_avg_sq, step (float32 scalar)

    # before the first optimizer.step(): no optimizer state, and the ledger walk agrees
    assert rec.optimizer_state_before_first_step == (0, 0)

    acc = _events(tmp_path)
    series = {line: _series(acc, f"memory/{line}_gib") for line in ("params", "grads", "optimizer")}
    for line, values in series.items():
        assert sorted(values) == [0, 1, 2], line
    for step in (0, 1, 2):
        assert _bytes(series["params"][step]) == param_bytes
        assert _bytes(series["grads"][step]) == param_bytes  # every parameter has its float32 .grad
        assert _bytes(series["optimizer"][step]) == state_bytes  # already at step 0, see the docstring
    assert "memory/optimizer_master_gib" not in acc.Tags()["scalars"]  # no master copies here


def test_optimizer_without_state_logs_a_measured_zero(tmp_path):
    """Plain SGD keeps no state: the optimizer line is a real 0 (measured), and it is logged as 0."""
    model = TinyTransformer(optimizer="sgd")
    cb = ActivationCheckpointing(policy="all")
    Trainer(
        callbacks=[cb],
        **trainer_kwargs(
            tmp_path,
            max_steps=2,
            log_every_n_steps=1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=TensorBoardLogger(str(tmp_path), name="tb"),
        ),
    ).fit(model)
    acc = _events(tmp_path)
    assert _series(acc, "memory/optimizer_gib") == {0: 0.0, 1: 0.0}
    param_bytes = _nbytes(list(model.parameters()))
    assert {s: _bytes(v) for s, v in _series(acc, "memory/params_gib").items()} == {
        0: param_bytes,
        1: param_bytes,
    }
    assert {s: _bytes(v) for s, v in _series(acc, "memory/grads_gib").items()} == {
        0: param_bytes,
        1: param_bytes,
    }


# ------------------------------------------------------------------------------------------------ tokens/s


_T = 32
_DATA_S = 0.05  # data loading per batch (collate)
_VAL_S = 0.4  # validation per batch


def _padded_dataset(n: int = 64) -> list:
    """Right-padded samples with 5..32 real tokens; padding is marked by ``attention_mask == 0``."""
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(n):
        length = 5 + (7 * i) % (_T - 4)
        ids = torch.randint(0, 96, (_T + 1,), generator=g)
        mask = (torch.arange(_T) < length).long()
        labels = ids[1:].clone()
        labels[length:] = -100
        items.append({"input_ids": ids[:-1] * mask, "labels": labels, "attention_mask": mask})
    return items


def _slow_collate(items):
    time.sleep(_DATA_S)
    return default_collate(items)


class PaddedData(LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_padded_dataset(), batch_size=4, collate_fn=_slow_collate)

    def val_dataloader(self):
        return DataLoader(_padded_dataset(8), batch_size=4)


class OutsideClock(Callback):
    """Wall clock and token count of each optimizer step, kept by a second callback (put it first).

    What it includes, and why that is the honest comparison: each step from the start of its batch to its end, as
    the callback times it; what runs between steps (the loading of the next batch, validation runs, checkpoint
    saves) is no step's, in both figures. Tokens are the non-padding entries of ``attention_mask``, counted here
    independently, per step.
    """

    def __init__(self) -> None:
        self.start, self.end, self.tokens, self.samples = {}, {}, {}, {}
        self.paused = 0.0
        self._val_start = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        self.start[step] = time.perf_counter()
        self.tokens[step] = int(batch["attention_mask"].sum())
        self.samples[step] = batch["input_ids"].shape[0]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end[trainer.fit_loop.epoch_loop._batches_that_stepped] = time.perf_counter()

    def on_validation_start(self, trainer, pl_module):
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.paused += time.perf_counter() - self._val_start

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        time.sleep(_VAL_S)  # a slow validation: were it counted, tokens/s would be far off

    def seconds(self, step: int) -> float:
        return self.end[step] - self.start[step]


class ClockEnd(Callback):
    """Put after ActivationCheckpointing: ends :class:`OutsideClock`'s step once the callback's own work is done."""

    def __init__(self, clock: OutsideClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clock.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def test_tokens_per_sec_agrees_with_an_outside_clock_padding_loading_and_validation_excluded(tmp_path):
    """Each logged step time lies inside the wall clocks kept around that step by callbacks before and after the
    plugin's (the loading of the next batch, 0.05 s, and validation, 0.4 s, between them are no step's), over the
    step's own non-padding tokens. A reference step's point carries the next ordinary step's figures (its own time
    holds the per-operation instrumentation)."""
    steps = 12
    clock, cb = OutsideClock(), ActivationCheckpointing(policy="every:2")
    rec = Record(cb)
    trainer = Trainer(
        callbacks=[clock, cb, rec, ClockEnd(clock)],
        **trainer_kwargs(
            tmp_path,
            max_steps=steps,
            log_every_n_steps=1,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            val_check_interval=5,
            logger=TensorBoardLogger(str(tmp_path), name="tb"),
        ),
    )
    trainer.fit(_gpt(n_layer=2, n_embd=32, T=_T), datamodule=PaddedData())
    assert clock.paused >= 2 * _VAL_S  # two validation runs happened between the timed steps

    # tokens: the attention mask's non-padding entries, not the tensor size
    tokens = [rec.results[s].tokens for s in range(steps)]
    assert tokens == [clock.tokens[s] for s in range(steps)] and sum(tokens) < steps * 4 * _T
    reference = [s for s in range(steps) if rec.results[s].reading.exact]
    assert reference == [0, 1]  # before and after the optimizer state exists
    acc = _events(tmp_path)
    tps, sps, step_s = (
        _series(acc, k) for k in ("throughput/tokens_per_sec", "throughput/samples_per_sec", "time/step_s")
    )
    assert sorted(tps) == sorted(step_s) == list(range(steps))
    for s in range(steps):
        timed_on = next(t for t in range(s, steps) if t not in reference)
        assert tps[s] * step_s[s] == pytest.approx(tokens[timed_on], rel=1e-5)  # tokens / that step's time
        assert sps[s] * step_s[s] == pytest.approx(4, rel=1e-5)
        assert 0 < step_s[s] <= clock.seconds(timed_on), s
    ordinary = [s for s in range(steps) if s not in reference]
    callback_rate = sum(tokens[s] for s in ordinary) / sum(step_s[s] for s in ordinary)
    outside_rate = sum(clock.tokens[s] for s in ordinary) / sum(clock.seconds(s) for s in ordinary)
    print(f"tokens/s: callback {callback_rate:.1f}, outside clock {outside_rate:.1f} (the plugin's own hooks "
          f"included), validation excluded {clock.paused:.2f} s")
    assert callback_rate >= outside_rate


def test_tokens_fn_overrides_the_count(tmp_path):
    cb = ActivationCheckpointing(policy="none", tokens_fn=lambda batch: 1000)
    rec = Record(cb)
    Trainer(
        callbacks=[cb, rec],
        **trainer_kwargs(tmp_path, max_steps=3, log_every_n_steps=1, accumulate_grad_batches=2),
    ).fit(TinyTransformer())
    assert [rec.results[s].tokens for s in (0, 1, 2)] == [2000] * 3  # two micro-batches per optimizer step
    assert cb.last_metrics["throughput/tokens_per_sec"] == pytest.approx(
        2000 / cb.last_metrics["time/step_s"]
    )


# -------------------------------------------------------------------------------------- logger, progress bar


def test_without_a_logger_nothing_crashes_and_one_warning_is_given(tmp_path):
    cb = ActivationCheckpointing(policy="every:2")
    trainer = Trainer(
        callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=4, log_every_n_steps=1, logger=False)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyTransformer())
    ours = [str(w.message) for w in caught if "lightning_ckpt" in str(w.message)]
    assert len(ours) == 1 and "no logger" in ours[0], ours
    assert cb.last_metrics["memory/activations_gib"] > 0  # still measured: progress bar and report use it
    assert {"act_GiB", "tok/s"} <= set(trainer.progress_bar_metrics)


def test_progress_bar_shows_activation_gib_and_tokens_per_sec(tmp_path):
    cb = ActivationCheckpointing(policy="all")
    trainer = Trainer(
        callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=3, log_every_n_steps=1, enable_progress_bar=True)
    )
    trainer.fit(TinyTransformer())
    bar = trainer.progress_bar_metrics
    assert bar["act_GiB"] == pytest.approx(cb.last_metrics["memory/activations_gib"])
    assert bar["tok/s"] == pytest.approx(cb.last_metrics["throughput/tokens_per_sec"])
    assert "act_GiB" not in trainer.logged_metrics  # the bar only; the logger gets the full names


def test_measure_false_logs_nothing(tmp_path):
    cb = ActivationCheckpointing(policy="all", measure=False)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps=2, log_every_n_steps=1))
    trainer.fit(TinyTransformer())
    assert not any(
        k.startswith(("memory/", "throughput/", "time/", "checkpointing/")) for k in trainer.logged_metrics
    )
    assert cb.last_metrics == {}


class _LogCalls(Callback):
    """Counts ``LightningModule.log`` calls per key and records what reaches the logger, with Lightning's step."""

    def __init__(self, monkeypatch) -> None:
        from lightning.pytorch import LightningModule

        self.keys = []
        original = LightningModule.log

        def log(module, name, *args, **kwargs):
            self.keys.append(name)
            return original(module, name, *args, **kwargs)

        monkeypatch.setattr(LightningModule, "log", log)


def test_figures_reach_the_loggers_without_a_device_tensor_per_value(tmp_path, monkeypatch):
    """``self.log`` makes one device tensor per value (``LightningModule.__to_tensor``: one host-to-device copy each
    on CUDA, then one ``.item()`` each when written) and costs about 0.35 ms of host time per key: the figures go to
    the loggers directly (on the old code every figure went through ``self.log``). What a user reads stays: the
    event file's tags at Lightning's steps (those of ``train_loss``), ``callback.last_metrics``, the progress bar,
    and ``trainer.callback_metrics`` (host tensors, e.g. for ``ModelCheckpoint(monitor=...)``)."""
    calls = _LogCalls(monkeypatch)
    cb = ActivationCheckpointing(policy="every:2")
    trainer = Trainer(
        callbacks=[cb, calls],
        **trainer_kwargs(
            tmp_path, max_steps=4, log_every_n_steps=2, limit_val_batches=0, num_sanity_val_steps=0,
            logger=TensorBoardLogger(str(tmp_path), name="tb"),
        ),
    )
    trainer.fit(TinyTransformer())
    ours = [k for k in calls.keys if k.startswith(("memory/", "throughput/", "time/", "checkpointing/"))]
    assert ours == [] and {"act_GiB", "tok/s"}.isdisjoint(calls.keys), calls.keys
    acc = _events(tmp_path)
    loss_steps = [e.step for e in acc.Scalars("train_loss")]
    assert loss_steps == [1, 3]
    for tag in cb.last_metrics:
        assert sorted(_series(acc, tag)) == loss_steps, tag
        assert _series(acc, tag)[3] == pytest.approx(cb.last_metrics[tag], rel=1e-6)  # float32 in the file
        value = trainer.callback_metrics[tag]
        assert isinstance(value, torch.Tensor) and value.device.type == "cpu"
        assert float(value) == pytest.approx(cb.last_metrics[tag], rel=1e-6)
    assert trainer.progress_bar_metrics["act_GiB"] == pytest.approx(cb.last_metrics["memory/activations_gib"])


class _TwoRanks:
    """A strategy of two ranks whose ``all_gather`` stacks this rank's vector with the other rank's."""

    world_size = 2

    def __init__(self, device, other) -> None:
        self.root_device, self.other, self.sent, self.gathered = torch.device(device), other, [], []

    def all_gather(self, tensor):
        self.sent.append(tensor)
        if not isinstance(self.other, torch.Tensor):  # made once (a blocking copy on CUDA: not the reduction's)
            self.other = torch.tensor([self.other[k] for k in sorted(self.other)], dtype=tensor.dtype,
                                      device=tensor.device)
        out = torch.stack([tensor, self.other])
        self.gathered.append(out)
        return out


_MINE = {"memory/activations_gib": 1.5, "throughput/tokens_per_sec": 100.0, "time/step_s": 0.25}
_THEIRS = {"memory/activations_gib": 2.5, "throughput/tokens_per_sec": 300.0, "time/step_s": 0.5}
_REDUCED = {"memory/activations_gib": 2.5, "throughput/tokens_per_sec": 400.0, "time/step_s": 0.5}


def _functions_on(seen, tensor) -> list:
    from torch.utils._pytree import tree_flatten

    return [func for func, args, kwargs in seen if any(a is tensor for a in tree_flatten((args, kwargs))[0])]


def test_the_reduction_is_one_collective_with_one_copy_each_way():
    """One vector, moved to the device with one non-blocking copy (pinned on CUDA: see the GPU test), one
    collective, and one copy of the gathered result back to the host, where the max and the sum are taken (the old
    code reduced on the device and read the sum and the max with a ``tolist()`` each: two device-to-host copies)."""
    from torch.overrides import TorchFunctionMode

    from lightning_ckpt.lightning.metrics import reduce_across_ranks

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    strategy = _TwoRanks("cpu", _THEIRS)
    with Seen() as seen:
        reduced = reduce_across_ranks(strategy, dict(_MINE))
    assert reduced == _REDUCED
    assert len(strategy.sent) == 1
    moves = [(args, kwargs) for func, args, kwargs in seen.calls if func is torch.Tensor.to]
    assert [kwargs.get("non_blocking") for _, kwargs in moves[:1]] == [True]
    on_gathered = _functions_on(seen.calls, strategy.gathered[0])
    # first the one copy back (on the CPU it returns the same tensor: the host's work on it follows), nothing reduced
    # on the device
    assert on_gathered[0] is torch.Tensor.to and on_gathered.count(torch.Tensor.to) == 1, on_gathered
    assert not {torch.Tensor.sum, torch.Tensor.max} & set(on_gathered), on_gathered
    assert reduce_across_ranks(type("One", (), {"world_size": 1})(), dict(_MINE)) == _MINE


# ---------------------------------------------------------------------------------------- multi-process


def rank_tokens(batch) -> int:
    """A ``tokens_fn`` whose count depends on the rank: 1000 on rank 0, 2000 on rank 1."""
    return 1000 * (torch.distributed.get_rank() + 1)


class RankSizedBatches(TinyTransformer):
    """Rank r trains on micro-batches of ``4 × (r + 1)`` samples, so the ranks' activation lines differ."""

    def train_dataloader(self):
        rank, world = self.trainer.global_rank, self.trainer.world_size
        from _lightning_models import token_dataset

        data = token_dataset(64, 0)
        return DataLoader(
            data, batch_size=4 * (rank + 1), sampler=DistributedSampler(data, world, rank, shuffle=False)
        )


class DumpMeasurements(Record):
    def __init__(self, cb, out_dir: str) -> None:
        super().__init__(cb)
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        local = {s: r.metrics() for s, r in self.results.items() if r is not None and r.ledger is not None}
        instrumented = [s for s, r in self.results.items() if r is not None and r.instrumented]
        torch.save(
            {"local": local, "reduced": self.metrics, "is_global_zero": trainer.is_global_zero,
             "instrumented": instrumented},
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="gloo ddp_spawn on CPU is not tested on Windows")
def test_ddp_spawn_memory_is_the_max_throughput_the_sum_and_rank_zero_writes(tmp_path):
    out = tmp_path / "ranks"
    out.mkdir()
    cb = ActivationCheckpointing(policy="every:2", tokens_fn=rank_tokens)
    trainer = Trainer(
        callbacks=[cb, DumpMeasurements(cb, str(out)), CleanDistributedExit()],
        **trainer_kwargs(
            tmp_path,
            devices=2,
            strategy="ddp_spawn",
            max_steps=3,
            log_every_n_steps=1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            logger=TensorBoardLogger(str(tmp_path), name="tb"),
        ),
    )
    trainer.fit(RankSizedBatches(optimizer="sgd"))
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert (r0["is_global_zero"], r1["is_global_zero"]) == (True, False)

    acc = _events(tmp_path)  # exactly one event file: only rank zero wrote
    steps = [0, 1, 2]
    assert sorted(r0["local"]) == sorted(r1["local"]) == steps
    a0, a1 = (r["local"][0]["memory/activations_gib"] for r in (r0, r1))
    assert a1 > a0  # rank 1's batch is twice as large; the max must be its figure, not rank 0's
    reference = r0["instrumented"]
    assert reference == r1["instrumented"] == [0]  # SGD keeps no state: one reference step, timed on step 1
    timed_on = {s: next(t for t in steps if t >= s and t not in reference) for s in steps}
    for tag in r0["local"][0]:
        logged = _series(acc, tag)
        assert sorted(logged) == steps, tag
        for s in steps:
            timed = timed_on[s] if tag.startswith(("throughput/", "time/")) else s
            mine, theirs = r0["local"][timed][tag], r1["local"][timed][tag]
            if tag.startswith("throughput/"):
                want = mine + theirs
            else:  # memory lines, step time, checkpointed blocks
                want = max(mine, theirs)
            assert logged[s] == pytest.approx(want, rel=1e-6), (tag, s, mine, theirs)
            if timed == s:  # a reference step's time is logged after its own step: not in that step's dict
                assert r0["reduced"][s][tag] == r1["reduced"][s][tag] == pytest.approx(want, rel=1e-12)
    for s in steps:  # the rank-dependent token counts went into the sum
        t = timed_on[s]
        want = 1000 / r0["local"][t]["time/step_s"] + 2000 / r1["local"][t]["time/step_s"]
        assert _series(acc, "throughput/tokens_per_sec")[s] == pytest.approx(want, rel=1e-6)


# ----------------------------------------------------------------------------------------------------- GPU


class CudaPeaks(Callback):
    """Put after ActivationCheckpointing: reads torch's own allocator peaks of the same step."""

    def __init__(self, cb) -> None:
        self.cb, self.rows = cb, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.cuda.reset_peak_memory_stats()  # the callback reset them too; the step starts here

    def on_before_backward(self, trainer, pl_module, loss):
        self.end_of_forward = torch.cuda.memory_allocated()  # what the forward left alive: a floor for its peak

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(
            (
                self.cb.last_result.reading,
                torch.cuda.max_memory_allocated(),
                torch.cuda.max_memory_reserved(),
                dict(self.cb.last_metrics),
                self.end_of_forward,
            )
        )


@pytest.mark.gpu
def test_peak_allocated_matches_torch_cuda_max_memory_allocated_for_the_step(tmp_path):
    cb = ActivationCheckpointing(policy="every:2")
    peaks = CudaPeaks(cb)
    Trainer(
        callbacks=[cb, peaks],
        **trainer_kwargs(
            tmp_path,
            accelerator="gpu",
            max_steps=3,
            log_every_n_steps=1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        ),
    ).fit(_gpt(n_layer=4, n_embd=128, T=128), datamodule=SameBatch(_batch(8, 128)))
    assert len(peaks.rows) == 3
    for reading, allocated, reserved, metrics, end_of_forward in peaks.rows:
        # the meter restarts the allocator's peak at each phase boundary and leaves the last phase's in the counter:
        # torch's own counter, read after the step, is the optimizer phase's peak (the callback read its figures just
        # before; in between only a few scalars were allocated, far below the step's peak)
        phases = reading.phase_peaks
        assert set(phases) == {"forward", "backward", "optimizer"}
        assert phases["optimizer"] == allocated
        assert reading.peak_allocated == max(phases.values()) == _bytes(metrics["memory/peak_allocated_gib"])
        assert phases["forward"] >= end_of_forward and reading.peak_allocated >= end_of_forward
        # reserved: those scalars could at most have opened one new 2 MiB small-block segment
        assert reserved - 2 * 2**20 <= reading.peak_reserved <= reserved
        assert {"memory/other_gib", "memory/cache_gib", "memory/peak_reserved_gib"} <= set(metrics)
        assert metrics["memory/cache_gib"] == pytest.approx(
            (reading.peak_reserved - reading.peak_allocated) / GiB
        )
        assert math.isfinite(metrics["memory/other_gib"]) and metrics["memory/other_gib"] >= 0


@pytest.mark.gpu
def test_the_reduction_on_cuda_copies_from_pinned_memory_and_waits_once():
    """On CUDA: the vector leaves pinned host memory with a non-blocking copy and the device is waited for once
    (the copy of the gathered figures back); the old code made a blocking pageable copy and two reads (three
    syncs, which ``set_sync_debug_mode("warn")`` reports)."""
    from torch.overrides import TorchFunctionMode

    from lightning_ckpt.lightning.metrics import reduce_across_ranks

    class Sources(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.moved = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to and args[0].device.type == "cpu":
                self.moved.append((args[0].is_pinned(), kwargs.get("non_blocking")))
            return func(*args, **kwargs)

    strategy = _TwoRanks("cuda", _THEIRS)
    reduce_across_ranks(strategy, dict(_MINE))  # warm-up: the pinned allocator's first block
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, Sources() as sources:
            warnings.simplefilter("always")
            reduced = reduce_across_ranks(strategy, dict(_MINE))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert reduced == pytest.approx(_REDUCED)
    assert sources.moved[:1] == [(True, True)]
    assert strategy.sent[-1].is_cuda
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.gpu
def test_cuda_graphs_mark_the_allocator_lines_not_comparable(tmp_path):
    """``torch.compile(mode="reduce-overhead")``: one warning naming the fix, the allocator lines not logged, the
    report saying why; the activation and model-state lines are logged as usual."""
    model = _gpt(n_layer=2, n_embd=64, T=64)
    model.model = torch.compile(model.model, mode="reduce-overhead")
    cb = ActivationCheckpointing(policy="every:2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, accelerator="gpu", max_steps=3, log_every_n_steps=1,
                                                 limit_val_batches=0, num_sanity_val_steps=0)).fit(
            model, datamodule=SameBatch(_batch(4, 64)))
    ours = [str(w.message) for w in caught if "CUDA graphs" in str(w.message)]
    assert len(ours) == 1 and "max-autotune-no-cudagraphs" in ours[0], ours
    assert cb.last_metrics["memory/activations_gib"] > 0 and cb.last_metrics["memory/params_gib"] > 0
    assert not {"memory/peak_allocated_gib", "memory/peak_reserved_gib", "memory/other_gib", "memory/cache_gib",
                "memory/peak_forward_gib"} & set(cb.last_metrics)
    assert cb.last_result.ledger.allocator_note is not None
