"""The memory ledger of a training step: which line (parameters, gradients, optimizer state, activations, autocast
copies, other, allocator cache) holds the memory, and which one dominates. Pure torch (no Lightning).

The model-state lines come from walking the real objects, not from formulas:

- ``params``: every parameter once (tied or shared tensors deduplicated), ``numel × element_size``.
- ``grads``: every ``.grad`` that exists right now (``None`` grads cost nothing), including grads of master
  copies the optimizer updates.
- ``optimizer``: every tensor reachable from ``optimizer.state`` (moments, step counters, master copies kept in
  the state), broken down by dtype, plus *master copies held as the optimizer's own parameters* (the optimizer
  steps fp32 clones while the model holds low-precision weights). ``master`` is the part of ``optimizer`` that
  is master copies: state entries whose key names a master/fp32 copy of the parameter (``master_param``,
  ``fp32_param``, ...), and optimizer parameters that are not parameters of the model.

The step lines come from a :class:`~lightning_ckpt.measure.meter.StepReading`: ``activations`` (the activation
peak), ``autocast_copies`` (the low-precision copies of the weights autocast makes under mixed precision: held by
autocast's cache until the forward's autocast region exits, or saved for backward; a 7B model's are ~13 GB that
checkpointing cannot remove), ``peak_allocated``/``peak_reserved`` (CUDA only), and two derived lines on CUDA:

- ``other = peak_allocated − params − grads − optimizer − activations − autocast_copies``, floored at 0: kernel
  workspaces,
  activation gradients and other backward temporaries, the CUDA context's tensors, inputs. The lines above do
  not all peak at the same moment (gradients are often still absent when the activations peak), so the sum can
  exceed the peak; the floor then reports "nothing unexplained" rather than a negative amount.
- ``cache = peak_reserved − peak_allocated``: memory the caching allocator holds without a tensor in it.

On the CPU these two are ``None``: there is no allocator to read, and no figure is invented.

**Allocator lines not comparable.** Under CUDA graphs (``torch.compile(mode="reduce-overhead")``, ``"max-autotune"``,
``backend="cudagraphs"``) a step's tensors live in the graphs' private memory pools, allocated once and reused:
the allocator's peaks then count those pools, not the step, and do not move with the plan. A ledger built with an
``allocator_note`` (why) leaves every allocator-derived line out — ``peak_allocated``, ``peak_reserved``,
``other``, ``cache`` and the per-phase peaks are ``None``, so they are neither logged nor reported as if
comparable — and keeps the note (:attr:`Ledger.allocator_note`) for the report; the model-state lines and the
activation line (measured on eager reference steps) stay.

Example:
    >>> ledger = build_ledger(model, [optimizer], meter.stop_step(), capacity=device_capacity(device))
    >>> trainer.logger.log_metrics(ledger.as_metrics())
    >>> print(ledger.diagnosis())
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from lightning_ckpt.core.units import GiB, format_bytes
from lightning_ckpt.measure.meter import StepReading
from lightning_ckpt.measure.tracker import storage_key

__all__ = ["LEDGER_LINES", "Ledger", "ModelState", "ModelStateWalk", "build_ledger", "model_state_bytes"]

LEDGER_LINES = ("params", "grads", "optimizer", "activations", "autocast_copies", "other", "cache")
"""The lines of the ledger, in the order they are printed and logged."""

_MASTER_KEY = re.compile(r"master|fp32_?param|param_?fp32|full_precision|hp_param|high_precision", re.IGNORECASE)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds); any other tensor unchanged."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _key(t: torch.Tensor) -> Tuple[Any, ...]:
    """Identity of the memory a tensor covers: two tensors with the same key are counted once.

    Storage identity rather than the data pointer, so fake tensors (data pointer 0) are told apart too and the
    forecast (:mod:`lightning_ckpt.forecast.trace`) walks its fake model state with this very function.
    """
    try:
        return (t.device, storage_key(t.untyped_storage()), t.storage_offset(), t.numel(), t.dtype)
    except (RuntimeError, NotImplementedError, TypeError):  # no storage at all: identity only
        return ("id", id(t))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Tally:
    """Bytes of distinct tensors, by dtype."""

    def __init__(self, device: Optional[torch.device], seen: Optional[Set[Tuple[Any, ...]]] = None) -> None:
        self.device = device
        self.seen: Set[Tuple[Any, ...]] = seen if seen is not None else set()
        self.total = 0
        self.by_dtype: Dict[str, int] = {}

    def add(self, t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        t = _local(t)
        if self.device is not None and not _same_device(t.device, self.device):
            return 0
        k = _key(t)
        if k in self.seen:
            return 0
        self.seen.add(k)
        n = _nbytes(t)
        if n:
            self.total += n
            name = _dtype_name(t.dtype)
            self.by_dtype[name] = self.by_dtype.get(name, 0) + n
        return n


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _tensors(obj: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """(key path, tensor) for every tensor inside nested dicts/lists/tuples."""
    if isinstance(obj, torch.Tensor):
        yield "", obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            for path, t in _tensors(v):
                yield (f"{k}.{path}" if path else str(k)), t
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            for path, t in _tensors(v):
                yield (f"{i}.{path}" if path else str(i)), t


@dataclass(frozen=True)
class ModelState:
    """Bytes held by the model and its optimizers, measured by walking the real tensors.

    Attributes:
        params: distinct parameter bytes.
        params_by_dtype: ``params`` per dtype name (``"bfloat16"``, ``"float32"``, ...).
        grads: bytes of the ``.grad`` tensors that exist (model parameters and optimizer-held master copies).
        grads_by_dtype: ``grads`` per dtype name.
        optimizer: every optimizer-held byte: the state walk plus master copies held as optimizer parameters.
        optimizer_by_dtype: ``optimizer`` per dtype name.
        master: the part of ``optimizer`` that is master copies of the parameters.
        master_by_dtype: ``master`` per dtype name.
    """

    params: int = 0
    params_by_dtype: Dict[str, int] = field(default_factory=dict)
    grads: int = 0
    grads_by_dtype: Dict[str, int] = field(default_factory=dict)
    optimizer: int = 0
    optimizer_by_dtype: Dict[str, int] = field(default_factory=dict)
    master: int = 0
    master_by_dtype: Dict[str, int] = field(default_factory=dict)


def _as_optimizers(optimizers: Any) -> Sequence[Any]:
    if optimizers is None:
        return []
    if hasattr(optimizers, "state") and hasattr(optimizers, "param_groups"):
        return [optimizers]
    return list(optimizers)


def state_tensors(model: nn.Module, optimizers: Union[Any, Iterable[Any], None] = ()) -> Iterator[torch.Tensor]:
    """Every tensor of the model state: parameters, their gradients, the optimizer's own parameters (master copies)
    and their gradients, and every tensor of the optimizer state (a DTensor as its local shard). Duplicates are
    possible; counting is the caller's (see :func:`model_state_bytes`)."""
    for p in model.parameters():
        yield _local(p)
        if p.grad is not None:
            yield _local(p.grad)
    for opt in _as_optimizers(optimizers):
        for group in getattr(opt, "param_groups", ()):
            for p in group.get("params", ()):
                if isinstance(p, torch.Tensor):
                    yield _local(p)
                    if p.grad is not None:
                        yield _local(p.grad)
        for state in getattr(opt, "state", {}).values():
            for _, t in _tensors(state):
                yield _local(t)


