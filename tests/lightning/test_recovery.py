"""Out-of-memory recovery that loses nothing: with gradient accumulation the retried step's gradient equals the
gradient of a run without the error (an error in the forward, and in the backward); escalation only goes up and
names the phase; under DDP every rank stops within a bounded time; the safety checks hold at every rung."""

from __future__ import annotations

import weakref

import pytest
import torch
from _lightning_models import CleanDistributedExit, TinyTransformer, trainer_kwargs
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_ckpt import ActivationCheckpointing, OutOfMemoryDiagnosis, ReplaySafetyError, get_plan

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"


class InjectOOM(TinyTransformer):
    """Raises one out-of-memory error in the forward or the backward of batch ``at`` (a last micro-batch)."""

    def __init__(self, at: int = -1, phase: str = "forward", **kw):
        super().__init__(**kw)
        self.at, self.phase, self.fired = at, phase, False
        self.attempts = []
        self.fire_in_epoch = 0

    def training_step(self, batch, batch_idx):
        self.attempts.append(batch_idx)
        if batch_idx == self.at and not self.fired and self.current_epoch == self.fire_in_epoch:
            self.fired = True
            if self.phase == "forward":
                raise torch.OutOfMemoryError(OOM)
            x, y = batch
            h = self.embed(x)

            def raise_in_backward(grad):  # after the head and the blocks have accumulated their gradients
                raise torch.OutOfMemoryError(OOM)

            h.register_hook(raise_in_backward)
            for layer in self.layers:
                h = layer(h)
            return nn.functional.cross_entropy(self.head(h).reshape(-1, 16), y.reshape(-1))
        return super().training_step(batch, batch_idx)


class GradsAtStep(Callback):
    """The gradients the optimizer sees at each step."""

    def __init__(self) -> None:
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()
                           if p.grad is not None})


