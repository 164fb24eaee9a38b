"""One-step equivalence check: does the checkpointed step compute what the plain step computes?

The seed's "loss and gradient behaviour on a fixed small batch", automated. :func:`verify_equivalence` runs the
same forward and backward twice from the same RNG state — once with the plan's modes, once with every block
plain — and compares the loss and every gradient. Gradients, buffers and the RNG state are restored afterwards,
so the check leaves no trace in training (Python-level state a module mutates itself cannot be restored).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from lightning_ckpt.core.wrap import CheckpointPlan

__all__ = ["TOLERANCES", "EquivalenceError", "EquivalenceReport", "GroupDiff", "verify_equivalence"]

# (rtol, atol) per dtype: torch.testing's defaults
TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}


class EquivalenceError(AssertionError):
    """The checkpointed step's loss or gradients differ from the plain step's beyond the dtype tolerance."""


@dataclass(frozen=True)
class GroupDiff:
    group: str
    max_abs: float
    max_rel: float
    worst: str
    within_tolerance: bool


@dataclass(frozen=True)
class EquivalenceReport:
    loss_plain: float
    loss_checkpointed: float
    groups: Tuple[GroupDiff, ...]

    @property
    def ok(self) -> bool:
        loss_ok = _close(torch.tensor(self.loss_checkpointed), torch.tensor(self.loss_plain), torch.float32)
        return loss_ok and all(g.within_tolerance for g in self.groups)

    def table(self) -> str:
        lines = [f"loss plain {self.loss_plain:.8g}  checkpointed {self.loss_checkpointed:.8g}",
                 f"{'group':<28} {'max abs diff':>14} {'max rel diff':>14}  worst parameter"]
        for g in self.groups:
            flag = "" if g.within_tolerance else "  <-- beyond tolerance"
            lines.append(f"{g.group:<28} {g.max_abs:>14.3e} {g.max_rel:>14.3e}  {g.worst}{flag}")
        return "\n".join(lines)


def verify_equivalence(
    model: nn.Module,
    plan: CheckpointPlan,
    loss_fn: Callable[[], torch.Tensor],
    *,
    groups: Optional[Dict[str, List[str]]] = None,
    raise_on_mismatch: bool = True,
) -> EquivalenceReport:
    """Compare one checkpointed forward/backward with the plain one.

    Args:
        model: the module owning the parameters (its ``named_parameters`` names the gradients).
        plan: the applied :class:`~lightning_ckpt.core.wrap.CheckpointPlan` to verify.
        loss_fn: runs the forward on a fixed batch and returns a scalar loss (no backward, no optimizer).
        groups: parameter names per group for the report; default groups by the first path component.
        raise_on_mismatch: raise :class:`EquivalenceError` when anything is beyond tolerance.
    """
    saved_grads = {n: p.grad for n, p in model.named_parameters()}
    saved_buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    modes = plan.modes
    try:
        with torch.random.fork_rng(devices=_cuda_devices(model)):
            rng = _rng_state(model)
            loss_ckpt, grads_ckpt = _one_step(model, loss_fn, rng)
            _restore_buffers(model, saved_buffers)
            plan.set_modes(["off"] * plan.num_blocks)
            loss_plain, grads_plain = _one_step(model, loss_fn, rng)
    finally:
        plan.set_modes(modes)
        _restore_buffers(model, saved_buffers)
        for n, p in model.named_parameters():
            p.grad = saved_grads[n]
    report = EquivalenceReport(loss_plain.item(), loss_ckpt.item(),
                               _compare(grads_plain, grads_ckpt, groups or _default_groups(grads_plain)))
    if raise_on_mismatch and not report.ok:
        raise EquivalenceError(
            "lightning_ckpt verify: the checkpointed step differs from the plain step on the same batch and RNG "
            "state — a checkpointed block is not replay-safe (it reads mutable Python state, draws a "
            "data-dependent shape, or uses randomness outside torch's RNG). See README 'Replay safety'.\n"
            + report.table()
        )
    return report


def _one_step(model, loss_fn, rng) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    _set_rng_state(rng)
    for p in model.parameters():
        p.grad = None
    loss = loss_fn()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def _compare(plain, ckpt, groups: Dict[str, List[str]]) -> Tuple[GroupDiff, ...]:
    out = []
    for group, names in groups.items():
        worst, max_abs, max_rel, ok = "-", 0.0, 0.0, True
        for name in names:
            a, b = ckpt.get(name), plain.get(name)
            if a is None or b is None:
                ok = ok and (a is None) == (b is None)
                continue
            diff = (a.float() - b.float()).abs()
            abs_err = diff.max().item() if diff.numel() else 0.0
            rel_err = (diff / b.float().abs().clamp_min(1e-12)).max().item() if diff.numel() else 0.0
            if abs_err >= max_abs:
                worst, max_abs = name, abs_err
            max_rel = max(max_rel, rel_err)
            ok = ok and _close(a, b, b.dtype)
        out.append(GroupDiff(group, max_abs, max_rel, worst, ok))
    return tuple(out)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    rtol, atol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    return bool(torch.isclose(a.float(), b.float(), rtol=rtol, atol=atol, equal_nan=True).all())


def _default_groups(grads: Dict[str, torch.Tensor]) -> Dict[str, List[str]]:
    groups: Dict[str, List[str]] = defaultdict(list)
    for name in grads:
        groups[name.split(".")[0]].append(name)
    return dict(groups)


def _cuda_devices(model: nn.Module) -> List[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _rng_state(model: nn.Module):
    cuda = [(d, torch.cuda.get_rng_state(d)) for d in _cuda_devices(model)]
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for device, s in cuda:
        torch.cuda.set_rng_state(s, device)


def _restore_buffers(model: nn.Module, saved: Dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in saved:
                buf.copy_(saved[name])
