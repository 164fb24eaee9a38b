"""Price a batch shape before any batch of it runs: the live model's bytes per block, traced on fake tensors.

A per-shape plan (:mod:`lightning_ckpt.decide.shapes`) must fit *before* the first batch of a new, longer shape
runs: afterwards is the out-of-memory error. :func:`price_shape` measures what the budget's solver needs — per block
the bytes kept ``off``, the boundary, what ``selective`` keeps, what each replay creates, and the bytes outside the
blocks (:class:`~lightning_ckpt.decide.budget.BlockCost`, ``base``) — for a batch of that shape, with the budget
calibration's hooks (:class:`~lightning_ckpt.decide.calibration.BudgetCalibration`, bytes only) on one whole-model step
and on one block alone per kind and mode (:func:`price_shape`; the calibration's five whole-model stages are
:func:`price_shape_by_stages`), on the model being trained, without allocating it:

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
says which, and the caller falls back. An error of the plugin's own code is raised as it is, never turned into a
fallback (:func:`_raised_by_the_plugin` reads whose it is from the frame that raised it). The step is the module's
own: code in it with side effects beyond tensors (a Python counter, a list it appends to) sees the priced calls
too, a few per shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import sysconfig
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_flatten, tree_map

from lightning_ckpt.decide.budget import BlockCost, _prefix_and_transient
from lightning_ckpt.decide.calibration import BudgetCalibration

__all__ = ["PricingError", "ShapeCosts", "fake_state", "fake_steps", "hf_masks_as_on_real_tensors", "price_shape",
           "price_shape_by_stages", "trace_plans"]


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


class _FakeSession:
    """Steps of one pricing on fake tensors: the whole model's (:meth:`step`, :meth:`split_step`) and one block's
    alone (:meth:`block_step`), each counted exactly by ``meter`` and its backward run."""

    def __init__(self, mode: Any, meter: Any, params: List[torch.Tensor], loss_fn: Callable[[Any], torch.Tensor],
                 batch: Any, context: Callable[[], Any]) -> None:
        self.mode, self.meter, self.params = mode, meter, params
        self.loss_fn, self.batch, self.context = loss_fn, batch, context

    def step(self, exact: bool = True) -> int:
        """The whole model's step under the plan's modes; its activation peak."""
        with self.mode, hf_masks_as_on_real_tensors(), self.context(), self.meter.step(exact=True) as box:
            loss = self.loss_fn(self.batch)
            loss.backward()
            del loss
        self._clear_grads()
        return box.reading.activations or 0

    def split_step(self, last: nn.Module) -> Tuple[int, int, int]:
        """The whole model's step under the plan's modes: the activation peak after the blocks' forward (``last`` is
        the last block: what the head, the logits and the loss, add to what the blocks keep), the backward's peak
        (from what the forward left alive), and the step's peak. One step tells both bases; the peak inside a
        block's forward is in neither, as in the peak model."""
        box, peaks = None, {"step": 0, "forward": True}

        def restart(live: Any) -> None:  # a running peak starts here: the step's peak keeps what it had
            peaks["step"] = max(peaks["step"], live.peak)
            live.reset_peak()

        def after_the_blocks(*_: Any) -> None:  # a replay in backward runs the block again: not the forward's end
            live = getattr(self.meter, "_live", None)  # the exact count of the open step (StepMeter's own)
            if peaks["forward"] and live is not None:
                restart(live)

        handle = last.register_forward_hook(after_the_blocks)
        try:
            with self.mode, hf_masks_as_on_real_tensors(), self.context(), self.meter.step(exact=True) as box:
                loss = self.loss_fn(self.batch)
                live = getattr(self.meter, "_live", None)
                if live is None:
                    raise PricingError("the step meter kept no exact count of live bytes")
                peaks["forward"], forward = False, live.peak
                restart(live)
                loss.backward()
                del loss
        finally:
            handle.remove()
        self._clear_grads()
        backward = box.reading.activations or 0
        return forward, backward, max(peaks["step"], backward)

    def block_step(self, block: nn.Module, block_input: Tuple[Tuple[Any, ...], Dict[str, Any]]) -> int:
        """One block alone on its captured input (its forward and a backward from its outputs); its peak."""
        with self.mode:
            args, kwargs = tree_map(_fresh_leaf, block_input, is_leaf=lambda v: isinstance(v, _TensorSpec))
        with self.mode, self.context(), self.meter.step(exact=True) as box:
            out = block(*args, **kwargs)
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            del out, outputs
        self._clear_grads()
        return box.reading.activations or 0

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None


