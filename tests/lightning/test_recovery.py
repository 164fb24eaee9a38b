"""Out-of-memory recovery that loses nothing: with gradient accumulation the retried step's gradient equals the
gradient of a run without the error (an error in the forward, and in the backward); escalation only goes up and
names the phase; under DDP every rank stops within a bounded time; the safety checks hold at every rung."""

from __future__ import annotations

import pytest
import torch
from _lightning_models import CleanDistributedExit, TinyTransformer, trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything
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

    def training_step(self, batch, batch_idx):
        self.attempts.append(batch_idx)
        if batch_idx == self.at and not self.fired:
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


def _fit(tmp_path, model, cb, steps=3, **overrides):
    grads = GradsAtStep()
    run = dict(max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1)
    run.update(overrides)
    trainer = Trainer(callbacks=[cb, grads], **trainer_kwargs(tmp_path, **run))
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


def test_changing_plans_refuse_dropout_without_rng_replay_before_the_first_step(tmp_path):
    model = TinyTransformer(dropout=0.1)
    cb = ActivationCheckpointing(policy="none", auto_threshold="1GiB", preserve_rng_state=False)
    with pytest.raises(ReplaySafetyError, match="blocks that auto_threshold may checkpoint"):
        _fit(tmp_path, model, cb, steps=1)


@pytest.mark.parametrize("kwargs, option", [
    (dict(policy="budget:1MiB"), "policy='budget:1048576'"),
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
        engine = self.engine_of(trainer)
        self.last = (self.last[0], engine._logging, engine._deciding, self.last[1])

    def on_train_end(self, trainer, pl_module):
        import json

        with open(f"{self.folder}/rank{trainer.global_rank}.json", "w") as fh:
            json.dump([[step, logging, deciding, calls] for step, logging, deciding, _, calls in self.rows], fh)


def _engine_of(trainer):
    return next(cb for cb in trainer.callbacks if isinstance(cb, ActivationCheckpointing))._engine


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_steps_that_neither_log_nor_decide_make_no_sync_and_no_collective(tmp_path):
    import json

    cb = ActivationCheckpointing(policy="none", auto_threshold="1GiB", decide_every_n_steps=3)
    counter = SyncCounter(_engine_of, str(tmp_path))
    trainer = Trainer(callbacks=[counter, cb, CleanDistributedExit()],
                      **trainer_kwargs(tmp_path, strategy="ddp_spawn", devices=2, max_steps=10, log_every_n_steps=4,
                                       limit_val_batches=0, num_sanity_val_steps=0))
    trainer.fit(TinyTransformer(batch_size=4))
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        quiet = [r for r in rows if not r[1] and not r[2]]
        busy = [r for r in rows if r[1] or r[2]]
        assert len(quiet) >= 4 and len(busy) >= 3, rows
        assert all(calls == 0 for *_, calls in quiet), rows  # nothing on the hot path
        assert all(calls >= 1 for *_, calls in busy), rows  # the counter sees the decision steps' collective


class SyncDebugOnQuietSteps(Callback):
    """``torch.cuda.set_sync_debug_mode("error")`` while lightning_ckpt handles a step that neither logs nor decides."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        engine = _engine_of(trainer)
        quiet = trainer.global_step % 2 == 1  # log_every_n_steps=2 and decide_every_n_steps=2 below
        torch.cuda.set_sync_debug_mode("error" if quiet else "default")
        self.quiet = quiet
        assert engine is not None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_quiet_steps_never_synchronize_the_device(tmp_path):
    cb = ActivationCheckpointing(policy="none", auto_threshold="64GiB", decide_every_n_steps=2)
    trainer = Trainer(callbacks=[SyncDebugOnQuietSteps(), cb],
                      **trainer_kwargs(tmp_path, accelerator="cuda", max_steps=6, log_every_n_steps=2,
                                       limit_val_batches=0, num_sanity_val_steps=0))
    trainer.fit(TinyTransformer(batch_size=4, optimizer="sgd"))
    assert cb.last_metrics["memory/peak_allocated_gib"] > 0