def _fit(tmp_path, model, cb, steps=3, callbacks=(), **overrides):
    grads = GradsAtStep()
    run = dict(max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1)
    run.update(overrides)
    trainer = Trainer(callbacks=[cb, grads, *callbacks], **trainer_kwargs(tmp_path, **run))
    trainer.fit(model)
    return trainer, grads.grads


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_retry_in_the_last_micro_batch_keeps_the_accumulated_gradients(tmp_path, phase):
    seed_everything(0)
    reference = InjectOOM(optimizer="sgd", batch_size=4)
    _, expected = _fit(tmp_path / "ref", reference, ActivationCheckpointing(policy="none"),
                       accumulate_grad_batches=2)
    seed_everything(0)
    model = InjectOOM(at=3, phase=phase, optimizer="sgd", batch_size=4)  # batch 3: the last of step 1's window
    cb = ActivationCheckpointing(policy="none", on_oom="escalate")
    trainer, got = _fit(tmp_path / "oom", model, cb, accumulate_grad_batches=2)
    assert model.fired and model.attempts == [0, 1, 2, 3, 3, 4, 5]  # batch 3 retried once, nothing skipped
    assert get_plan(model).spec == "every:2" and trainer.global_step == 3
    for step in range(3):
        assert got[step].keys() == expected[step].keys()
        for name, grad in expected[step].items():
            torch.testing.assert_close(got[step][name], grad, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")


def test_without_the_journal_a_backward_retry_would_double_count(tmp_path, monkeypatch):
    """The check above can fail: with the gradient journal switched off, the retried step's gradient is wrong."""
    from lightning_ckpt.lightning.recovery import StepGuard

    monkeypatch.setattr(StepGuard, "_journal", lambda self: None)
    seed_everything(0)
    _, expected = _fit(tmp_path / "ref", InjectOOM(optimizer="sgd", batch_size=4),
                       ActivationCheckpointing(policy="none"), accumulate_grad_batches=2)
    seed_everything(0)
    model = InjectOOM(at=3, phase="backward", optimizer="sgd", batch_size=4)
    _, got = _fit(tmp_path / "oom", model, ActivationCheckpointing(policy="none", on_oom="escalate"),
                  accumulate_grad_batches=2)
    assert not torch.allclose(got[1]["head.weight"], expected[1]["head.weight"])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_retry_draws_the_same_dropout_masks_as_a_run_without_the_error(tmp_path, accumulate):
    """The failed attempt's forward drew its dropout masks; the retry draws the same ones again (the generators are
    put back), so every step's gradients are bitwise those of a run without the error."""
    seed_everything(0)
    _, expected = _fit(tmp_path / "ref", InjectOOM(dropout=0.5, optimizer="sgd", batch_size=4),
                       ActivationCheckpointing(policy="none"), accumulate_grad_batches=accumulate)
    seed_everything(0)
    at = 2 * accumulate - 1  # the last micro-batch of step 1
    model = InjectOOM(at=at, phase="backward", dropout=0.5, optimizer="sgd", batch_size=4)
    _, got = _fit(tmp_path / "oom", model, ActivationCheckpointing(policy="none", on_oom="escalate"),
                  accumulate_grad_batches=accumulate)
    assert model.fired and model.attempts.count(at) == 2 and get_plan(model).spec == "every:2"
    for step in range(3):
        assert got[step].keys() == expected[step].keys()
        for name, grad in expected[step].items():
            assert torch.equal(got[step][name], grad), f"step {step} {name}"


class FakeCudaGenerators:
    """One device generator whose state the model's forward advances, as a CUDA dropout would."""

    state = 0
    restored: list = []

    @classmethod
    def get_state(cls):
        return [cls.state]

    @classmethod
    def set_state(cls, states):
        cls.restored.append(list(states))
        (cls.state,) = states


class DrawsOnTheDevice(InjectOOM):
    def training_step(self, batch, batch_idx):
        self.drawn = getattr(self, "drawn", [])
        self.drawn.append(FakeCudaGenerators.state)  # what this attempt's forward would draw from
        FakeCudaGenerators.state += 1
        return super().training_step(batch, batch_idx)


def test_the_retry_puts_the_device_generators_back(tmp_path, monkeypatch):
    from lightning_ckpt.lightning import recovery

    FakeCudaGenerators.state, FakeCudaGenerators.restored = 100, []
    monkeypatch.setattr(recovery, "DEVICE_RNG", FakeCudaGenerators)
    seed_everything(0)
    model = DrawsOnTheDevice(at=1, phase="forward", optimizer="sgd", batch_size=4)
    _fit(tmp_path, model, ActivationCheckpointing(policy="none", on_oom="escalate"))
    assert model.attempts == [0, 1, 1, 2] and model.drawn == [100, 101, 101, 102]  # the retry drew as batch 1 did
    assert FakeCudaGenerators.restored == [[101]]


def test_without_a_retry_the_generators_are_not_read(tmp_path, monkeypatch):
    """Only a run that can retry keeps the generators' states (on_oom='diagnose': nothing per step)."""
    from lightning_ckpt.lightning import recovery

    read = []
    monkeypatch.setattr(recovery, "RandomState", lambda: read.append(1))
    seed_everything(0)
    _fit(tmp_path, TinyTransformer(optimizer="sgd", batch_size=4), ActivationCheckpointing(policy="none"), steps=2)
    assert read == []


@pytest.mark.parametrize("policy, expected", [("selective", "all"), ("group:2", "all"), ("every:2", "all")])
def test_escalation_only_goes_up_and_names_the_phase(tmp_path, policy, expected, caplog):
    seed_everything(0)
    model = InjectOOM(at=1, phase="backward", batch_size=4)
    cb = ActivationCheckpointing(policy=policy, on_oom="escalate")
    with caplog.at_level("INFO"):
        _fit(tmp_path, model, cb, steps=2)
    assert get_plan(model).spec == expected
    assert f"out of memory in the backward phase under policy {policy!r}" in caplog.text


def test_stateful_skip_plan_escalates_upward_and_keeps_the_skipped_block_off(tmp_path):
    class WithNorm(InjectOOM):
        def _build(self):
            super()._build()
            self.layers[0].norm_stats = nn.BatchNorm1d(8)  # running statistics inside block 0

    seed_everything(0)
    model = WithNorm(at=1, phase="forward", batch_size=4)
    cb = ActivationCheckpointing(policy="every:2", on_oom="escalate", stateful="skip")
    _fit(tmp_path, model, cb, steps=2)
    assert get_plan(model).modes == ("off", "recompute", "recompute", "recompute")  # "all", block 0 still off


def test_the_top_rung_stops_with_the_diagnosis(tmp_path):
    model = InjectOOM(at=1, phase="forward", batch_size=4)
    with pytest.raises(OutOfMemoryDiagnosis, match="forward phase") as err:
        _fit(tmp_path, model, ActivationCheckpointing(policy="all", on_oom="escalate"), steps=2)
    assert "checkpoints more than the current plan 'all'" in str(err.value)


# ------------------------------------------------------------------------------ a retried step is the retry's


def _oom_while_handling(model, tensor):
    """Run out of memory while a caught error's frame holds a tensor of this attempt: the frame keeps the error it
    caught, whose traceback keeps the frame (a reference cycle only ``gc`` breaks), and the error is the
    out-of-memory error's ``__context__``. ``model.ref`` follows that tensor."""
    held = tensor * 2
    model.ref = weakref.ref(held)
    try:
        raise ValueError("inner")
    except ValueError as inner:
        kept = inner  # noqa: F841 - the cycle
        raise torch.OutOfMemoryError(OOM)  # noqa: B904 - its implicit __context__ is the point


class FailOnce(TinyTransformer):
    """Runs out of memory once, in batch ``at``: in the forward after every block ran (the head's allocation fails),
    or in the backward after the head and the blocks accumulated their gradients; with ``chain``, through
    :func:`_oom_while_handling`. ``probe()`` (set by a test) is called when the retry's forward starts."""

    def __init__(self, at: int = 1, phase: str = "forward", chain: bool = False, **kw):
        super().__init__(**kw)
        self.at, self.phase, self.chain = at, phase, chain
        self.fired, self.ref, self.probe, self.at_retry = False, None, None, None

    def training_step(self, batch, batch_idx):
        if self.fired and self.at_retry is None and self.probe is not None:
            self.at_retry = self.probe()
        if batch_idx != self.at or self.fired:
            return super().training_step(batch, batch_idx)
        self.fired = True
        x, y = batch
        h = self.embed(x)
        if self.phase == "backward":
            h.register_hook(lambda grad: self._fail(grad))
        for layer in self.layers:
            h = layer(h)
        if self.phase == "forward":
            self._fail(h)
        return nn.functional.cross_entropy(self.head(h).reshape(-1, 16), y.reshape(-1))

    def _fail(self, tensor):
        if self.chain:
            _oom_while_handling(self, tensor)
        self.ref = weakref.ref(tensor)
        raise torch.OutOfMemoryError(OOM)


class Readings(Callback):
    """The meter's reading of every optimizer step."""

    def __init__(self, cb):
        self.cb, self.rows = cb, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(self.cb.last_result.reading)


def _measured_run(tmp_path, model, policy, steps=2, plugins=None, **kwargs):
    cb = ActivationCheckpointing(policy=policy, **kwargs)
    if isinstance(model, FailOnce):
        meter = lambda: cb._engine.monitor.meter  # noqa: E731
        model.probe = lambda: {"phase": meter()._phase, "alive": model.ref is not None and model.ref() is not None}
    readings, grads = Readings(cb), GradsAtStep()
    Trainer(callbacks=[cb, readings, grads], plugins=plugins,
            **trainer_kwargs(tmp_path, max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0,
                             log_every_n_steps=1)).fit(model)
    return cb, readings.rows, grads.grads


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_retried_step_reports_the_retry_alone_under_the_new_plans_key(tmp_path, phase):
    """Step 1 (the first steady-state step: exact, a reference) runs out of memory under 'none' and is retried
    under 'every:2': its figures are those of a clean 'every:2' run's step 1 — not the peak of the failed attempt,
    not the failed backward's phase, and stored as the reference of 'every:2', never of 'none'."""
    seed_everything(0)
    _, clean, _ = _measured_run(tmp_path / "clean", TinyTransformer(batch_size=16), "every:2")
    seed_everything(0)
    model = FailOnce(at=1, phase=phase, batch_size=16)
    cb, got, _ = _measured_run(tmp_path / "oom", model, "none", on_oom="escalate")
    assert model.fired and get_plan(model).spec == "every:2"
    assert model.at_retry["phase"] == "forward"  # the meter's phase when the retry's forward starts
    retried, expected = got[1], clean[1]
    assert retried.reference and expected.reference
    for name in ("activations", "activations_estimate", "activations_exact", "autocast_copies", "replays"):
        assert getattr(retried, name) == getattr(expected, name), name
    if phase == "forward":
        assert retried.phase_peaks == expected.phase_peaks
    else:  # the failed backward's gradients live through the retry's forward, less than the last step's whole set
        assert {k: retried.phase_peaks[k] for k in ("backward", "optimizer")} == \
            {k: expected.phase_peaks[k] for k in ("backward", "optimizer")}
        assert retried.phase_peaks["forward"] <= expected.phase_peaks["forward"]
    every2 = get_plan(model).modes
    # reference keys are (layout, shapes, precision, accumulation, steady state)
    keys = {(key[0][0], key[-1]) for key in cb._engine.monitor.meter._references}
    assert keys == {(("off",) * 4, False), (every2, True)}


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_failed_attempts_tensors_are_freed_before_gc_and_the_retry(tmp_path, monkeypatch, phase):
    """The out-of-memory error's ``__context__`` is an error whose frame holds a tensor of the failed attempt in a
    reference cycle: the chain is released before ``gc.collect()`` runs, so that tensor is already dead then, and
    at the retry's forward."""
    import gc

    seed_everything(0)
    model = FailOnce(at=1, phase=phase, chain=True, batch_size=8)
    at_gc, collect = [], gc.collect

    def spy(*args):
        if model.fired and model.at_retry is None and not at_gc:
            at_gc.append(model.ref() is not None)
        return collect(*args)

    monkeypatch.setattr(gc, "collect", spy)
    _measured_run(tmp_path, model, "none", on_oom="escalate")
    assert at_gc == [False]
    assert model.at_retry["alive"] is False and get_plan(model).spec == "every:2"


class CountingScaler(torch.amp.GradScaler):
    """A GradScaler that counts its unscale_/step/update calls; ``fail_step``: that call of ``step`` runs out of
    memory (an error after the closure, in the optimizer step)."""

    def __init__(self, *args, fail_step=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"unscale_": 0, "step": 0, "update": 0}
        self.fail_step = fail_step

    def unscale_(self, optimizer):
        self.calls["unscale_"] += 1
        return super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        self.calls["step"] += 1
        if self.calls["step"] == self.fail_step:
            raise torch.OutOfMemoryError(OOM)
        return super().step(optimizer, *args, **kwargs)

    def update(self, *args, **kwargs):
        self.calls["update"] += 1
        return super().update(*args, **kwargs)


def _sixteen_mixed(scaler):
    from lightning.pytorch.plugins import MixedPrecision

    return [MixedPrecision("16-mixed", "cpu", scaler=scaler)]


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_retried_16_mixed_step_unscales_and_steps_once(tmp_path, phase):
    """``16-mixed`` (a GradScaler, the pre-Ampere path), driven on the CPU through Lightning's MixedPrecision plugin:
    the retry is inside the closure the plugin calls once, so each optimizer step unscales, steps and updates once,
    and the gradients the optimizer sees equal a run without the error."""
    seed_everything(0)
    clean_scaler = CountingScaler("cpu")
    _, _, expected = _measured_run(tmp_path / "clean", TinyTransformer(batch_size=8), "none", steps=3,
                                   plugins=_sixteen_mixed(clean_scaler))
    seed_everything(0)
    scaler = CountingScaler("cpu")
    model = FailOnce(at=1, phase=phase, batch_size=8)
    _, _, got = _measured_run(tmp_path / "oom", model, "none", steps=3, plugins=_sixteen_mixed(scaler),
                              on_oom="escalate")
    assert model.fired and get_plan(model).spec == "every:2"
    assert scaler.calls == clean_scaler.calls == {"unscale_": 3, "step": 3, "update": 3}
    assert len(got) == len(expected) == 3
    for step in range(3):
        assert got[step].keys() == expected[step].keys()
        for name, grad in expected[step].items():
            torch.testing.assert_close(got[step][name], grad, rtol=1e-4, atol=1e-6, msg=f"step {step} {name}")


def test_an_optimizer_step_error_under_16_mixed_is_diagnosed_never_retried(tmp_path):
    """An error after the closure (here the scaler's optimizer step) is not retried: retrying there would run the
    closure and unscale a second time, which GradScaler refuses (shown with a guard that retries the whole
    ``strategy.optimizer_step``: the check can fail)."""
    from lightning_ckpt.lightning.recovery import StepGuard

    scaler = CountingScaler("cpu", fail_step=2)
    with pytest.raises(OutOfMemoryDiagnosis, match="optimizer"):
        _measured_run(tmp_path / "guard", TinyTransformer(batch_size=8), "none", steps=3,
                      plugins=_sixteen_mixed(scaler), on_oom="escalate")
    assert scaler.calls == {"unscale_": 2, "step": 2, "update": 1}

    def retry_everything(self, original, optimizer, closure, *args, **kwargs):
        try:
            return original(optimizer, closure, *args, **kwargs)
        except torch.OutOfMemoryError:
            return original(optimizer, closure, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepGuard, "guarded_step", retry_everything)
        with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
            _measured_run(tmp_path / "naive", TinyTransformer(batch_size=8), "none", steps=3,
                          plugins=_sixteen_mixed(CountingScaler("cpu", fail_step=2)), on_oom="escalate")


# ------------------------------------------------------------------------------------------ a real OOM, on CUDA


class _WideBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))`` with a 4× wider interior: it keeps about 9× its input for backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class _Wide(LightningModule):
    """An activation-bound model: 8 wide blocks on one fixed batch of ``tokens`` rows (SGD, float32).
    ``hook_bytes``: the backward's first step allocates that much once more (a real allocation, so a real
    out-of-memory error in the backward when the activations still held leave no room for it)."""

    def __init__(self, width: int = 1024, depth: int = 8, tokens: int = 8192, hook_bytes: int = 0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_WideBlock(width) for _ in range(depth))
        self.width, self.tokens, self.hook_bytes = width, tokens, hook_bytes

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.blocks:
            x = block(x)
        if self.hook_bytes:
            x.register_hook(self._allocate)
        return nn.functional.mse_loss(x, y)

    def _allocate(self, grad):
        room = torch.empty(self.hook_bytes, dtype=torch.uint8, device=grad.device)
        del room
        return grad

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        from _lightning_models import SameBatch
        from torch.utils.data import DataLoader

        g = torch.Generator().manual_seed(0)
        batch = (torch.randn(self.tokens, self.width, generator=g), torch.randn(self.tokens, self.width, generator=g))
        return DataLoader(SameBatch(batch, n=4), batch_size=None)