@dataclass(frozen=True)
class _TensorSpec:
    """What a block's input tensor was (not the tensor: held, it would stay alive through the step's backward)."""

    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype, value.device, value.requires_grad)
    return value


def _fresh_leaf(value: Any) -> Any:
    """A new tensor like the captured one, a leaf that requires grad as the original did (a block's saved tensors
    depend on which of its inputs require grad: the rotary tables do not). Made under the fake mode: no storage."""
    if isinstance(value, _TensorSpec):
        t = torch.empty_strided(value.size, value.stride, dtype=value.dtype, device=value.device)
        return t.requires_grad_(value.requires_grad)
    return value


_PLUGIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEMOS_DIR = os.path.join(_PLUGIN_DIR, "demos")
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"])
_CALL_ERRORS = (TypeError, AttributeError, NameError, KeyError, IndexError, AssertionError)


def _raised_by_the_plugin(err: BaseException) -> bool:
    """Whether an error in a fake step is the plugin's own bug rather than the model's.

    The frame that raised it decides: a frame of the plugin's code (its demos excepted: they are models) is ours. An
    error raised inside torch or the standard library belongs to the nearest caller outside them: ours only for the
    errors of a wrong call (a ``TypeError``, a missing attribute…) — torch's own refusals on fake tensors (a value
    read, an unsupported op) are the model's, whoever called into torch."""
    frames = [os.path.abspath(frame.filename) for frame in traceback.extract_tb(err.__traceback__)]

    def ours(path: str) -> bool:
        return path.startswith(_PLUGIN_DIR + os.sep) and not path.startswith(_DEMOS_DIR + os.sep)

    def library(path: str) -> bool:
        return path.startswith(_TORCH_DIR + os.sep) or path.startswith(_STDLIB_DIR + os.sep)

    if not frames:
        return False
    if ours(frames[-1]):
        return True
    caller = next((path for path in reversed(frames) if not library(path)), None)
    return caller is not None and ours(caller) and isinstance(err, _CALL_ERRORS)


@contextlib.contextmanager
def _fake_session(model: nn.Module, plan: Any, loss_fn: Callable[[Any], torch.Tensor], batch: Any,
                  context: Callable[[], Any]) -> Iterator[_FakeSession]:
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
            yield _FakeSession(mode, meter, params, loss_fn, batch, context)
    except PricingError:
        raise
    except Exception as err:
        if _raised_by_the_plugin(err):  # a bug of ours: falling back would hide it
            raise
        # the model's step could not run on fake tensors: the caller falls back
        raise PricingError(f"{type(err).__name__}: {err}") from err
    finally:
        plan.retarget(saved_policy)  # the policy, not only its modes: group:K regions come back too
        if saved_notes:
            plan.annotate(saved_notes)


@contextlib.contextmanager
def fake_steps(model: nn.Module, plan: Any, loss_fn: Callable[[Any], torch.Tensor], batch: Any,
               context: Callable[[], Any] = contextlib.nullcontext) -> Iterator[Tuple[Callable[[bool], int], Any]]:
    """Yield ``(step, meter)``: ``step(exact)`` runs ``loss_fn(batch)`` and its backward on fake tensors under the
    plan's current modes and returns the activation peak the meter counted (exactly); the parameters, buffers, plan
    modes and notes are put back on exit (see the module docstring). Arguments as :func:`price_shape`'s."""
    with _fake_session(model, plan, loss_fn, batch, context) as session:
        yield session.step, session.meter


def price_shape_by_stages(model: nn.Module, plan: Any, loss_fn: Callable[[Any], torch.Tensor], batch: Any,
                          modes: Sequence[str] = ("recompute", "selective"),
                          context: Callable[[], Any] = contextlib.nullcontext) -> ShapeCosts:
    """:func:`price_shape` the long way: the budget calibration's stages, each a whole-model step on fake tensors
    (five for ``recompute`` and ``selective``), every block measured in every mode where it runs. The reference the
    fast pricing is tested against, and the fallback nothing needs today; arguments and result as
    :func:`price_shape`'s (:attr:`ShapeCosts.traced` holds every stage's plan)."""
    measured = tuple(m for m in modes if m in ("recompute", "selective"))
    with fake_steps(model, plan, loss_fn, batch, context) as (step, meter):
        calibration = BudgetCalibration(plan, meter, 0, apply=plan.set_modes, modes=measured, times=False,
                                        choose=False)
        try:
            calibration.run(step)
        finally:  # its hooks never outlive the pricing, even when the step fails on fake tensors
            calibration.close()
        return ShapeCosts(tuple(calibration.costs()), calibration.base, dict(calibration.measured_plans))


