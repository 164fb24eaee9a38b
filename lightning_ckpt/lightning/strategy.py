"""The strategy way in: a mixin that gives any Lightning strategy the callback's whole product, and registered names.

``ActivationCheckpointingMixin`` goes *before* the strategy class in the bases::

    class MyStrategy(ActivationCheckpointingMixin, SomeLightningStrategy): ...

Registered names (see :func:`register_strategies`, run when Lightning is loaded after ``import lightning_ckpt``):

========================  ==============================================================
``single_device_ac``      :class:`SingleDeviceActivationCheckpointingStrategy` (device ``cpu`` unless given,
                          like Lightning's ``single_device``)
``ddp_ac``                :class:`DDPActivationCheckpointingStrategy` (``start_method="popen"``)
``ddp_spawn_ac``          :class:`DDPActivationCheckpointingStrategy` (``start_method="spawn"``)
``ddp_fork_ac``           :class:`DDPActivationCheckpointingStrategy` (``start_method="fork"``)
``fsdp_ac``               :class:`FSDPActivationCheckpointingStrategy`
========================  ==============================================================
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, StrategyRegistry

from lightning_ckpt.core.policy import Policy
from lightning_ckpt.core.wrap import CheckpointPlan
from lightning_ckpt.lightning.conflicts import check_strategy
from lightning_ckpt.lightning.settings import OPTION_NAMES, options_help, strategy_signature

__all__ = [
    "LEGACY_CHECKPOINT_KEY",
    "ActivationCheckpointingMixin",
    "DDPActivationCheckpointingStrategy",
    "FSDPActivationCheckpointingStrategy",
    "SingleDeviceActivationCheckpointingStrategy",
    "register_strategies",
]

LEGACY_CHECKPOINT_KEY = "lightning_ckpt"
"""Top-level checkpoint key where lightning_ckpt 0.1's strategies saved their plan (read on resume; now the state
is the callback's, under ``checkpoint["callbacks"]["ActivationCheckpointing"]``)."""


