"""The Strategy door to the checkpointing engine: a mixin for any Lightning strategy, and registered names.

``ActivationCheckpointingMixin`` goes *before* the strategy class in the bases::

    class MyStrategy(ActivationCheckpointingMixin, SomeLightningStrategy): ...

Registered names (see :func:`register_strategies`, run when ``lightning_ckpt`` is imported):

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

from typing import Any, Dict, Literal, Optional

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ckpt._engine import ENGINE_ATTR, CheckpointingEngine, EngineDoor, check_strategy
from lightning_ckpt.blocks import BlockSelector
from lightning_ckpt.wrap import CheckpointPlan

__all__ = [
    "CHECKPOINT_KEY",
    "ActivationCheckpointingMixin",
    "DDPActivationCheckpointingStrategy",
    "FSDPActivationCheckpointingStrategy",
    "SingleDeviceActivationCheckpointingStrategy",
    "register_strategies",
]

CHECKPOINT_KEY = "lightning_ckpt"
"""Top-level key under which a mixin strategy saves its plan state in Lightning checkpoints."""


class ActivationCheckpointingMixin(EngineDoor):
    """Gives a Lightning strategy the behaviour of :class:`~lightning_ckpt.ActivationCheckpointing`.

    It drives the same engine as the callback, at the strategy's own model-setup step:

    - ``__init__``: validates ``policy``/``blocks``/options (bad values raise here) and refuses a strategy
      that checkpoints activations itself (FSDP ``activation_checkpointing_policy``).
    - ``setup(trainer)`` (when fitting): refuses a second owner (the callback as well), then applies the plan
      to the LightningModule *before* the wrapped strategy's ``setup`` moves it to the device and wraps it in
      DDP/FSDP. ``configure_model`` and (unless ``restore_checkpoint_after_setup``) the checkpoint restore
      have run by then.
    - ``save_checkpoint``: adds the plan state (primitives only) under ``checkpoint["lightning_ckpt"]``.
    - ``load_checkpoint``: reads it back; the saved plan is re-applied before the first resumed step (at
      ``setup``, or at once when the strategy restores after setup, like FSDP). The configured policy wins
      over a different saved one, with a warning.

    Args:
        policy: policy string (``"all"``, ``"every:2"``, ``"selective"``, ...) or :class:`Policy`.
        blocks: block selector (``None`` detects the blocks; class name, path glob, class, or a list).
        preserve_rng_state: replay dropout with the same random state.
        determinism_check: ``"default"`` or ``"none"``.
        debug: operator traces in checkpoint errors.
        *args, **kwargs: passed on to the strategy.
    """

    def __init__(
        self,
        *args: Any,
        policy: str = "all",
        blocks: BlockSelector = None,
        preserve_rng_state: bool = True,
        determinism_check: Literal["default", "none"] = "default",
        debug: bool = False,
        **kwargs: Any,
    ) -> None:
        engine = CheckpointingEngine(
            policy,
            blocks,
            preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check,
            debug=debug,
            owner=type(self).__name__,
        )
        super().__init__(*args, **kwargs)
        setattr(self, ENGINE_ATTR, engine)
        check_strategy(self)

    def connect(self, model: "pl.LightningModule") -> None:
        self._engine.begin_run()  # called first thing in every Trainer run, before any checkpoint is read
        super().connect(model)  # type: ignore[misc]

    def setup(self, trainer: "pl.Trainer") -> None:
        self._engine.check_trainer(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._apply_checkpointing()
        super().setup(trainer)  # type: ignore[misc]

    def _apply_checkpointing(self) -> CheckpointPlan:
        plan = self._engine.apply(self.lightning_module)  # type: ignore[attr-defined]
        rank_zero_info(plan.summary().splitlines()[0])
        self._on_plan_applied(plan)
        return plan

    def _on_plan_applied(self, plan: CheckpointPlan) -> None:
        """Hook for subclasses: runs after the plan is applied, before the strategy wraps the model."""

    def save_checkpoint(
        self, checkpoint: Dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        checkpoint[CHECKPOINT_KEY] = self._engine.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None:
            self._engine.load_state_dict(state)
        return checkpoint


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

    def _on_plan_applied(self, plan: CheckpointPlan) -> None:
        if "auto_wrap_policy" in self.kwargs or not plan.num_blocks:
            return
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        if any(isinstance(m, FullyShardedDataParallel) for m in self.lightning_module.modules()):
            return  # wrapped by the user in configure_model: FSDP ignores auto-wrapping then
        self.kwargs["auto_wrap_policy"] = ModuleWrapPolicy({type(block) for block in plan.blocks})


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
