"""Auto-toggle in a real Trainer: rising, resuming, agreeing across ranks, and surviving out-of-memory steps."""

import os

import pytest
import torch
from _lightning_models import CleanDistributedExit, TinyTransformer, params_of, trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_ckpt import ActivationCheckpointing, get_plan
from lightning_ckpt.decide.diagnosis import OutOfMemoryDiagnosis
from lightning_ckpt.lightning.autotoggle import AutoToggle

GiB = 2**30


class Levels(Callback):
    """Records the policy in force at the start of every training batch, and the logged activation peaks."""

    def __init__(self):
        self.policies, self.act = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.policies.append(get_plan(pl_module).spec)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        value = trainer.callback_metrics.get("memory/activations_gib")
        self.act.append(None if value is None else float(value))


def _peaks(tmp_path):
    """Measured activation peak (bytes) of the test model under none and all, through the callback itself."""
    out = {}
    for policy in ("none", "all"):
        seed_everything(0)
        cb = ActivationCheckpointing(policy=policy)
        Trainer(**trainer_kwargs(tmp_path / policy, max_steps=2, log_every_n_steps=1), callbacks=[cb]).fit(
            TinyTransformer(batch_size=16))
        out[policy] = cb.last_result.ledger.activations
    return out


def _fit(tmp_path, cb, steps=8, model=None, callbacks=(), **kw):
    seed_everything(0)
    model = model or TinyTransformer(batch_size=16)
    levels = Levels()
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=steps, log_every_n_steps=1, limit_val_batches=0,
                                       num_sanity_val_steps=0, **kw), callbacks=[cb, levels, *callbacks])
    trainer.fit(model)
    return model, levels, trainer


def test_threshold_between_none_and_all_raises_checkpointing_and_keeps_the_math(tmp_path):
    peaks = _peaks(tmp_path)
    assert peaks["all"] < peaks["none"]
    threshold = int(peaks["all"] + 0.25 * (peaks["none"] - peaks["all"]))
    cb = ActivationCheckpointing(auto_threshold=threshold, cooldown=100)
    model, levels, _ = _fit(tmp_path / "auto", cb)
    assert levels.policies[0] == "none"  # the bottom rung: no recompute until memory asks for it
    assert levels.policies[-1] == "all" and levels.policies.index("all") <= 2
    switched = levels.policies.index("all")
    assert all(a * GiB <= threshold for a in levels.act[switched:])
    assert cb.controller.switches == 2

    fixed_model, _, _ = _fit(tmp_path / "fixed", ActivationCheckpointing(policy="all"))
    reference = params_of(fixed_model)
    for name, value in params_of(model).items():
        assert torch.equal(value, reference[name]), name


def test_policy_names_the_starting_rung_and_bad_values_fail_before_training():
    cb = ActivationCheckpointing(auto_threshold="1GiB", policy="every:2")
    assert cb.policy.spec == "every:2"
    with pytest.raises(ValueError, match=r"policy='group:2' is not one of ladder \['none', 'every:2', 'all'\]"):
        ActivationCheckpointing(auto_threshold="1GiB", policy="group:2")
    with pytest.raises(ValueError, match="capacity='24GiB'"):
        ActivationCheckpointing(auto_threshold=0.8)  # a fraction, no CUDA, no capacity
    assert ActivationCheckpointing(auto_threshold=0.8, capacity="24GiB").settings.capacity_bytes == 24 * GiB
    for bad, error in ((float("nan"), ValueError), (-1, ValueError), (0, ValueError), (1.5, ValueError),
                       ("18 parsecs", ValueError), (True, TypeError)):
        with pytest.raises(error):
            ActivationCheckpointing(auto_threshold=bad, capacity="24GiB")
    with pytest.raises(ValueError, match="choose one of"):
        ActivationCheckpointing(on_oom="retry")
    with pytest.raises(ValueError, match="cooldown"):
        ActivationCheckpointing(auto_threshold="1GiB", cooldown=0)