class ActivationCheckpointingMixin:
    """Gives a Lightning strategy the whole of :class:`~lightning_ckpt.ActivationCheckpointing`.

    The mixin holds an ``ActivationCheckpointing`` callback built from its keyword arguments (so a bad value
    raises in the strategy's ``__init__``) and puts it into ``trainer.callbacks`` when the Trainer connects the
    model, before any other hook. From there on the strategy *is* the callback: the same plan, the same
    measurement and TensorBoard curves, auto-toggle, budget, out-of-memory handling, safety checks and report, and
    the same checkpoint state (a run trained with ``strategy="ddp_ac"`` resumes with the callback, and the
    reverse). ``ActivationCheckpointingMixin`` goes *before* the strategy class in the bases::

        class MyStrategy(ActivationCheckpointingMixin, SomeLightningStrategy): ...

    Its ``__init__`` takes ``*args`` and ``**kwargs`` for the strategy and every argument of
    :class:`~lightning_ckpt.ActivationCheckpointing` by keyword (same meaning, same defaults; ``policy=None`` is
    ``"all"``), declared once in :class:`~lightning_ckpt.lightning.settings.Options`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # imported here, not at the top: registering the strategies (which imports this module) runs right after
        # Lightning loads, and Lightning may be loading *because* the callback's module is being imported
        from lightning_ckpt.lightning.callback import ActivationCheckpointing

        options = {name: kwargs.pop(name) for name in list(kwargs) if name in OPTION_NAMES}
        callback = ActivationCheckpointing(**options)
        callback._engine.owner = type(self).__name__
        super().__init__(*args, **kwargs)
        self.checkpointing = callback
        check_strategy(self)

    @property
    def plan(self) -> Optional[CheckpointPlan]:
        """The applied :class:`~lightning_ckpt.core.wrap.CheckpointPlan`, or ``None`` before ``fit``."""
        return self.checkpointing.plan

    @property
    def policy(self) -> Policy:
        """The configured (starting) policy."""
        return self.checkpointing.policy

    def connect(self, model: "pl.LightningModule") -> None:
        super().connect(model)  # type: ignore[misc]
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and not any(cb is self.checkpointing for cb in trainer.callbacks):
            trainer.callbacks.append(self.checkpointing)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        legacy = checkpoint.get(LEGACY_CHECKPOINT_KEY)  # written by lightning_ckpt 0.1's strategies
        if legacy is not None and self.checkpointing.state_key not in checkpoint.get("callbacks", {}):
            self.checkpointing.load_state_dict(legacy)
        return checkpoint


# LightningCLI (jsonargparse), help() and inspect read the strategy's arguments from these: one declaration
ActivationCheckpointingMixin.__init__.__signature__ = strategy_signature()
ActivationCheckpointingMixin.__init__.__doc__ = (
    "Build the strategy with activation checkpointing.\n\n" + options_help()
    + "\n    *args: passed on to the strategy.\n    **kwargs: passed on to the strategy.")


class SingleDeviceActivationCheckpointingStrategy(ActivationCheckpointingMixin, SingleDeviceStrategy):
    """``SingleDeviceStrategy`` with activation checkpointing; registered as ``single_device_ac``.

    Like Lightning's ``single_device``, the device is ``"cpu"`` unless ``device=`` is given; on a GPU pass
    ``device="cuda:0"`` or use the :class:`~lightning_ckpt.ActivationCheckpointing` callback instead.
    """

    strategy_name = "single_device_ac"


class DDPActivationCheckpointingStrategy(ActivationCheckpointingMixin, DDPStrategy):
    """``DDPStrategy`` with activation checkpointing; registered as ``ddp_ac``, ``ddp_spawn_ac``,
    ``ddp_fork_ac``.

    The blocks are checkpointed in place before the module is wrapped in ``DistributedDataParallel``, always
    non-reentrant, so ``find_unused_parameters=True`` works. ``static_graph=True`` works with a fixed plan;
    changing the plan during training (``plan.retarget``) changes the autograd graph and is not supported
    under ``static_graph``.
    """

    strategy_name = "ddp_ac"


class FSDPActivationCheckpointingStrategy(ActivationCheckpointingMixin, FSDPStrategy):
    """``FSDPStrategy`` with activation checkpointing; registered as ``fsdp_ac`` (needs CUDA, like ``fsdp``).

    Do not pass ``activation_checkpointing_policy`` (that would checkpoint twice; it raises). When no
    ``auto_wrap_policy`` is given, each block class the plan found becomes its own FSDP unit, so every
    checkpointed block is recomputed inside its unit (the arrangement Lightning recommends for FSDP + AC).
    """

    strategy_name = "fsdp_ac"

    def setup(self, trainer: "pl.Trainer") -> None:
        # the plan was applied right before this call (the engine's pre-setup shim): wrap each block class
        plan = self.plan
        if plan is not None and plan.num_blocks and "auto_wrap_policy" not in self.kwargs:
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            # wrapped by the user in configure_model: FSDP ignores auto-wrapping then
            if not any(isinstance(m, FullyShardedDataParallel) for m in self.lightning_module.modules()):
                self.kwargs["auto_wrap_policy"] = ModuleWrapPolicy({type(block) for block in plan.blocks})
        super().setup(trainer)


_REGISTRY = (
    ("single_device_ac", SingleDeviceActivationCheckpointingStrategy, {}, "single device"),
    ("ddp_ac", DDPActivationCheckpointingStrategy, {"start_method": "popen"}, "DDP (popen)"),
    ("ddp_spawn_ac", DDPActivationCheckpointingStrategy, {"start_method": "spawn"}, "DDP (spawn)"),
    ("ddp_fork_ac", DDPActivationCheckpointingStrategy, {"start_method": "fork"}, "DDP (fork)"),
    ("fsdp_ac", FSDPActivationCheckpointingStrategy, {}, "FSDP"),
)


def register_strategies(registry: Any = None) -> None:
    """Register ``single_device_ac``, ``ddp_ac``, ``ddp_spawn_ac``, ``ddp_fork_ac`` and ``fsdp_ac``.

    Idempotent. ``registry`` defaults to Lightning's ``StrategyRegistry``. ``fsdp_ac`` is also added to
    FSDP's own name list, so Lightning's "FSDP needs a GPU accelerator" check covers it.
    """
    registry = StrategyRegistry if registry is None else registry
    for name, cls, init_params, what in _REGISTRY:
        registry.register(
            name,
            cls,
            description=f"{what} with lightning_ckpt activation checkpointing (policy 'all')",
            override=True,
            **init_params,
        )
    if "fsdp_ac" not in FSDPStrategy._registered_strategies:
        FSDPStrategy._registered_strategies.append("fsdp_ac")


# importing this module loads Lightning: when that import is what brought Lightning in, the package's hook found
# this module half-built and left the registration to it
register_strategies()
