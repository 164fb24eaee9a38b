"""Both doors are one product: the same scenario through the callback and through a ``*_ac`` strategy gives the
same plan, the same logged figures and TensorBoard curves, the same report, the same safety checks."""

from __future__ import annotations

import gc
import glob
import os
import re

import pytest
import torch
from _lightning_models import TinyTransformer, trainer_kwargs
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_ckpt import ActivationCheckpointing, ReplaySafetyError, SingleDeviceActivationCheckpointingStrategy

# policy × arguments: every kind of plan, fixed and changing
SCENARIOS = {
    "none": dict(policy="none"),
    "every:2": dict(policy="every:2"),
    "all": dict(policy="all"),
    "selective": dict(policy="selective"),
    "group:2": dict(policy="group:2"),
    "auto-toggle": dict(auto_threshold=1, cooldown=100),  # 1 byte: rises every step
    "budget": dict(policy="budget:20KiB"),
}
DOORS = ("callback", "strategy")
TIME_KEYS = ("throughput/tokens_per_sec", "throughput/samples_per_sec", "time/step_s")


def _fit(tmp_path, door: str, kwargs: dict, model=None, **trainer_overrides):
    seed_everything(0)
    model = model or TinyTransformer(batch_size=8, n_samples=48)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    run = dict(max_steps=5, log_every_n_steps=1, limit_val_batches=0, num_sanity_val_steps=0, logger=logger)
    run.update(trainer_overrides)
    if door == "callback":
        door_object = ActivationCheckpointing(**kwargs)
        trainer = Trainer(callbacks=[door_object], **trainer_kwargs(tmp_path, **run))
    else:  # "ddp_ac"-style by name takes default arguments only: the name is tested with the default policy
        strategy = "single_device_ac" if door == "strategy by name" else \
            SingleDeviceActivationCheckpointingStrategy(device="cpu", **kwargs)
        trainer = Trainer(strategy=strategy, **trainer_kwargs(tmp_path, **run))
        door_object = trainer.strategy.checkpointing
    # The CPU's peaks count a storage until it is freed, and some die only when Python's cycle collector runs: when
    # it runs inside a step moved a peak by 8 KiB between two fits of one door (on torch 2.14.1 and 2.15.0 alike).
    # No collection during the fit: what is compared is what the door does, not when the collector ran.
    gc.collect()
    gc.disable()
    try:
        trainer.fit(model)
    finally:
        gc.enable()
    return trainer, door_object, model


def _tags(logdir) -> set:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (path,) = glob.glob(os.path.join(str(logdir), "tb", "**", "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    return {t for t in acc.Tags()["scalars"] if "/" in t and t.split("/")[0] in ("memory", "throughput", "time",
                                                                                   "checkpointing")}


def test_the_registered_name_is_the_callback_with_its_defaults(tmp_path, capsys):
    _, by_name, _ = _fit(tmp_path / "name", "strategy by name", {})
    _, callback, _ = _fit(tmp_path / "callback", "callback", {})
    assert by_name is not callback and by_name.plan.spec == callback.plan.spec == "all"
    drop = set(TIME_KEYS)
    assert {k: v for k, v in by_name.last_metrics.items() if k not in drop} == \
        {k: v for k, v in callback.last_metrics.items() if k not in drop}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_same_scenario_through_every_door_gives_the_same_product(tmp_path, capsys, scenario):
    kwargs = SCENARIOS[scenario]
    results = {}
    for door in DOORS:
        trainer, cb, model = _fit(tmp_path / door.replace(" ", "_"), door, kwargs)
        printed = capsys.readouterr().out
        report = printed[printed.index("lightning_ckpt memory ledger"):]
        # a bucket row's last figure is its measured tokens/s: a time, like TIME_KEYS
        report = re.sub(r"^(\s+\d+ x \d+ .*\s)[\d,]+$", r"\1<tokens/s>", report, flags=re.M)
        report = re.sub(r"[\d.]+ s pricing shapes", "<seconds> pricing shapes", report)  # a time too
        figures = {k: v for k, v in cb.last_metrics.items() if k not in TIME_KEYS}
        results[door] = dict(modes=cb.plan.modes, spec=cb.plan.spec, figures=figures,
                             keys=set(cb.last_metrics), tags=_tags(tmp_path / door.replace(" ", "_")),
                             report=report, params={k: v.clone() for k, v in model.state_dict().items()},
                             level=None if cb.controller is None else cb.controller.level)
    reference = results["callback"]
    assert reference["figures"]["memory/activations_gib"] > 0 or scenario == "none"
    assert {"memory/activations_gib", "throughput/tokens_per_sec"} <= reference["tags"]
    for door in DOORS[1:]:
        got = results[door]
        assert got["modes"] == reference["modes"] and got["spec"] == reference["spec"], door
        assert got["keys"] == reference["keys"] and got["tags"] == reference["tags"], door
        assert got["figures"] == reference["figures"], door
        assert got["report"] == reference["report"], door
        assert got["level"] == reference["level"], door
        for k, v in reference["params"].items():
            assert torch.equal(got["params"][k], v), (door, k)


class BatchNormBlock(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x):
        return x + self.norm(self.lin(x).transpose(1, 2)).transpose(1, 2)


class WithBatchNorm(TinyTransformer):
    def _build(self) -> None:
        super()._build()
        self.layers = nn.ModuleList(BatchNormBlock(self.hparams.d_model) for _ in range(4))

    def block_calls(self) -> list:
        return [0] * 4


@pytest.mark.parametrize("door", DOORS)
def test_the_safety_checks_run_through_every_door(tmp_path, door):
    with pytest.warns(UserWarning, match="running statistics"):
        _fit(tmp_path / "warn", door, dict(policy="all"), model=WithBatchNorm(), max_steps=1)
    _, cb, _ = _fit(tmp_path / "skip", door, dict(policy="all", stateful="skip"), model=WithBatchNorm(),
                    max_steps=1)
    assert cb.plan.num_checkpointed == 0
    with pytest.raises(ReplaySafetyError, match="running statistics"):
        _fit(tmp_path / "error", door, dict(policy="all", stateful="error"), model=WithBatchNorm(), max_steps=1)


def test_static_graph_with_auto_toggle_is_refused_through_the_strategy_door_too(tmp_path):
    class DDPAC(SingleDeviceActivationCheckpointingStrategy):  # a strategy with DDP kwargs, checked the same way
        _ddp_kwargs = {"static_graph": True}

    strategy = DDPAC(device="cpu", auto_threshold="1GiB")
    with pytest.raises(ValueError, match="static_graph"):
        Trainer(strategy=strategy, **trainer_kwargs(tmp_path, max_steps=1)).fit(TinyTransformer())
    assert DDPStrategy  # the real DDP strategy is covered in test_autotoggle (spawned)