def test_static_graph_with_toggling_is_refused(tmp_path, monkeypatch):
    from lightning.pytorch.strategies import DDPStrategy

    for name in ("MASTER_ADDR", "MASTER_PORT"):  # the 1-process group below must not leak its port
        monkeypatch.delenv(name, raising=False)
    trainer = Trainer(**trainer_kwargs(tmp_path, strategy=DDPStrategy(static_graph=True)),
                      callbacks=[ActivationCheckpointing(auto_threshold="1GiB")])
    try:
        with pytest.raises(ValueError, match="static_graph"):
            trainer.fit(TinyTransformer())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_resume_restores_the_level_before_the_first_resumed_step(tmp_path):
    cb = ActivationCheckpointing(auto_threshold=1, cooldown=100)  # 1 byte: every step crosses it
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    _, levels, _ = _fit(tmp_path / "first", cb, steps=4, enable_checkpointing=True, callbacks=[ckpt])
    assert levels.policies == ["none", "every:2", "all", "all"]
    path = next((tmp_path / "ckpt").glob("*.ckpt"))
    state = torch.load(path, weights_only=True)["callbacks"]
    saved = next(v for k, v in state.items() if "ActivationCheckpointing" in k)
    assert saved["controller"]["level"] == 2

    resumed_cb = ActivationCheckpointing(auto_threshold=1, cooldown=100)
    levels2 = Levels()
    seed_everything(0)
    trainer = Trainer(**trainer_kwargs(tmp_path / "second", max_steps=6, log_every_n_steps=1,
                                       limit_val_batches=0, num_sanity_val_steps=0),
                      callbacks=[resumed_cb, levels2])
    trainer.fit(TinyTransformer(batch_size=16), ckpt_path=str(path))
    assert levels2.policies[0] == "all" and resumed_cb.controller.level == 2


class RankSkewed(TinyTransformer):
    """Rank 1 saves an extra 128 MiB for backward (rank 0: 64 bytes): both ranks must still switch together."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.skew = nn.Parameter(torch.ones(()))

    def training_step(self, batch, batch_idx):
        numel = 32 * 2**20 if self.trainer.global_rank == 1 else 16
        saved = torch.ones(numel)  # kept for the gradient of `skew`: an activation of this rank only
        return super().training_step(batch, batch_idx) + 0.0 * (saved * self.skew).sum()


class RankLog(Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with open(os.path.join(self.folder, f"rank{trainer.global_rank}.txt"), "a") as fh:
            fh.write(get_plan(pl_module).spec + "\n")


@pytest.mark.slow
def test_ddp_spawn_ranks_with_different_readings_switch_on_the_same_step(tmp_path):
    # threshold above rank 0's own reading but below rank 1's (×1000): only the max over ranks crosses it
    cb = ActivationCheckpointing(auto_threshold="64MiB", cooldown=100)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=4, log_every_n_steps=1, limit_val_batches=0,
                                       num_sanity_val_steps=0, strategy="ddp_spawn", devices=2,
                                       use_distributed_sampler=False),
                      callbacks=[cb, RankLog(str(tmp_path)), CleanDistributedExit()])
    trainer.fit(RankSkewed(batch_size=8))
    rank0 = (tmp_path / "rank0.txt").read_text().split()
    rank1 = (tmp_path / "rank1.txt").read_text().split()
    assert rank0 == rank1 == ["none", "every:2", "all", "all"]


class OOMUnlessCheckpointed(TinyTransformer):
    """Raises torch.OutOfMemoryError in a block's forward while any block runs un-checkpointed."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.steps_seen = []

    def training_step(self, batch, batch_idx):
        plan = get_plan(self)
        if plan.num_checkpointed < plan.num_blocks:
            self.layers[0].register_forward_hook(_raise_once_hook)
        self.steps_seen.append(batch_idx)
        return super().training_step(batch, batch_idx)


def _raise_once_hook(module, args, output):
    for key in list(module._forward_hooks):
        if module._forward_hooks[key] is _raise_once_hook:
            del module._forward_hooks[key]
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def test_oom_escalates_and_retries_the_same_batch(tmp_path):
    cb = ActivationCheckpointing(policy="none", on_oom="escalate", auto_threshold="1TiB", cooldown=100)
    model = OOMUnlessCheckpointed(batch_size=16)
    _, levels, trainer = _fit(tmp_path, cb, steps=4, model=model)
    assert trainer.global_step == 4
    assert get_plan(model).spec == "all"
    # batch 0 tried at none, every:2, then all; every batch trained exactly once after that
    assert model.steps_seen == [0, 0, 0, 1, 2, 3]
    state = trainer.optimizers[0].state
    assert all(int(s["step"]) == 4 for s in state.values())  # no optimizer step applied twice