def _wide_fit(tmp_path, policy, hook_bytes=0, steps=2, **kwargs):
    """One run on CUDA: the readings, the gradients at each optimizer step, the plan it ended with, and the
    allocated bytes before the run and after it (the model moved back to the CPU)."""
    import gc

    torch.manual_seed(0)
    model = _Wide(hook_bytes=hook_bytes)
    cb = ActivationCheckpointing(policy=policy, blocks=_WideBlock, **kwargs)
    readings, grads = Readings(cb), GradsAtStep()
    trainer = Trainer(callbacks=[cb, readings, grads],
                      **trainer_kwargs(tmp_path, accelerator="cuda", max_steps=steps, limit_val_batches=0,
                                       num_sanity_val_steps=0, log_every_n_steps=1))
    gc.collect()
    before = torch.cuda.memory_allocated()
    trainer.fit(model)
    spec = get_plan(model).spec
    on_host = [{k: v.cpu() for k, v in g.items()} for g in grads.grads]
    model.cpu()
    del trainer, model, grads
    gc.collect()
    return readings.rows, on_host, spec, before, torch.cuda.memory_allocated()


@pytest.mark.gpu
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_real_cuda_out_of_memory_is_retried_and_leaves_nothing_behind(tmp_path, phase):
    """``torch.cuda.set_per_process_memory_fraction`` so that 'none' does not fit and 'all' does: the first step
    runs out of memory for real (in the forward: the activations; in the backward: one more allocation while the
    forward's activations are held), is retried one rung up (or more), and trains on. The gradients equal a clean
    run under the plan it ended with, the allocated memory is back where it was before the run (the failed
    attempt's tensors are gone: its chain released, no graph kept by the meter's hooks), and the retried step's
    reported peak is its own, below the capacity."""
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    probe_none, *_ = _wide_fit(tmp_path / "probe_none", "none", steps=1)
    probe_all, *_ = _wide_fit(tmp_path / "probe_all", "all", steps=1)
    none_forward = probe_none[0].phase_peaks["forward"]
    all_peak = probe_all[0].peak_allocated
    hook_bytes = 0
    if phase == "forward":  # 'none' cannot hold its forward; 'all' holds its whole step, with room for the cache
        capacity = (all_peak + none_forward) // 2
    else:  # 'none' holds its forward but not one more allocation at the start of its backward; 'all' holds both
        capacity = none_forward + (none_forward - all_peak) // 4
        hook_bytes = capacity - probe_all[0].phase_peaks["forward"] - (none_forward - all_peak) // 4
    assert all_peak < capacity and capacity < none_forward + hook_bytes
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(capacity / total, device)
    try:
        rows, got, spec, before, after = _wide_fit(tmp_path / "oom", "none", hook_bytes=hook_bytes,
                                                   on_oom="escalate")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert spec != "none"
    assert after == before  # nothing of the failed attempt (or of the run) left on the device
    assert rows[0].peak_allocated < capacity and rows[1].peak_allocated < capacity
    clean_rows, expected, clean_spec, *_ = _wide_fit(tmp_path / "clean", spec, hook_bytes=hook_bytes)
    assert clean_spec == spec and len(got) == len(expected) == 2
    for step in range(2):
        for name, grad in expected[step].items():
            torch.testing.assert_close(got[step][name], grad, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")


def test_changing_plans_refuse_dropout_without_rng_replay_before_the_first_step(tmp_path):
    model = TinyTransformer(dropout=0.1)
    cb = ActivationCheckpointing(policy="none", auto_threshold="1GiB", preserve_rng_state=False)
    with pytest.raises(ReplaySafetyError, match="blocks that auto_threshold may checkpoint"):
        _fit(tmp_path, model, cb, steps=1)


@pytest.mark.parametrize("kwargs, option", [
    (dict(policy="budget:1MiB"), "policy='budget:1MiB'"),
    (dict(on_oom="escalate"), "on_oom='escalate'"),
    (dict(auto_threshold="1GiB"), "auto_threshold"),
])
def test_static_graph_is_refused_whenever_the_plan_can_change(tmp_path, monkeypatch, kwargs, option):
    strategy = DDPStrategy(static_graph=True)
    cb = ActivationCheckpointing(**kwargs)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, strategy=strategy, max_steps=1))
    try:
        with pytest.raises(ValueError, match=rf"static_graph=True with {option}"):
            trainer.fit(TinyTransformer())
    finally:  # the 1-process group must not keep its port for the tests that follow
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class OOMOnRank1(InjectOOM):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and batch_idx == 1:
            raise torch.OutOfMemoryError(OOM)
        return super().training_step(batch, batch_idx)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_under_ddp_an_oom_on_one_rank_stops_every_rank_without_a_hang(tmp_path):
    cb = ActivationCheckpointing(policy="none", on_oom="escalate")
    trainer = Trainer(callbacks=[cb, CleanDistributedExit()],
                      **trainer_kwargs(tmp_path, strategy="ddp_spawn", devices=2, max_steps=4, limit_val_batches=0,
                                       num_sanity_val_steps=0))
    with pytest.raises(Exception) as err:  # noqa: B017 - the spawn launcher re-raises the worker's error
        trainer.fit(OOMOnRank1(batch_size=4))
    text = str(err.value) + "".join(getattr(err.value, "__notes__", []))
    assert "out of memory" in text and "every rank stops" in text