def price_shape(model: nn.Module, plan: Any, loss_fn: Callable[[Any], torch.Tensor], batch: Any,
                modes: Sequence[str] = ("recompute", "selective"),
                context: Callable[[], Any] = contextlib.nullcontext) -> ShapeCosts:
    """Measure per-block bytes for ``batch`` (already of the shape to price) on fake tensors.

    One whole-model step, every block ``off`` but the last, which runs the last of ``modes``: each block's input
    and interior where it runs, the peak after the blocks' forward and the backward's peak apart (the bases: what the
    blocks do not explain, with a replay in the backward), and every block's input. Then the last block of each
    kind (:func:`_kinds`) alone in each mode: what it keeps and what its replay creates, which the other blocks of
    its kind take (they are alike). A whole-model fake step is about a trace's cost (Python dispatch per operator,
    growing with the layers), a block alone a few hundredths of a second; the calibration's five stages
    (:func:`price_shape_by_stages`) cost five whole-model steps.

    Blocks of several kinds (not one class with the same parameters: an encoder-decoder, a T5's first block with
    its position table) are priced by the stages: their bytes are not additive across kinds (a T5's forward base
    moves by 0.6 MiB with the mode of its last encoder block, which one step cannot see).

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
        The per-block bytes, the bases, and the activation peak traced for the plan the whole-model step ran
        (:attr:`ShapeCosts.traced`; :func:`trace_plans` traces others).

    Raises:
        PricingError: the model cannot be traced on fake tensors (see the module docstring).
    """
    if len({_parameters(block) for block in plan.blocks}) > 1:
        return price_shape_by_stages(model, plan, loss_fn, batch, modes, context)
    measured = tuple(m for m in modes if m in ("recompute", "selective"))
    n = plan.num_blocks
    # every block off but the last, in the last mode: the blocks' interiors where they run, and replays in backward
    every = ("off",) * (n - 1) + (measured[-1] if measured else "off",)
    with _fake_session(model, plan, loss_fn, batch, context) as session:
        calibration = BudgetCalibration(plan, session.meter, 0, apply=plan.set_modes, modes=measured, times=False,
                                        choose=False)
        inputs: Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]] = {}
        capture = [block.register_forward_pre_hook(_capturer(inputs, i), with_kwargs=True)
                   for i, block in enumerate(plan.blocks)]
        try:
            calibration.stages = [("off", every, "bytes")]  # the whole-model step
            calibration.begin_step()
            forward, backward, peak = session.split_step(plan.blocks[-1])
            context = list(calibration.interior)  # the interiors where the blocks ran, before any runs alone
            for handle in capture:
                handle.remove()
            # then one block of each kind alone in each mode, each a stage of its own so that the calibration's
            # hooks measure it as they measure a stage
            kinds = _kinds(plan.blocks, inputs)
            alone = [(mode, i) for i in _one_per_kind(kinds) if i in inputs for mode in ("off", *measured)]
            calibration.stages += [(mode, tuple(mode if j == i else "off" for j in range(n)), "bytes")
                                   for mode, i in alone]
            calibration.stage = 1
            for _, i in alone:
                calibration.begin_step()
                calibration._calibration_peaks.clear()  # a block alone's peak says nothing of the bases
                calibration.end_step(session.block_step(plan.blocks[i], inputs[i]))
        finally:  # hooks never outlive the pricing, even when the step fails on fake tensors
            for handle in capture:
                handle.remove()
            calibration.close()
        costs = _alike(kinds, calibration.costs())
        # the interiors where the blocks ran off (the last one's alone, all it saves); the bases from them, raised by
        # what the first off block of a kind counts beyond the next ones (tensors made outside the blocks and saved
        # inside them: a Llama's rotary tables), which every block of the kind then carries
        costs = [dataclasses.replace(c, interior=context[i]) if every[i] == "off" else c for i, c in enumerate(costs)]
        base = _bases(costs, every, forward, backward)
        shared = _shared_bytes(kinds, costs, every)
        costs = _largest_interiors(kinds, costs)
        return ShapeCosts(tuple(costs), (base[0] + shared, base[1] + shared), {every: peak})