def test_oom_with_the_ladder_exhausted_raises_the_diagnosis_from_the_original(tmp_path):
    class AlwaysOOM(TinyTransformer):
        def training_step(self, batch, batch_idx):
            self.layers[0].register_forward_hook(_raise_once_hook)
            return super().training_step(batch, batch_idx)

    cb = ActivationCheckpointing(policy="none", on_oom="escalate", auto_threshold="1TiB")
    with pytest.raises(torch.OutOfMemoryError) as err:
        _fit(tmp_path, cb, steps=2, model=AlwaysOOM())
    assert isinstance(err.value, OutOfMemoryDiagnosis)
    assert "injected" in str(err.value.__cause__)
    assert "forward phase" in str(err.value) and "exhausted" in str(err.value)


def test_a_fractional_threshold_follows_the_capacity_read_after_the_strategys_setup(tmp_path, monkeypatch):
    """The capacity is read again at fit start, after the strategy's setup (DDP's first broadcast makes NCCL's
    buffers, outside the allocator): a fractional threshold and the ledger use that reading. The old engine kept the
    one read when the plan was applied, before those buffers existed."""
    import lightning_ckpt.lightning.engine as engine_module

    readings = iter([10 * GiB, 9 * GiB])  # when the plan is applied, then at fit start (NCCL's buffers taken)
    monkeypatch.setattr(engine_module, "device_capacity", lambda device: next(readings, 9 * GiB))
    with monkeypatch.context() as cuda:  # a fraction is refused where no device capacity can be read
        cuda.setattr(torch.cuda, "is_available", lambda: True)
        cb = ActivationCheckpointing(policy="none", auto_threshold=0.5)
    Trainer(**trainer_kwargs(tmp_path, max_steps=1, limit_val_batches=0, num_sanity_val_steps=0),
            callbacks=[cb]).fit(TinyTransformer(batch_size=4))
    engine = cb._engine
    assert engine.capacity == 9 * GiB and engine.feature(AutoToggle).controller.threshold == int(0.5 * 9 * GiB)
    assert engine.monitor.capacity == 9 * GiB


def test_the_auto_toggle_does_not_walk_back_into_a_policy_that_ran_out_of_memory(tmp_path):
    """Issue 34: with a threshold far above every reading, the old controller stepped down after each ``cooldown``
    of calm steps into the policy that had just run out of memory (7 errors in 12 steps with cooldown=2). The
    escalation now marks each failed policy; the run stays on 'all' and its checkpoint resumes there, marks kept."""
    cb = ActivationCheckpointing(policy="none", on_oom="escalate", auto_threshold="1TiB", cooldown=2)
    model = OOMUnlessCheckpointed(batch_size=16)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    _, levels, trainer = _fit(tmp_path / "first", cb, steps=12, model=model, enable_checkpointing=True,
                              callbacks=[ckpt])
    assert model.steps_seen == [0, 0, 0, 1, 2, 3] + [0, 1, 2, 3] * 2  # none, every:2 failed once each, on batch 0
    assert set(levels.policies[1:]) == {"all"} and cb.controller.level == 2
    assert set(cb.controller.state_dict()["out_of_memory"]) == {"0", "1"}
    assert cb.controller.pair_ratio == {}  # no pair of neighbours was measured around a move of the controller's

    path = sorted((tmp_path / "ckpt").glob("*.ckpt"))[0]  # step 6
    resumed = ActivationCheckpointing(policy="none", on_oom="escalate", auto_threshold="1TiB", cooldown=2)
    again = OOMUnlessCheckpointed(batch_size=16)
    levels2 = Levels()
    seed_everything(0)
    Trainer(**trainer_kwargs(tmp_path / "second", max_steps=12, log_every_n_steps=1, limit_val_batches=0,
                             num_sanity_val_steps=0), callbacks=[resumed, levels2]).fit(again, ckpt_path=str(path))
    assert set(levels2.policies) == {"all"} and len(again.steps_seen) == 6  # no error, no retry after the resume