# ------------------------------------------------------------------------------------ no host sync on the hot path

_SYNCING = ("item", "tolist", "__int__", "__float__", "__bool__")
_COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "all_gather_into_tensor", "reduce", "reduce_scatter",
                "all_gather_object", "broadcast_object_list", "barrier")


# the OOM guard only forwards strategy.optimizer_step: what runs inside (the optimizer, the user's step) is not its
_PASS_THROUGH = {"guarded_step", "retrying_closure", "optimizer_step"}


def _from_the_plugin() -> bool:
    """Whether the nearest caller outside torch and Lightning (and the guard's forwarding) is lightning_ckpt."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        forwarding = module.startswith("lightning_ckpt.lightning.") and frame.f_code.co_name in _PASS_THROUGH
        if not forwarding and not module.startswith(("torch", "lightning.", "lightning_utilities")):
            return module.startswith("lightning_ckpt.")
        frame = frame.f_back
    return False


class SyncCounter(Callback):
    """Counts host-device synchronisations (``Tensor.item``/``tolist``/``int``/``float``/``bool``) and collectives
    made from lightning_ckpt's code, per optimizer step, with the step's kind (logging, deciding); writes them per
    rank."""

    def __init__(self, engine_of, folder):
        self.engine_of, self.folder = engine_of, folder
        self.count, self.rows, self.last = 0, [], None

    def setup(self, trainer, pl_module, stage):
        import torch.distributed as dist

        def counted(owner, name):
            original = getattr(owner, name)

            def wrapper(*args, **kwargs):
                if _from_the_plugin():
                    self.count += 1
                return original(*args, **kwargs)

            setattr(owner, name, wrapper)

        for name in _SYNCING:
            counted(torch.Tensor, name)
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                counted(dist, name)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.last is not None:
            self.rows.append((*self.last, self.count - self.last[-1]))
        self.last = (trainer.global_step, self.count)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        measurement = self.engine_of(trainer).measurement
        # a step settling a logged reference step's time reduces it across ranks: it is busy too
        self.last = (self.last[0], measurement.logging or measurement.settling, measurement.deciding, self.last[1])

    def on_train_end(self, trainer, pl_module):
        import json

        with open(f"{self.folder}/rank{trainer.global_rank}.json", "w") as fh:
            json.dump({"rows": [[step, logging, deciding, calls] for step, logging, deciding, _, calls in self.rows],
                       "plan": self.engine_of(trainer).plan.spec,
                       "checkpointed": self.engine_of(trainer).plan.num_checkpointed}, fh)


def _engine_of(trainer):
    return next(cb for cb in trainer.callbacks if isinstance(cb, ActivationCheckpointing))._engine


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_steps_that_neither_log_nor_decide_make_no_sync_and_no_collective(tmp_path):
    import json

    # a checkpointing plan (every:2, a rung of the default ladder) that the auto-toggle keeps: 1 GiB is never crossed
    # and no rung below is tried within the cooldown
    cb = ActivationCheckpointing(policy="every:2", auto_threshold="1GiB", decide_every_n_steps=3)
    counter = SyncCounter(_engine_of, str(tmp_path))
    trainer = Trainer(callbacks=[counter, cb, CleanDistributedExit()],
                      **trainer_kwargs(tmp_path, strategy="ddp_spawn", devices=2, max_steps=10, log_every_n_steps=4,
                                       limit_val_batches=0, num_sanity_val_steps=0))
    trainer.fit(TinyTransformer(batch_size=4))
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["plan"] == "every:2" and seen["checkpointed"] > 0, seen  # the quiet steps did checkpoint
        rows = seen["rows"]
        quiet = [r for r in rows if not r[1] and not r[2]]
        busy = [r for r in rows if r[1] or r[2]]
        assert len(quiet) >= 4 and len(busy) >= 3, rows
        assert all(calls == 0 for *_, calls in quiet), rows  # nothing on the hot path
        assert all(calls >= 1 for *_, calls in busy), rows  # the counter sees the decision steps' collective


class SyncDebugOnQuietSteps(Callback):
    """Runs lightning_ckpt's own code of every quiet step (one the engine says neither logs nor decides) under
    ``torch.cuda.set_sync_debug_mode("error")``: its batch hooks, its backward and optimizer-step hooks and the
    checkpointed blocks' forwards (and with them their replays). Lightning's own code between them is not ours to
    judge. Put it after the callback."""

    def __init__(self, cb: ActivationCheckpointing) -> None:
        self.engine, self.quiet_steps = cb._engine, 0

    def _quiet(self) -> bool:
        measurement = self.engine.measurement
        return not (measurement.logging or measurement.deciding or measurement.settling)

    def _guard(self, fn, quiet):
        def run(*args, **kwargs):
            if not quiet():
                return fn(*args, **kwargs)
            before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(before)

        return run

    def on_train_start(self, trainer, pl_module):
        engine = self.engine
        # batch_start decides the kind of its step: ask the engine first (a pure read) whether it will be quiet
        engine.batch_start = self._guard(
            engine.batch_start, lambda: not any(engine.measurement.step_kind(trainer, engine.features)))
        for name in ("before_backward", "before_optimizer_step", "batch_end"):
            setattr(engine, name, self._guard(getattr(engine, name), self._quiet))
        for block in engine.plan.blocks:
            # the call (checkpoint's set-up included) through the block's hooks; the body and its replays in backward
            # through the forward object's run (what checkpoint calls)
            block.register_forward_pre_hook(lambda *_: self._strict(True))
            block.register_forward_hook(lambda *_: self._strict(False), always_call=True)
            fwd = block.__dict__["forward"]
            fwd.run = self._guard(fwd.run, self._quiet)

    def _strict(self, on: bool) -> None:
        if self._quiet():
            torch.cuda.set_sync_debug_mode("error" if on else "default")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.quiet_steps += self._quiet()


@pytest.mark.gpu
def test_quiet_steps_never_synchronize_the_device(tmp_path):
    """A checkpointing plan; logging every 4th step and deciding every 3rd, so that steps 1, 2, 5, 6 and 9 are
    quiet: the plugin's code on them must not synchronize the device (a sync there raises)."""
    cb = ActivationCheckpointing(policy="every:2", auto_threshold="64GiB", decide_every_n_steps=3)
    quiet = SyncDebugOnQuietSteps(cb)
    trainer = Trainer(callbacks=[cb, quiet],
                      **trainer_kwargs(tmp_path, accelerator="cuda", max_steps=10, log_every_n_steps=4,
                                       limit_val_batches=0, num_sanity_val_steps=0))
    trainer.fit(TinyTransformer(batch_size=4, optimizer="sgd"))
    assert cb.plan.num_checkpointed > 0 and quiet.quiet_steps >= 4
    assert cb.last_metrics["memory/peak_allocated_gib"] > 0


