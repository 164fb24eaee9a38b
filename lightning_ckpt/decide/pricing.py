"""Price a batch shape before any batch of it runs: the live model's bytes per block, traced on fake tensors.

A per-shape plan (:mod:`lightning_ckpt.decide.shapes`) must fit *before* the first batch of a new, longer shape
runs: afterwards is the out-of-memory error. :func:`price_shape` measures what the budget's solver needs — per block
the bytes kept ``off``, the boundary, what ``selective`` keeps, what each replay creates, and the bytes outside the
blocks (:class:`~lightning_ckpt.decide.budget.BlockCost`, ``base``) — for a batch of that shape, with the same
stages as the budget's calibration (:class:`~lightning_ckpt.decide.budget.BudgetCalibration`, bytes only), on the
model being trained, without allocating it:

- every parameter and buffer is swapped for a *fake tensor* of the same shape, dtype and device (no storage) for
  the duration, tied weights staying tied; the batch is a real one of the target shape
  (:func:`~lightning_ckpt.decide.shapes.resize_batch`: a few kilobytes of token ids), so code that reads the batch's
  values (a mask check) runs as in training;
- the step is the caller's ``loss_fn(batch)`` — the Lightning edge passes the module's own ``training_step`` under
  the precision plugin's context, with ``self.log`` silenced — and its backward; no optimizer step, no gradient
  reaches a real parameter;
- afterwards the parameters, buffers and plan modes are put back, and any tensor attribute the step left on a module
  (a lazily built cache) is put back as it was: fake values never stay in the model.

Times are not priced here (fake kernels take no time): the caller scales the measured ones.

Known limitations: a model that reads parameter or buffer *values* in its step (``.item()`` on a weight) cannot be
traced on fake tensors, and a sharded one (FSDP's ``DTensor`` parameters) is not swapped; :class:`PricingError`
says which, and the caller falls back. The step is the module's own: code in it with side effects beyond tensors
(a Python counter, a list it appends to) sees the priced calls too, a few per shape.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from lightning_ckpt.decide.budget import BlockCost, BudgetCalibration

__all__ = ["PricingError", "ShapeCosts", "fake_state", "fake_steps", "hf_masks_as_on_real_tensors", "price_shape",
           "trace_plans"]


class PricingError(RuntimeError):
    """A shape could not be priced on fake tensors (the message says why)."""


@dataclass(frozen=True)
class ShapeCosts:
    """Bytes of every block and outside them for one batch shape (times 0: see the module docstring)."""

    costs: Tuple[BlockCost, ...]
    base: Tuple[int, int]
    traced: Dict[Tuple[str, ...], int] = field(default_factory=dict)
    """The activation peak traced for each plan that was run (per-block modes -> bytes)."""

    @property
    def interior(self) -> int:
        """Bytes the blocks keep un-checkpointed, all of them."""
        return sum(c.interior for c in self.costs)


def _sharded(t: torch.Tensor) -> bool:
    return hasattr(t, "_local_tensor") or hasattr(t, "device_mesh")


def _tensor_attributes(model: nn.Module) -> Dict[Tuple[int, str], Any]:
    """Every tensor a module holds as a plain attribute (not a parameter or buffer): ``(module id, name) -> value``."""
    out = {}
    for module in model.modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                out[(id(module), name)] = value
    return out


@contextlib.contextmanager
def fake_state(model: nn.Module, mode: Any) -> Iterator[List[torch.Tensor]]:
    """Swap every parameter and buffer of ``model`` for a fake tensor of ``mode`` (tied ones stay tied); yield the
    fake parameters; put everything back on exit, plain tensor attributes included (see the module docstring)."""
    slots: List[Tuple[nn.Module, str, str, torch.Tensor]] = []
    fakes: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, value in getattr(module, kind).items():
                if value is None:
                    continue
                if _sharded(value):
                    raise PricingError(f"{type(module).__name__}.{name} is sharded (a DTensor): shapes are not "
                                       "priced on fake tensors under FSDP")
                slots.append((module, kind, name, value))
    attributes = _tensor_attributes(model)
    try:
        for module, kind, name, value in slots:
            if id(value) not in fakes:
                fake = mode.from_tensor(value.detach())
                if kind == "_parameters":
                    fake = nn.Parameter(fake, requires_grad=value.requires_grad)
                fakes[id(value)] = fake
            getattr(module, kind)[name] = fakes[id(value)]
        yield [f for f in fakes.values() if isinstance(f, nn.Parameter)]
    finally:
        for module, kind, name, value in slots:
            getattr(module, kind)[name] = value
        modules = {id(m): m for m in model.modules()}
        for (module_id, name), value in _tensor_attributes(model).items():
            if is_fake(value) and module_id in modules:
                original = attributes.get((module_id, name))
                if original is None:
                    delattr(modules[module_id], name)
                else:
                    setattr(modules[module_id], name, original)


@contextlib.contextmanager
def hf_masks_as_on_real_tensors() -> Iterator[None]:
    """Hugging Face's mask builder treats a fake tensor as tracing: it cannot read the position ids, assumes packed
    sequences and materialises the causal mask, which a real step skips (``is_causal=True``, the flash kernel on
    CUDA). The traced batch holds one sequence per row, as the synthetic batch does, so it is not packed."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def as_real(position_ids):
        return None if is_fake(position_ids) else original(position_ids)

    masking.find_packed_sequence_indices = as_real
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