def model_state_bytes(
    model: nn.Module,
    optimizers: Union[Any, Iterable[Any], None] = (),
    device: Union[torch.device, str, None] = None,
) -> ModelState:
    """Walk parameters, gradients and optimizer state; see the module docstring for what each line holds.

    Args:
        model: the model whose parameters and gradients are counted.
        optimizers: a ``torch.optim.Optimizer`` (or anything with ``state`` and ``param_groups``, such as
            Lightning's ``LightningOptimizer``), or several.
        device: count only tensors on this device (e.g. the rank's GPU, leaving CPU-offloaded optimizer state
            and CPU step counters out); ``None`` counts every device.

    Returns:
        A :class:`ModelState`. Adam's moments appear only after its first ``step()`` (it allocates them lazily).
    """
    dev = torch.device(device) if device is not None else None
    params_t = _Tally(dev)
    grads_t = _Tally(dev)
    model_params = list(model.parameters())
    for p in model_params:
        params_t.add(p)
        grads_t.add(p.grad)
    model_param_keys = {_key(_local(p)) for p in model_params}

    opt_t = _Tally(dev, seen=set(params_t.seen))  # a state entry aliasing a parameter is not extra memory
    master_t = _Tally(dev)
    for opt in _as_optimizers(optimizers):
        for group in getattr(opt, "param_groups", ()):
            for p in group.get("params", ()):
                if isinstance(p, torch.Tensor) and _key(_local(p)) not in model_param_keys:
                    # the optimizer steps a tensor the model does not own: a master copy
                    if opt_t.add(p):
                        master_t.add(p)
                    grads_t.add(p.grad)
        for state in getattr(opt, "state", {}).values():
            for path, t in _tensors(state):
                if opt_t.add(t) and _MASTER_KEY.search(path):
                    master_t.add(t)
    return ModelState(
        params=params_t.total,
        params_by_dtype=params_t.by_dtype,
        grads=grads_t.total,
        grads_by_dtype=grads_t.by_dtype,
        optimizer=opt_t.total,
        optimizer_by_dtype=opt_t.by_dtype,
        master=master_t.total,
        master_by_dtype=master_t.by_dtype,
    )


