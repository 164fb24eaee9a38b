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

from typing import Any, Callable, Dict, List, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, StrategyRegistry

from lightning_ckpt.core.blocks import BlockSelector
from lightning_ckpt.core.policy import Policy
from lightning_ckpt.core.wrap import CheckpointPlan
from lightning_ckpt.lightning.conflicts import check_strategy

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

    Args:
        policy, blocks, ...: the arguments of :class:`~lightning_ckpt.ActivationCheckpointing` (same meaning, same
            defaults); ``policy=None`` is ``"all"``.
        *args, **kwargs: passed on to the strategy.
    """

    def __init__(
        self,
        *args: Any,
        policy: Union[str, Policy, None] = None,
        blocks: BlockSelector = None,
        preserve_rng_state: bool = True,
        determinism_check: Literal["default", "none"] = "default",
        debug: bool = False,
        measure: bool = True,
        exact_every_n_steps: int = 0,
        tokens_fn: Optional[Callable[[Any], Any]] = None,
        prefix: str = "",
        auto_threshold: Optional[Union[str, int, float]] = None,
        capacity: Optional[Union[str, int]] = None,
        ladder: Optional[List[str]] = None,
        release: float = 0.8,
        cooldown: int = 20,
        decide_every_n_steps: int = 1,
        on_oom: Literal["raise", "escalate"] = "raise",
        stateful: Literal["warn", "skip", "error"] = "warn",
        verify: bool = False,
        report: bool = True,
        compile_blocks: bool = False,
        max_shape: Optional[Union[str, List[int]]] = None,
        shape_fn: Optional[Callable[[Any], Any]] = None,
        per_shape: bool = True,
        snapshot_on_oom: Union[bool, int] = False,
        zero_grad_before_forward: bool = False,
        **kwargs: Any,
    ) -> None:
        # imported here, not at the top: registering the strategies (which imports this module) runs right after
        # Lightning loads, and Lightning may be loading *because* the callback's module is being imported
        from lightning_ckpt.lightning.callback import ActivationCheckpointing

        callback = ActivationCheckpointing(
            policy=policy, blocks=blocks, preserve_rng_state=preserve_rng_state, determinism_check=determinism_check,
            debug=debug, measure=measure, exact_every_n_steps=exact_every_n_steps, tokens_fn=tokens_fn,
            prefix=prefix, auto_threshold=auto_threshold, capacity=capacity, ladder=ladder, release=release,
            cooldown=cooldown, decide_every_n_steps=decide_every_n_steps, on_oom=on_oom, stateful=stateful,
            verify=verify, report=report, compile_blocks=compile_blocks, max_shape=max_shape, shape_fn=shape_fn,
            per_shape=per_shape, snapshot_on_oom=snapshot_on_oom, zero_grad_before_forward=zero_grad_before_forward)
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