def _kinds(blocks: Sequence[nn.Module], inputs: Dict[int, Any]) -> List[Any]:
    """Each block's kind: blocks of one kind are alike (one class, the same parameters' shapes, inputs of the same
    shapes). A class alone is not enough: an encoder-decoder's encoder and decoder blocks are often one class (T5's
    ``T5Block``), with a cross-attention and other lengths in the decoder."""
    out = []
    for i, block in enumerate(blocks):
        leaves, spec = tree_flatten(inputs.get(i))
        call = tuple(v if isinstance(v, _TensorSpec) else type(v).__name__ for v in leaves), str(spec)
        out.append((_parameters(block), call))
    return out


def _parameters(block: nn.Module) -> Tuple[Any, ...]:
    """A block's class and its parameters' names, shapes and dtypes."""
    return type(block), tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())


def _one_per_kind(kinds: Sequence[Any]) -> List[int]:
    """The last block of each kind (the first carries the engine's phase hook; any member would do)."""
    return sorted({kind: i for i, kind in enumerate(kinds)}.values())


def _capturer(inputs: Dict[int, Any], index: int) -> Callable:
    def hook(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if index not in inputs and torch.is_grad_enabled():
            inputs[index] = tree_map(_spec, (args, kwargs))

    return hook


def _alike(kinds: Sequence[Any], costs: Sequence[BlockCost]) -> List[BlockCost]:
    """Every block takes the bytes measured on its kind's block alone where its own were not measured (the
    interiors were measured on every block, :func:`_largest_interiors`); what ``selective`` keeps holds the block's
    input, its own boundary."""
    out = []
    for kind, cost in zip(kinds, costs):
        fields = {}
        for name in ("selective_kept", "selective_replay", "recompute_replay"):
            source = next((c for k, c in zip(kinds, costs) if k == kind and getattr(c, name) is not None), None)
            if getattr(cost, name) is None and source is not None:
                fields[name] = getattr(source, name) - (source.boundary - cost.boundary) * (name == "selective_kept")
                if name == "selective_kept":  # its time (0 here: bytes only) makes the mode an option
                    fields["selective_s"] = source.selective_s
        out.append(dataclasses.replace(cost, **fields) if fields else cost)
    return out


def _largest_interiors(kinds: Sequence[Any], costs: Sequence[BlockCost]) -> List[BlockCost]:
    """Each block priced with the largest interior of its kind: tensors made outside the blocks and saved inside
    them are counted by whichever block first runs ``off``, which the plan decides; so every block carries them."""
    largest: Dict[Any, int] = {}
    for kind, cost in zip(kinds, costs):
        largest[kind] = max(largest.get(kind, 0), cost.interior)
    return [dataclasses.replace(c, interior=largest[k]) for k, c in zip(kinds, costs)]


def _shared_bytes(kinds: Sequence[Any], costs: Sequence[BlockCost], plan: Sequence[str]) -> int:
    """What the first ``off`` block of each kind counts beyond the others of its kind (tensors made outside them
    and saved inside): a plan with none of them ``off`` keeps those too (saved by a ``selective`` block, or alive),
    so the bases carry them: counted twice where a block is ``off``, never missing."""
    interiors: Dict[Any, List[int]] = {}
    for kind, cost, mode in zip(kinds, costs, plan):
        if mode == "off":
            interiors.setdefault(kind, []).append(cost.interior)
    return sum(max(v) - min(v) for v in interiors.values())


def _bases(costs: Sequence[BlockCost], plan: Sequence[str], forward: int, backward: int) -> Tuple[int, int]:
    """What the blocks do not explain in the forward's and the backward's peaks of one step of ``plan`` (the peak
    model of :mod:`lightning_ckpt.decide.budget`: ``max(base_f + kept, base_b + worst replay)``)."""
    prefix, transient = _prefix_and_transient(costs, plan)
    base_f = max(forward - prefix, 0)
    return base_f, max(backward - transient, 0) if transient else base_f


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