class ModelStateWalk:
    """:func:`model_state_bytes` for a training run's ledgers, walked again only when the state's make-up changes.

    The walk reads every parameter, gradient and optimizer-state tensor's storage (about 4 ms of host time per
    ledger for a 12-block GPT with AdamW: most of a measured step's own cost); between two steps of a run the bytes
    almost never change. Each call first reads a signature in a fraction of that time: which parameters the model
    has, each gradient's presence, dtype and size, each optimizer's parameters and the number of state entries per
    parameter; the walk runs again when it differs (the first step, Adam's lazy state, a frozen layer thawed, a new
    optimizer, ``set_to_none`` gradients missing). A state tensor replaced in place by one of another size, with no
    entry added or removed, is not seen until then.

    Attributes:
        walks: how many full walks ran (the rest reused the last one).
    """

    def __init__(self) -> None:
        self._signature: Optional[Tuple[Any, ...]] = None
        self._state: Optional[ModelState] = None
        self.walks = 0

    def __call__(self, model: nn.Module, optimizers: Union[Any, Iterable[Any], None] = (),
                 device: Union[torch.device, str, None] = None) -> ModelState:
        optimizers = _as_optimizers(optimizers)
        signature = (str(device), _signature(model, optimizers))
        if self._state is None or signature != self._signature:
            self._state = model_state_bytes(model, optimizers, device=device)
            self._signature = signature
            self.walks += 1
        return self._state


def _signature(model: nn.Module, optimizers: Sequence[Any]) -> Tuple[Any, ...]:
    """What decides :func:`model_state_bytes` short of reading storages (see :class:`ModelStateWalk`)."""
    params = tuple(model.parameters())
    grads = tuple(None if p.grad is None else (p.grad.dtype, p.grad.shape) for p in params)
    opts = tuple(
        (id(opt), tuple((id(p), p.dtype, p.grad is not None) for g in getattr(opt, "param_groups", ())
                        for p in g.get("params", ()) if isinstance(p, torch.Tensor)),
         tuple(len(v) if isinstance(v, Mapping) else 1 for v in getattr(opt, "state", {}).values()))
        for opt in optimizers)
    return tuple(map(id, params)), tuple(p.dtype for p in params), grads, opts