@contextlib.contextmanager
def fake_steps(model: nn.Module, plan: Any, loss_fn: Callable[[Any], torch.Tensor], batch: Any,
               context: Callable[[], Any] = contextlib.nullcontext) -> Iterator[Tuple[Callable[[bool], int], Any]]:
    """Yield ``(step, meter)``: ``step(exact)`` runs ``loss_fn(batch)`` and its backward on fake tensors under the
    plan's current modes and returns the activation peak the meter counted (exactly); the parameters, buffers, plan
    modes and notes are put back on exit (see the module docstring). Arguments as :func:`price_shape`'s."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    from lightning_ckpt.measure.meter import StepMeter

    saved_policy, saved_notes = plan.policy, plan.notes
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        # a training step's own meter may be counting (a later micro-batch of an accumulation window prices its
        # bucket inside the step): it must not see the fake tensors, which take no memory
        with _disable_current_modes(), warnings.catch_warnings(), fake_state(model, mode) as params:
            warnings.simplefilter("ignore")
            meter = StepMeter(params[0].device if params else "cpu").watch(model)

            def step(exact: bool = True) -> int:
                with mode, hf_masks_as_on_real_tensors(), context(), meter.step(exact=True) as box:
                    loss = loss_fn(batch)
                    loss.backward()
                    del loss
                for p in params:
                    p.grad = None
                return box.reading.activations or 0

            yield step, meter
    except PricingError:
        raise
    except Exception as err:  # the model's step could not run on fake tensors: the caller falls back
        raise PricingError(f"{type(err).__name__}: {err}") from err
    finally:
        plan.retarget(saved_policy)  # the policy, not only its modes: group:K regions come back too
        if saved_notes:
            plan.annotate(saved_notes)


def price_shape(model: nn.Module, plan: Any, loss_fn: Callable[[Any], torch.Tensor], batch: Any,
                modes: Sequence[str] = ("recompute", "selective"),
                context: Callable[[], Any] = contextlib.nullcontext) -> ShapeCosts:
    """Measure per-block bytes for ``batch`` (already of the shape to price) on fake tensors.

    Args:
        model: the model that holds ``plan``'s blocks (its parameters and buffers are swapped for fakes while
            pricing).
        plan: the :class:`~lightning_ckpt.core.wrap.CheckpointPlan` of the run; its modes and notes are put back.
        loss_fn: ``loss_fn(batch) -> loss`` of one micro-batch (its backward is run too).
        batch: a real batch of the shape to price (:func:`~lightning_ckpt.decide.shapes.resize_batch`).
        modes: the modes the plan may mix with ``off``, as in the budget's calibration (``offload`` is not priced:
            its bytes leave the device).
        context: entered around each step (the precision plugin's training-step context: its autocast).

    Returns:
        The per-block bytes, the bases, and the activation peak traced for each plan the stages ran
        (:attr:`ShapeCosts.traced`).

    Raises:
        PricingError: the model cannot be traced on fake tensors (see the module docstring).
    """
    measured = tuple(m for m in modes if m in ("recompute", "selective"))
    with fake_steps(model, plan, loss_fn, batch, context) as (step, meter):
        calibration = BudgetCalibration(plan, meter, 0, apply=plan.set_modes, modes=measured, times=False,
                                        choose=False)
        try:
            calibration.run(step)
        finally:  # its hooks never outlive the pricing, even when the step fails on fake tensors
            calibration.close()
        return ShapeCosts(tuple(calibration.costs()), calibration.base, dict(calibration.measured_plans))


def trace_plans(model: nn.Module, plan: Any, loss_fn: Callable[[Any], torch.Tensor], batch: Any,
                plans: Sequence[Any], context: Callable[[], Any] = contextlib.nullcontext) -> List[int]:
    """The activation peak of each plan — per-block modes, or a policy (``"every:2"``, ``"group:2"``) — for
    ``batch``, traced on fake tensors (one step each; arguments as :func:`price_shape`'s)."""
    peaks = []
    with fake_steps(model, plan, loss_fn, batch, context) as (step, _):
        for item in plans:
            if isinstance(item, str):
                plan.retarget(item)
            else:
                plan.set_modes(list(item))
            peaks.append(step(True))
    return peaks
