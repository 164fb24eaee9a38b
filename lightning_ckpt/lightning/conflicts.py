"""Combinations refused before the first step: two owners of checkpointing, a strategy that checkpoints the
model itself (Lightning FSDP's ``activation_checkpointing_policy``, DeepSpeed), DDP ``static_graph=True`` with a
plan that can change, ``group:K`` regions over FSDP-sharded blocks."""

from __future__ import annotations

from typing import Any, List, Sequence

__all__ = [
    "ENGINE_ATTR",
    "check_strategy",
    "is_fsdp_module",
    "owners",
    "refuse_regions_across_shards",
    "refuse_static_graph",
    "two_owners_message",
]

ENGINE_ATTR = "_lightning_ckpt_engine"
"""Attribute under which a door keeps its engine; every object in ``trainer.callbacks`` with it is an owner."""


def owners(trainer: Any) -> List[Any]:
    """The callbacks that own activation checkpointing in this Trainer (one per engine)."""
    return [cb for cb in trainer.callbacks if getattr(cb, ENGINE_ATTR, None) is not None]


def two_owners_message(found: Sequence[Any]) -> str:
    described = [getattr(o, ENGINE_ATTR).describe() for o in found]
    return (
        f"Activation checkpointing is configured {len(found)} times: {', '.join(described)}. Exactly one "
        "owner may checkpoint the model. Keep one ActivationCheckpointing callback, or a *_ac strategy "
        "(e.g. strategy='ddp_ac') without the callback, or the callback with a plain strategy (e.g. 'ddp')."
    )


def check_strategy(strategy: Any) -> None:
    """Refuse a strategy that checkpoints activations itself (Lightning FSDP policy, DeepSpeed)."""
    if getattr(strategy, "_activation_checkpointing_kwargs", None):
        raise RuntimeError(
            f"{type(strategy).__name__} was given `activation_checkpointing_policy` (or "
            "`activation_checkpointing`) and lightning_ckpt checkpoints the model too: the blocks would be "
            "recomputed twice. Remove `activation_checkpointing_policy` from the FSDP strategy and let "
            "lightning_ckpt choose the blocks (keep `auto_wrap_policy` for sharding), or drop lightning_ckpt."
        )
    if _is_deepspeed(strategy):
        section = (getattr(strategy, "config", None) or {}).get("activation_checkpointing") or {}
        enabled = sorted(k for k, v in section.items() if v) if isinstance(section, dict) else []
        if enabled:
            raise RuntimeError(
                f"DeepSpeed activation checkpointing is configured ({enabled} in the "
                "'activation_checkpointing' config section) and lightning_ckpt checkpoints the model too. "
                "Turn those DeepSpeed options off or drop lightning_ckpt."
            )


def refuse_static_graph(strategy: Any, reason: str) -> None:
    """Refuse DDP ``static_graph=True`` when the plan can change during training (``reason`` names the option)."""
    kwargs = getattr(strategy, "_ddp_kwargs", None) or {}
    if kwargs.get("static_graph"):
        raise ValueError(
            f"DDP static_graph=True with {reason}: static_graph records the autograd graph of the first "
            "iterations and assumes it never changes, but switching checkpointing on or off changes which "
            f"tensors are saved and when gradients become ready. Drop static_graph=True, or drop {reason} and "
            "use a fixed policy."
        )


def _is_deepspeed(strategy: Any) -> bool:
    try:
        from lightning.pytorch.strategies import DeepSpeedStrategy
    except ImportError:  # pragma: no cover
        return False
    return isinstance(strategy, DeepSpeedStrategy)


def refuse_regions_across_shards(strategy: Any, plan: Any, policies: Sequence[Any]) -> None:
    """Refuse ``group:K`` when the blocks are sharded (FSDP2 ``fully_shard``, or Lightning's FSDP wrapping each
    block): a group replays its inner blocks' forwards without going through ``Module.__call__``, so FSDP's
    unshard hooks would not run and the replay would meet sharded parameters."""
    grouped = [p for p in policies if p.layout(plan.num_blocks).groups]
    if not grouped:
        return
    sharded = [name for name, block in zip(plan.names, plan.blocks) if _is_fsdp2(block)]
    if not sharded and _is_fsdp1(strategy):
        sharded = list(plan.names)
    if sharded:
        shown = ", ".join(sharded[:4]) + (" …" if len(sharded) > 4 else "")
        raise ValueError(
            f"policy {grouped[0].spec!r} replays several blocks as one region, but the blocks are sharded by FSDP "
            f"({shown}): the replay would skip FSDP's unshard hooks. Use policy='all' or 'every:N' (each block is "
            "its own region and replays inside its FSDP unit), or shard the model without per-block units.")


def _is_fsdp2(module: Any) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - torch without distributed
            return False
    return isinstance(module, FSDPModule)


def is_fsdp_module(module: Any) -> bool:
    """Whether ``module`` is an FSDP unit: FSDP2 ``fully_shard`` or FSDP1 ``FullyShardedDataParallel``."""
    if _is_fsdp2(module):
        return True
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(module, FullyShardedDataParallel)


def _is_fsdp1(strategy: Any) -> bool:
    try:
        from lightning.pytorch.strategies import FSDPStrategy
    except ImportError:  # pragma: no cover
        return False
    return isinstance(strategy, FSDPStrategy)