# ---------------------------------------------------------------- accumulation set by Lightning's scheduler (issue 34)


@pytest.mark.parametrize("schedule", [{0: 2}, {0: 1, 1: 2}], ids=["from epoch 0", "from epoch 1"])
def test_a_backward_retried_under_an_accumulation_scheduler_counts_its_gradients_once(tmp_path, schedule):
    """GradientAccumulationScheduler sets ``accumulate_grad_batches`` at an epoch's start, after the fit started: the
    guard reads it at every step, so the failed backward's gradients are taken back (the old guard read 1 at fit
    start, kept no journal, and the retried step's gradients differed from a clean run's)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    epoch = max(schedule)  # the first epoch that accumulates: 16 samples of 4 are 4 batches an epoch
    steps = (4 if epoch else 0) + 3
    seed_everything(0)
    _, expected = _fit(tmp_path / "ref", InjectOOM(optimizer="sgd", batch_size=4, n_samples=16),
                       ActivationCheckpointing(policy="none"), steps=steps,
                       callbacks=[GradientAccumulationScheduler(schedule)])
    at = 3  # the last micro-batch of the accumulating epoch's second window
    seed_everything(0)
    model = InjectOOM(at=at, phase="backward", optimizer="sgd", batch_size=4, n_samples=16)
    model.fire_in_epoch = epoch
    _, got = _fit(tmp_path / "oom", model, ActivationCheckpointing(policy="none", on_oom="escalate"), steps=steps,
                  callbacks=[GradientAccumulationScheduler(schedule)])
    assert model.fired and get_plan(model).spec == "every:2"
    assert len(got) == len(expected) == steps
    for step in range(steps):
        for name, grad in expected[step].items():
            assert torch.equal(got[step][name], grad), f"step {step} {name}"
