"""Replay-safety checks: is each checkpointed region close to a pure function?

A checkpointed block runs its forward twice. That is only harmless when the block is (nearly) a pure function
of its tensor inputs. :func:`preflight` inspects a plan before the first step:

- modules that update buffers in forward (BatchNorm running statistics and friends) inside a checkpointed
  block would update them twice per step: warned about by default, or those blocks are kept un-checkpointed
  (``stateful="skip"``), or refused (``stateful="error"``);
- dropout inside a checkpointed block with ``preserve_rng_state=False`` would draw a different mask on replay
  (the gradient no longer matches the forward): refused.

:func:`buffer_versions` / :func:`changed_buffers` catch the general case at run time: any buffer a checkpointed
block modified in place during a training step (its version counter moved), whatever its class.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Tuple

from torch import nn

from lightning_ckpt.core.wrap import CheckpointPlan

__all__ = ["STATEFUL_CHOICES", "ReplaySafetyError", "buffer_versions", "changed_buffers", "preflight"]

STATEFUL_CHOICES = ("warn", "skip", "error")


class ReplaySafetyError(ValueError):
    """A checkpointed region would not compute the same thing when replayed."""


def preflight(plan: CheckpointPlan, stateful: str = "warn", may_change: str = "") -> List[str]:
    """Check a plan before training, and again after every change; returns the blocks ``stateful="skip"`` keeps
    off.

    Args:
        plan: the applied plan.
        stateful: what to do about running statistics in checkpointed blocks (:data:`STATEFUL_CHOICES`).
        may_change: when the plan can change during training, the option that changes it (``"auto_threshold"``,
            ``"on_oom='escalate'"``, a budget policy): the refusals then cover every block, since any may be
            checkpointed later, so they happen before the first step, never in the middle of training.

    Raises:
        ValueError: ``stateful`` is not one of :data:`STATEFUL_CHOICES`.
        ReplaySafetyError: dropout with ``preserve_rng_state=False``, or stateful modules with ``"error"``.
    """
    if stateful not in STATEFUL_CHOICES:
        raise ValueError(f"stateful={stateful!r} is not valid; choose one of {list(STATEFUL_CHOICES)}.")
    every = list(zip(plan.names, plan.blocks))
    active = [(name, block) for name, block, mode in zip(plan.names, plan.blocks, plan.modes) if mode != "off"]
    _check_dropout(plan, every if may_change else active, may_change)
    offenders = {name: _running_stat_modules(name, block) for name, block in (every if may_change and
                                                                           stateful == "error" else active)}
    offenders = {name: mods for name, mods in offenders.items() if mods}
    if not offenders:
        return []
    listed = sorted(m for mods in offenders.values() for m in mods)
    if stateful == "error":
        if may_change:
            raise ReplaySafetyError(_stateful_message(listed) + f" {may_change} may checkpoint any block during "
                                    "training, so every block is checked now. Pass stateful='skip' to keep those "
                                    "blocks un-checkpointed whichever policy runs, or remove the running statistics.")
        raise ReplaySafetyError(_stateful_message(listed) + " Pass stateful='skip' to keep those blocks "
                                "un-checkpointed, or remove the running statistics.")
    if stateful == "skip":
        modes = ["off" if name in offenders else mode for name, mode in zip(plan.names, plan.modes)]
        if tuple(modes) != plan.modes:
            plan.set_modes(modes)
        return sorted(offenders)
    warnings.warn(_stateful_message(listed) + " Pass stateful='skip' (callback argument) to keep those blocks "
                  "un-checkpointed.", UserWarning, stacklevel=2)
    return []


def _stateful_message(modules: List[str]) -> str:
    return (
        f"lightning_ckpt: {len(modules)} module(s) inside checkpointed blocks update running statistics in "
        f"forward, so the replay in backward updates them a second time: {modules}. Gradients are unaffected; "
        "the running statistics drift."
    )


def _running_stat_modules(prefix: str, block: nn.Module) -> List[str]:
    found = []
    for name, module in block.named_modules():
        norm = isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
        if norm and module.running_mean is not None:
            found.append(f"{prefix}.{name}" if name else prefix)
    return found


def _check_dropout(plan: CheckpointPlan, blocks: List[Tuple[str, nn.Module]], may_change: str = "") -> None:
    if plan.options["preserve_rng_state"]:
        return
    with_dropout = [f"{name}.{sub}" if sub else name for name, block in blocks
                    for sub, module in block.named_modules() if _has_dropout(module)]
    if with_dropout:
        where = f"blocks that {may_change} may checkpoint" if may_change else "checkpointed blocks"
        raise ReplaySafetyError(
            f"preserve_rng_state=False with active dropout inside {where} {with_dropout[:5]}"
            f"{' …' if len(with_dropout) > 5 else ''}: the replay would draw a different dropout mask, so the "
            "gradients would not belong to the forward that produced the loss. Keep preserve_rng_state=True "
            "(the default) or set the dropout probability to 0."
        )


def _has_dropout(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, nn.MultiheadAttention):
        return module.dropout > 0
    return False


def buffer_versions(plan: CheckpointPlan) -> Dict[str, int]:
    """In-place version counters of every buffer inside checkpointed blocks (cheap: no data is read)."""
    return {
        f"{name}.{buf_name}": buf._version
        for name, block, mode in zip(plan.names, plan.blocks, plan.modes) if mode != "off"
        for buf_name, buf in block.named_buffers()
    }


def changed_buffers(plan: CheckpointPlan, before: Dict[str, int]) -> List[str]:
    """Buffers of checkpointed blocks modified in place since ``before`` was taken."""
    after = buffer_versions(plan)
    return sorted(k for k, v in after.items() if k in before and v != before[k])
