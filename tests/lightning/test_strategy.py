"""The strategy door: ActivationCheckpointingMixin, the concrete strategies and their registered names."""

from __future__ import annotations

import pytest
import torch
from _lightning_models import CallRecorder, CrashAt, TinyTransformer, trainer_kwargs
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry

from lightning_ckpt.core.wrap import get_plan
from lightning_ckpt.lightning.callback import ActivationCheckpointing
from lightning_ckpt.lightning.strategy import (
    ActivationCheckpointingMixin,
    DDPActivationCheckpointingStrategy,
    FSDPActivationCheckpointingStrategy,
    SingleDeviceActivationCheckpointingStrategy,
    register_strategies,
)


def _fit(model, strategy, tmp_path, callbacks=(), ckpt_path=None, **overrides):
    trainer = Trainer(strategy=strategy, callbacks=list(callbacks), **trainer_kwargs(tmp_path, **overrides))
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def test_registered_names(tmp_path):
    register_strategies()  # idempotent
    expected = {
        "single_device_ac": (SingleDeviceActivationCheckpointingStrategy, {}),
        "ddp_ac": (DDPActivationCheckpointingStrategy, {"start_method": "popen"}),
        "ddp_spawn_ac": (DDPActivationCheckpointingStrategy, {"start_method": "spawn"}),
        "fsdp_ac": (FSDPActivationCheckpointingStrategy, {}),
    }
    for name, (cls, params) in expected.items():
        assert StrategyRegistry[name]["strategy"] is cls and StrategyRegistry[name]["init_params"] == params
    spawn = Trainer(strategy="ddp_spawn_ac", accelerator="cpu", devices=2, logger=False).strategy
    assert type(spawn) is DDPActivationCheckpointingStrategy and spawn._start_method == "spawn"
    assert spawn.policy.spec == "all"
    popen = Trainer(strategy="ddp_ac", accelerator="cpu", devices=2, logger=False).strategy
    assert type(popen) is DDPActivationCheckpointingStrategy and popen._start_method == "popen"


def test_single_device_ac_recomputes_in_training_only(tmp_path):
    model, rec = TinyTransformer(build_in="configure_model"), CallRecorder()
    trainer = _fit(model, "single_device_ac", tmp_path, [rec], val_check_interval=2)
    assert type(trainer.strategy) is SingleDeviceActivationCheckpointingStrategy
    assert trainer.strategy.plan is get_plan(model) and trainer.strategy.plan.spec == "all"
    assert rec.records["train"] == [[2, 2, 2, 2]] * 4
    assert rec.records["sanity"] + rec.records["val"] and all(
        r == [1, 1, 1, 1] for r in rec.records["sanity"] + rec.records["val"]
    )


def test_strategy_arguments_and_bad_values(tmp_path):
    rec = CallRecorder()
    strategy = SingleDeviceActivationCheckpointingStrategy(policy="every:2", blocks="layers.*", device="cpu")
    _fit(TinyTransformer(), strategy, tmp_path, [rec], max_steps=2)
    assert rec.records["train"] == [[2, 1, 2, 1]] * 2
    with pytest.raises(ValueError, match=r"Unknown policy 'evry:2'.*Did you mean 'every'"):
        DDPActivationCheckpointingStrategy(policy="evry:2")
    with pytest.raises(TypeError, match="blocks=3"):
        SingleDeviceActivationCheckpointingStrategy(blocks=3)


def test_any_strategy_can_mix_it_in(tmp_path):
    class MyStrategy(ActivationCheckpointingMixin, SingleDeviceStrategy):
        pass

    rec = CallRecorder()
    strategy = MyStrategy(policy="first:1", device="cpu")
    _fit(TinyTransformer(), strategy, tmp_path, [rec], max_steps=1)
    assert strategy.root_device == torch.device("cpu")
    assert rec.records["train"] == [[2, 1, 1, 1]]


def test_callback_and_mixin_strategy_together_are_refused(tmp_path):
    with pytest.raises(
        RuntimeError,
        match=r"configured 2 times: ActivationCheckpointing\(policy='all'\), "
        r"SingleDeviceActivationCheckpointingStrategy\(policy='every:2'\)",
    ):
        _fit(
            TinyTransformer(),
            SingleDeviceActivationCheckpointingStrategy(policy="every:2"),
            tmp_path,
            [ActivationCheckpointing()],
        )


def test_validate_alone_does_not_wrap(tmp_path):
    model = TinyTransformer()
    Trainer(strategy="single_device_ac", **trainer_kwargs(tmp_path)).validate(model, verbose=False)
    assert get_plan(model) is None


class _SetModes(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 1:
            get_plan(pl_module).set_modes(["off", "off", "recompute", "recompute"])


@pytest.mark.parametrize("restore_after_setup", [False, True])
def test_resume_restores_the_plan_saved_by_the_strategy(tmp_path, monkeypatch, restore_after_setup):
    run = dict(max_steps=8, limit_val_batches=0, num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(
            TinyTransformer(n_samples=32),
            SingleDeviceActivationCheckpointingStrategy(policy="every:2"),
            tmp_path,
            [
                _SetModes(),
                CrashAt(6),
                ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=4),
            ],
            enable_checkpointing=True,
            **run,
        )
    # the strategy door saves the callback's state: the same checkpoint resumes through either door
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]["ActivationCheckpointing"]
    assert saved["policy"] == "every:2" and saved["modes"] == ["off", "off", "recompute", "recompute"]

    if restore_after_setup:  # the FSDP order: the checkpoint is read after strategy.setup
        monkeypatch.setattr(
            SingleDeviceStrategy, "restore_checkpoint_after_setup", property(lambda self: True)
        )
    rec = CallRecorder()
    strategy = SingleDeviceActivationCheckpointingStrategy(policy="every:2")
    _fit(TinyTransformer(n_samples=32), strategy, tmp_path, [rec], ckpt_path=tmp_path / "last.ckpt", **run)
    assert strategy.restore_checkpoint_after_setup is restore_after_setup
    assert rec.modes_at_first_step == ("off", "off", "recompute", "recompute")
    assert rec.records["train"] == [[1, 1, 2, 2]] * 4
