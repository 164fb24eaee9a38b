"""Forecast a real model's training memory without allocating it: fake tensors, one traced step per policy.

``lightning-ckpt plan --model pkg.module:factory`` (and :func:`forecast_model`) builds the model under
``torch._subclasses.fake_tensor.FakeTensorMode``: every parameter, gradient, optimizer moment and activation is a
*fake tensor* with the real shape, dtype and device but no storage, so a 7-billion-parameter model is forecast on
a laptop in seconds. Then, per policy, the policy is applied with :func:`lightning_ckpt.core.wrap.apply_policy`
and one forward and backward is run on a fake batch under the activation meter itself
(:class:`lightning_ckpt.measure.meter.StepMeter` in exact mode, running the one tracker of
:mod:`lightning_ckpt.measure.tracker` on fake tensors): every tensor the forward creates, while it is alive
(temporaries such as the loss's float32 upcast included), parameters and buffers excluded, plus the live interior
of every checkpointed region while it is replayed in backward (the *replay transient*); autocast's low-precision
copies of the weights are their own line. ``precision`` (a Lightning name, see
:mod:`lightning_ckpt.forecast.precision`) runs the forward under the autocast that precision uses, or casts the
parameters. What is loaded and how the loss is found: :mod:`lightning_ckpt.forecast.load`.

**The step is traced as Lightning runs it, at steady state**: a first fake step creates the optimizer state and
leaves gradients; then, per policy, one step in Lightning's order — forward, ``zero_grad`` (Lightning calls it
between ``training_step`` and ``backward``), backward, ``optimizer.step()`` — is measured with the meter's phase
peaks (:meth:`~lightning_ckpt.measure.meter.StepMeter.phase`): everything live, the model state included, at the
peak of the forward, of the backward (gradients building while activations are freed, plus the replay transient)
and of the optimizer step (``foreach`` temporaries, measured from the optimizer torch really runs). ``peak`` is the
highest phase; the model-state lines (parameters, gradients, optimizer state, master copies) are walked by
:func:`lightning_ckpt.measure.ledger.model_state_bytes` from the tensors the optimizer actually created: exact, not
estimated.

**Device** (``device="cuda"``, the CLI's default when a capacity is given): the trace runs on the CPU under
:func:`lightning_ckpt.forecast.cuda.cuda_semantics`, which makes autograd save what CUDA kernels save (dropout
masks, the attention backend, autocast's op lists; every rule and its source are in that module). ``foreach``
follows torch's default for the device (on for CUDA) unless given.

Known limitations:
    - Code that reads tensor *values* (``.item()``, data-dependent shapes, ``if mask.all()``) cannot run on fake
      tensors; the error names the model and suggests the numbers route.
    - Kernel workspaces, allocator rounding and the CUDA context are not tensors and are not predicted
      (``peak = model state + activation peak``, as in the numbers route).
    - Modes that move saved tensors elsewhere (``offload``) are counted as the meter counts them.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_ckpt.core.policy import parse_policy
from lightning_ckpt.core.wrap import apply_policy, remove_checkpointing
from lightning_ckpt.decide.anatomy import model_anatomy
from lightning_ckpt.decide.pricing import hf_masks_as_on_real_tensors
from lightning_ckpt.forecast.load import (
    TORCH_OPTIMIZERS,
    build_model,
    lightning_step,
    make_batch,
    make_optimizers,
)
from lightning_ckpt.forecast.numbers import (
    DTYPE_BYTES,
    LedgerForecast,
    check_positions,
    crossing_line,
    phase_crossing,
)
from lightning_ckpt.forecast.precision import Precision, parse_precision
from lightning_ckpt.measure.ledger import model_state_bytes, state_tensors
from lightning_ckpt.measure.meter import StepMeter

__all__ = ["DEFAULT_POLICIES", "DEVICES", "ModelForecast", "cast_floating", "forecast_model", "parse_dtype"]

DEFAULT_POLICIES = ("none", "every:2", "group:sqrt", "all")
DEVICES = ("cpu", "cuda")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}


@dataclass(frozen=True)
class ModelForecast(LedgerForecast):
    """The ledger forecast for a real model; every figure in bytes. Same keys as
    :class:`lightning_ckpt.forecast.numbers.LedgerForecast` (``params`` … ``crosses``, ``inputs``), plus what the
    trace saw.

    Attributes (beyond the numbers forecast's):
        model: the target as given.
        num_params: parameters (elements).
        blocks: how many repeated blocks were found; ``block_class`` their class.
        replay_interior: per policy, the largest live interior of one replayed region (0 without replays).
        autocast_copies: per policy, the peak of autocast's low-precision copies of the weights (0 without
            autocast).
        precision: the Lightning precision name the step was traced in.
        trace_s: per policy, seconds the fake forward and backward took.
        device: whose kernels the trace reproduced (``"cpu"`` or ``"cuda"``).
        anatomy: per policy, what is alive at the traced step's peaks, named, in hidden-width units, with the
            findings (:func:`lightning_ckpt.decide.anatomy.anatomy`; the training report's ``peak`` section).
    """

    autocast_copies: Dict[str, int] = field(default_factory=dict)
    precision: str = "32-true"
    model: str = ""
    num_params: int = 0
    blocks: int = 0
    block_class: str = ""
    replay_interior: Dict[str, int] = field(default_factory=dict)
    trace_s: Dict[str, float] = field(default_factory=dict)
    device: str = "cpu"
    anatomy: Dict[str, Dict[str, Any]] = field(default_factory=dict)


def cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters and buffers in place, tied weights kept tied (``Module.to`` cannot swap fake
    parameters)."""
    memo: Dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            mod._parameters[name] = memo[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                mod._buffers[name] = b.to(dtype)


def parse_dtype(name: Optional[str], arg: str = "--param-dtype") -> Optional[torch.dtype]:
    """``"bf16"`` → ``torch.bfloat16`` (``None`` stays ``None``); a ``ValueError`` naming ``arg`` otherwise."""
    if name is None:
        return None
    key = name.lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"{arg}={name!r} is not a floating dtype torch can cast to; choose one of {sorted(_DTYPES)}.")
    return _DTYPES[key]


@contextlib.contextmanager
def _deepcopy_under_fake_mode() -> Iterator[None]:
    """``copy.deepcopy`` of a tensor works while the model is built under ``FakeTensorMode``.

    Torch's own ``Tensor.__deepcopy__`` there makes the copy's shell fake and then sets a storage on it: for a real
    tensor it refuses ("Attempted to set the storage of a tensor on device 'meta' to a storage on ... 'cpu'") and
    leaves the heap corrupt (the process dies at exit), and a fake tensor made by ``torch.tensor(0.0)`` carries its
    real value (``.constant``), so copying it copies a real tensor. A constructor meets it through torchmetrics,
    whose ``add_state`` deep-copies each default: any ``LightningModule`` with a metric attribute
    (``self.val_acc = Accuracy(...)``) failed to plan. Here a real tensor is copied with the fake mode switched
    off, and a fake tensor as a fake clone (no storage to set; what the trace reads of it, shape, dtype, device and
    ``requires_grad``, is the same).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = torch.Tensor.__deepcopy__

    def deepcopy(tensor: torch.Tensor, memo: dict) -> torch.Tensor:
        if not is_fake(tensor):
            with unset_fake_temporarily():
                return original(tensor, memo)
        if id(tensor) not in memo:
            memo[id(tensor)] = tensor.detach().clone().requires_grad_(tensor.requires_grad)
        return memo[id(tensor)]

    torch.Tensor.__deepcopy__ = deepcopy
    try:
        yield
    finally:
        torch.Tensor.__deepcopy__ = original


def forecast_model(
    target: Any,
    init_args: Optional[Dict[str, Any]] = None,
    *,
    micro_batch: int = 1,
    seq_len: int = 2048,
    policies: Sequence[str] = DEFAULT_POLICIES,
    param_dtype: Optional[str] = None,
    optimizer: Optional[str] = None,
    master_dtype: Optional[str] = None,
    capacity: Optional[int] = None,
    vocab_size: Optional[int] = None,
    blocks: Any = None,
    precision: str = "32-true",
    device: str = "cpu",
    sdpa_backend: str = "auto",
    foreach: Optional[bool] = None,
    gpu: Any = None,
    sdpa_log: Optional[list] = None,
) -> ModelForecast:
    """Forecast the ledger of ``target`` per policy without allocating it (see the module docstring).

    Args:
        target: an import path, a callable or a Hugging Face config (see
            :func:`lightning_ckpt.forecast.load.build_model`).
        init_args: keyword arguments for the target.
        micro_batch, seq_len: the batch shape traced.
        policies: policy strings; any policy :func:`~lightning_ckpt.core.wrap.apply_policy` accepts.
        param_dtype: cast floating parameters to this dtype (``"bf16"``); ``None`` keeps what the model builds.
        optimizer: one of :data:`~lightning_ckpt.forecast.load.TORCH_OPTIMIZERS`; ``None`` uses the module's
            ``configure_optimizers`` or AdamW.
        master_dtype: add a master copy of every trainable parameter in this dtype (what mixed-precision
            frameworks keep; torch optimizers keep none); ``None``/``"none"`` adds nothing.
        capacity: device capacity in bytes, for ``fits`` and ``crosses``.
        vocab_size: token id range of the synthetic batch (default: read from the model).
        blocks: block selector for :func:`~lightning_ckpt.core.blocks.find_blocks`.
        precision: a Lightning precision name (``"bf16-mixed"``, ``"bf16-true"``, ...; see
            :data:`lightning_ckpt.forecast.precision.PRECISIONS`).
        device: ``"cpu"`` or ``"cuda"``: whose kernels' saved tensors to reproduce (``"cuda"`` applies the rules of
            :mod:`lightning_ckpt.forecast.cuda`; the trace still runs on the CPU).
        sdpa_backend: with ``device="cuda"``: ``"auto"`` (the backend PyTorch would pick), ``"flash"``,
            ``"efficient"`` or ``"math"``.
        foreach: the optimizer's multi-tensor step (``None``: torch's default on ``device``, on for CUDA).
        gpu: with ``device="cuda"``: the :class:`~lightning_ckpt.forecast.sdpa.GpuTarget` whose attention backend
            to reproduce (``None``: :func:`~lightning_ckpt.forecast.sdpa.resolve_gpu`'s default).
        sdpa_log: a list that receives each traced attention call's
            :class:`~lightning_ckpt.forecast.sdpa.SdpaChoice`.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, value in (("--micro-batch", micro_batch), ("--seq-len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    policies = tuple(policies)
    if not policies:
        raise ValueError("--policies is empty; pass e.g. 'none,every:2,all'.")
    for p in policies:
        parse_policy(p)
    dtype = parse_dtype(param_dtype)
    mode = parse_precision(precision)
    if mode.param_dtype is not None:
        if dtype is not None and dtype != mode.param_dtype:
            raise ValueError(f"--param-dtype={param_dtype!r} contradicts --precision={precision!r}, which holds the "
                             f"parameters in {mode.param_dtype}; drop --param-dtype.")
        dtype = mode.param_dtype
    master_key = (master_dtype or "none").lower()
    if master_key not in DTYPE_BYTES:
        raise ValueError(f"--master-dtype={master_dtype!r} is not a known dtype; choose one of "
                         f"{sorted(set(DTYPE_BYTES))}.")
    if optimizer is not None and optimizer.lower() not in TORCH_OPTIMIZERS:
        raise ValueError(f"--optimizer={optimizer!r} cannot be built with --model; choose one of "
                         f"{list(TORCH_OPTIMIZERS)} (or omit it to use the module's configure_optimizers()).")
    if device not in DEVICES:
        raise ValueError(f"--device={device!r} is not a device the planner reproduces; choose one of {list(DEVICES)}.")
    label = target if isinstance(target, str) else getattr(target, "__qualname__", repr(target))

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fake, _deepcopy_under_fake_mode():
            model = build_model(target, init_args)
            if dtype is not None:
                cast_floating(model, dtype)
            model.train()
            batch = make_batch(model, micro_batch, seq_len, vocab_size)
        check_positions(model, seq_len)  # before tracing: past a learned position table the real step fails
        plan = apply_policy(model, "none", blocks)
    num_blocks, block_class = plan.num_blocks, type(plan.blocks[0]).__name__
    boundary = {"bytes": 0}

    def first_input(module, args, kwargs):
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if tensors and not boundary["bytes"]:
            boundary["bytes"] = tensors[0].numel() * tensors[0].element_size()

    hook = plan.blocks[0].register_forward_pre_hook(first_input, with_kwargs=True)
    activations: Dict[str, int] = {}
    copies: Dict[str, int] = {}
    interiors: Dict[str, int] = {}
    phases: Dict[str, Dict[str, int]] = {}
    times: Dict[str, float] = {}
    peaks: Dict[str, Dict[str, Any]] = {}
    semantics = _semantics(device, sdpa_backend, mode, gpu, sdpa_log)
    try:
        opts = make_optimizers(model, optimizer, foreach=_default_foreach(device, foreach))
        with warnings.catch_warnings(), fake, semantics():
            warnings.simplefilter("ignore")
            # a first step creates the optimizer state and leaves gradients, as every step after the first finds
            _trace_step(model, batch, label, "none", mode, opts)
            state = model_state_bytes(model, opts)
        for policy in policies:
            plan.retarget(policy)
            gc.collect()
            t0 = time.perf_counter()
            meter = StepMeter(next(model.parameters()).device, model=model)
            live = itertools.chain(state_tensors(model, opts),
                                   (t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with fake, semantics(), meter.step(exact=True, state=live, attribute=plan.names) as box:
                    _trace_step(model, batch, label, policy, mode, opts, meter)
            times[policy] = time.perf_counter() - t0
            activations[policy] = box.reading.activations
            copies[policy] = box.reading.autocast_copies or 0
            interiors[policy] = meter.largest_replay_interior
            phases[policy] = dict(box.reading.phase_peaks or {})
            if box.reading.attribution:
                peaks[policy] = model_anatomy(box.reading.attribution, model, micro_batch, seq_len, plan.names,
                                              plan.modes, mode.autocast_dtype, dtype, vocab_size)
    finally:
        hook.remove()
        remove_checkpointing(model)
    params, grads, master = state.params, state.grads, state.master
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # a master copy is what the optimizer steps: its moments take the master's dtype, as --master-dtype says from
    # numbers (torch's optimizers keep them in the dtype of the weights they step)
    moments = _moments_in(opts, DTYPE_BYTES[master_key]) if master_key != "none" else 0
    opt_bytes = state.optimizer - state.master + moments
    extra_master = n_trainable * DTYPE_BYTES[master_key]  # not held by a torch optimizer: alive in every phase
    master += extra_master
    total = params + grads + opt_bytes + master
    phases = {p: {name: v + extra_master + moments for name, v in by_phase.items()} for p, by_phase in phases.items()}
    peak = {p: max(by_phase.values()) for p, by_phase in phases.items()}
    fits = {p: None if capacity is None else v <= capacity for p, v in peak.items()}
    crosses = {p: phase_crossing(crossing_line(params, grads, opt_bytes, master, activations[p], capacity, copies[p]),
                                 phases[p], capacity) for p in policies}
    single = [v for p, v in interiors.items() if v and parse_policy(p).name != "group"]
    block_interior = interiors.get("all") or (min(single) if single else max(interiors.values(), default=0))
    inputs = dict(model=label, init_args=dict(init_args or {}), micro_batch=micro_batch, seq_len=seq_len,
                  policies=list(policies), param_dtype=param_dtype, optimizer=optimizer, master_dtype=master_dtype,
                  capacity=capacity, vocab_size=vocab_size, precision=mode.name, device=device,
                  sdpa_backend=sdpa_backend, foreach=foreach, gpu=None if gpu is None else gpu.describe())
    return ModelForecast(
        params=params, grads=grads, optimizer=opt_bytes, master=master, model_state=total,
        hidden_tensor=boundary["bytes"], boundary_all=boundary["bytes"] * num_blocks, block_interior=block_interior,
        activations=activations, peak=peak, capacity=capacity, fits=fits, crosses=crosses, inputs=inputs,
        phase_peaks=phases, model=label, num_params=sum(p.numel() for p in model.parameters()), blocks=num_blocks,
        block_class=block_class, replay_interior=interiors, trace_s=times, autocast_copies=copies,
        precision=mode.name, device=device, anatomy=peaks,
    )


def _moments_in(optimizers: Sequence[torch.optim.Optimizer], value_bytes: float) -> int:
    """Bytes the optimizers' moments gain when kept at ``value_bytes`` per value instead of their weights' dtype: every
    floating state tensor of a parameter in that parameter's dtype (step counters, single values, left alone)."""
    delta = 0
    for opt in optimizers:
        for param, entry in getattr(opt, "state", {}).items():
            for t in (v for v in getattr(entry, "values", lambda: ())() if isinstance(v, torch.Tensor)):
                if t.is_floating_point() and t.dtype == param.dtype and t.numel() > 1:
                    delta += round(t.numel() * (value_bytes - t.element_size()))
    return delta


def _default_foreach(device: str, foreach: Optional[bool]) -> Optional[bool]:
    """torch's optimizers default to ``foreach`` on CUDA only; the trace runs on CPU fake tensors, so say it."""
    if foreach is None and device == "cuda":
        return True
    return foreach


def _semantics(device: str, sdpa_backend: str, precision: Precision, gpu: Any = None,
               sdpa_log: Optional[list] = None) -> Callable[[], ContextManager]:
    """What the trace runs under so that autograd saves what ``device`` would save."""
    if device == "cpu":
        return hf_masks_as_on_real_tensors
    from lightning_ckpt.forecast.cuda import cuda_semantics

    @contextlib.contextmanager
    def semantics() -> Iterator[None]:
        with hf_masks_as_on_real_tensors(), cuda_semantics(sdpa_backend, precision.autocast_dtype, gpu, sdpa_log):
            yield

    return semantics


class _UpdateScalars(TorchDispatchMode):
    """Inside ``optimizer.step()`` a read of a tensor's value (``.item()``: Adafactor's step counter and the norms that
    scale its update) is answered with 1: such values set the update's size, not the memory it holds, and fake
    tensors have none to give. The model's own reads stay refused: they may steer shapes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            value = args[0]
            return True if value.dtype == torch.bool else 1.0 if value.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def _values_in_the_step(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Run each optimizer's ``step`` under :class:`_UpdateScalars` (once per optimizer)."""
    for opt in optimizers:
        if getattr(opt, "_lightning_ckpt_scalars", False):
            continue
        step = opt.step

        def scalar_step(*args, _step=step, **kwargs):
            with _UpdateScalars():
                return _step(*args, **kwargs)

        opt.step = scalar_step
        opt._lightning_ckpt_scalars = True


def _trace_step(model: nn.Module, batch: Any, label: str, policy: str, precision: Precision,
                optimizers: Sequence[torch.optim.Optimizer], meter: Optional[StepMeter] = None) -> None:
    """One fake training step in Lightning's order (:func:`~lightning_ckpt.forecast.load.lightning_step`);
    ``meter`` is told the phase boundaries. What fake tensors cannot run becomes a ``ValueError`` naming the
    model."""
    _values_in_the_step(optimizers)
    try:
        lightning_step(model, batch, optimizers, precision, "cpu", meter)
    except (ValueError, TypeError):
        raise
    except Exception as err:  # data-dependent code and other things fake tensors cannot run
        first = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(f"--model={label!r} could not be traced on fake tensors under policy {policy!r}: "
                         f"{type(err).__name__}: {first} — forecast it from numbers (--params ...) instead.") from None