@dataclass(frozen=True)
class Ledger:
    """One step's memory ledger in bytes; ``None`` means "cannot be measured here" (e.g. allocator lines on CPU).

    Attributes:
        params, grads, optimizer: model-state lines (see :func:`model_state_bytes`).
        optimizer_by_dtype: the optimizer line per dtype name.
        master: the part of ``optimizer`` that is master copies of the parameters.
        activations: the step's activation peak (see :mod:`lightning_ckpt.measure.meter`); ``None`` if not measured.
        autocast_copies: peak bytes of the low-precision copies of parameters autocast made during the step (a
            line of its own: checkpointing cannot remove it); ``None`` when not measured.
        peak_allocated, peak_reserved: allocator peaks of the step (CUDA only).
        other: ``peak_allocated`` minus the four lines above, floored at 0 (CUDA only).
        cache: ``peak_reserved − peak_allocated`` (CUDA only).
        capacity: total device memory, when known.
        phase_peaks: peak bytes of the step's ``forward``, ``backward`` and ``optimizer`` phases (the whole
            memory: model state included), when measured.
        allocator_note: why the allocator-derived lines are left out (``None``: they are comparable); see the
            module docstring.
    """

    params: int
    grads: int
    optimizer: int
    optimizer_by_dtype: Dict[str, int] = field(default_factory=dict)
    master: int = 0
    activations: Optional[int] = None
    autocast_copies: Optional[int] = None
    peak_allocated: Optional[int] = None
    peak_reserved: Optional[int] = None
    other: Optional[int] = None
    cache: Optional[int] = None
    capacity: Optional[int] = None
    phase_peaks: Optional[Dict[str, int]] = None
    allocator_note: Optional[str] = None

    @property
    def allocator_comparable(self) -> bool:
        """Whether the allocator's lines mean this step's memory (not under CUDA graphs)."""
        return self.allocator_note is None

    def with_activations(self, activations: int) -> "Ledger":
        """This ledger with another activation figure (``other`` follows: the allocator's peak is unchanged)."""
        other = None
        if self.peak_allocated is not None:
            other = max(0, self.peak_allocated - self.params - self.grads - self.optimizer - activations
                        - (self.autocast_copies or 0))
        return dataclasses.replace(self, activations=activations, other=other)

    @property
    def peak_phase(self) -> Optional[str]:
        """The phase in which the step peaked (``None`` without phase peaks)."""
        if not self.phase_peaks:
            return None
        return max(self.phase_peaks, key=lambda name: self.phase_peaks[name])

    def phase_lines(self, phase: str) -> Dict[str, int]:
        """What is live at ``phase``'s peak, line by line: the model state's lines, then the activations (forward,
        backward; the replay transient and the gradients building are in these lines and the rest) or the
        optimizer step's ``temporaries`` (optimizer), and ``rest``: the phase peak minus the lines named."""
        peak = (self.phase_peaks or {}).get(phase)
        if peak is None:
            return {}
        lines = {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}
        if phase == "optimizer":
            lines["temporaries"] = max(peak - sum(lines.values()), 0)
        else:
            lines["activations"] = (self.activations or 0) + (self.autocast_copies or 0)
            lines["rest"] = max(peak - sum(lines.values()), 0)
        return lines

    def phase_dominant(self, phase: Optional[str] = None) -> Optional[str]:
        """The largest line at the peak of ``phase`` (default: the phase in which the step peaked)."""
        lines = self.phase_lines(phase or self.peak_phase or "")
        return max(lines, key=lines.get) if lines else None

    @property
    def model_state(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def headroom(self) -> Optional[int]:
        """``capacity − peak_reserved`` when both are known."""
        if self.capacity is None or self.peak_reserved is None:
            return None
        return self.capacity - self.peak_reserved

    def lines(self) -> Dict[str, int]:
        """The measured lines (``None`` ones left out), in :data:`LEDGER_LINES` order."""
        return {name: getattr(self, name) for name in LEDGER_LINES if getattr(self, name) is not None}

    def dominant(self) -> str:
        """The name of the largest line (ties go to the earlier line in :data:`LEDGER_LINES`)."""
        lines = self.lines()
        return max(lines, key=lambda name: (lines[name], -LEDGER_LINES.index(name)))

    def as_metrics(self, prefix: str = "memory") -> Dict[str, float]:
        """GiB floats keyed ``{prefix}/params_gib`` ... ; unmeasured (``None``) lines are left out.

        Keys: ``params_gib``, ``grads_gib``, ``optimizer_gib``, ``activations_gib``, ``autocast_copies_gib``,
        ``peak_allocated_gib``, ``peak_forward_gib``, ``peak_backward_gib``, ``peak_optimizer_gib``,
        ``peak_reserved_gib``, ``other_gib``, ``cache_gib``, and ``optimizer_master_gib`` (part of
        ``optimizer_gib``) only when master copies exist.
        """
        values = {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "autocast_copies": self.autocast_copies,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "other": self.other,
            "cache": self.cache,
            "optimizer_master": self.master or None,
            **{f"peak_{phase}": v for phase, v in (self.phase_peaks or {}).items()},
        }
        root = f"{prefix}/" if prefix else ""
        return {f"{root}{name}_gib": v / GiB for name, v in values.items() if v is not None}

    def diagnosis(self) -> str:
        """One paragraph: the dominant line and whether activation checkpointing is the remedy for it."""
        lines = self.lines()
        total = sum(lines.values())
        top = self.dominant()
        share = lines[top] / total if total else 0.0
        head = f"the {top} line dominates the ledger ({format_bytes(lines[top])}, {share:.0%} of {format_bytes(total)})"
        if self.capacity is not None and self.peak_reserved is not None:
            head += f"; peak reserved {format_bytes(self.peak_reserved)} of {format_bytes(self.capacity)}"
        advice = {
            "activations": "activation checkpointing (or a smaller micro-batch / shorter sequence) is the lever.",
            "params": "checkpointing cannot help: shard or quantize the weights, or use parameter-efficient "
                      "fine-tuning.",
            "grads": "checkpointing cannot help: shard gradients (FSDP/ZeRO), freeze layers, or accumulate in a "
                     "lower precision.",
            "optimizer": "checkpointing cannot help: use an optimizer with a smaller state (8-bit, factored), "
                         "shard or offload the state.",
            "autocast_copies": "checkpointing cannot remove these low-precision copies of the weights: train in "
                               "bf16-true, let FSDP's mixed precision hold bf16 parameters, or turn autocast's "
                               "weight cache off.",
            "other": "checkpointing will not fix this: look for large workspaces, materialized attention "
                     "scores, or activation gradients (profile the peak).",
            "cache": "the allocator holds unused blocks: fragmentation; try "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before changing the model.",
        }[top]
        return f"{head}: {advice}"

    def __str__(self) -> str:
        rows = [f"{name:<12} {format_bytes(v):>12}" for name, v in self.lines().items()]
        if self.master:
            rows.append(f"{'  (master)':<12} {format_bytes(self.master):>12}")
        for name in ("peak_allocated", "peak_reserved", "capacity"):
            v = getattr(self, name)
            if v is not None:
                rows.append(f"{name:<12} {format_bytes(v):>12}")
        return "\n".join(rows)


def build_ledger(
    model: nn.Module,
    optimizers: Union[Any, Iterable[Any], None],
    reading: Optional[StepReading],
    capacity: Optional[int] = None,
    device: Union[torch.device, str, None] = None,
    allocator_note: Optional[str] = None,
    state: Optional[ModelState] = None,
) -> Ledger:
    """Combine the model state (walked now, unless given) with a step's reading into a :class:`Ledger`.

    Args:
        model: the model; its parameters and gradients are walked now (call it after backward and before
            ``zero_grad`` to see the gradients).
        optimizers: the optimizer(s); see :func:`model_state_bytes`.
        reading: the step's :class:`~lightning_ckpt.measure.meter.StepReading`, or ``None`` (model state only).
        capacity: total device memory in bytes (:func:`~lightning_ckpt.measure.meter.device_capacity`), if known.
        device: restrict the model-state walk to this device; ``None`` counts every device.
        allocator_note: why the allocator's lines are not comparable (CUDA graphs): they are left out (see the
            module docstring); ``None`` keeps them.
        state: the model state already walked (a :class:`ModelStateWalk`'s); ``None`` walks it now.
    """
    if state is None:
        state = model_state_bytes(model, optimizers, device=device)
    activations = reading.activations if reading is not None else None
    copies = reading.autocast_copies if reading is not None else None
    comparable = reading is not None and allocator_note is None
    peak_allocated = reading.peak_allocated if comparable else None
    peak_reserved = reading.peak_reserved if comparable else None
    phase_peaks = reading.phase_peaks if comparable else None
    other = cache = None
    if peak_allocated is not None and activations is not None:
        other = max(0, peak_allocated - state.params - state.grads - state.optimizer - activations - (copies or 0))
    if peak_allocated is not None and peak_reserved is not None:
        cache = peak_reserved - peak_allocated
    return Ledger(
        params=state.params,
        grads=state.grads,
        optimizer=state.optimizer,
        optimizer_by_dtype=dict(state.optimizer_by_dtype),
        master=state.master,
        activations=activations,
        autocast_copies=copies,
        peak_allocated=peak_allocated,
        peak_reserved=peak_reserved,
        other=other,
        cache=cache,
        capacity=capacity,
        phase_peaks=phase_peaks,
        allocator_note=allocator_note,
    )
