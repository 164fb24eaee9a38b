"""The memory ledger of a training step: which line (parameters, gradients, optimizer state, activations, autocast
copies, other, allocator cache) holds the memory, and which one dominates. Pure torch (no Lightning).

The model-state lines come from walking the real objects, not from formulas, and count storage, not appearance:
a tensor is the bytes of the storages it holds, each storage once (tied or shared tensors, views, a code map shared
by several states). A tensor subclass is unwrapped to its inner tensors, recursively: a DTensor to its local shard,
torchao's 8-bit, 4-bit and float8 optimizer states to their codes, scales and code map (their ``dtype`` says
float32; their storage is uint8 codes), torchao's ``NF4Tensor`` weights to their packed data and scalers.
bitsandbytes' quantised weights (``Params4bit``, ``Int8Params``) are plain tensors of packed codes with their
quantisation state (absmax, code map, nested statistics) attached as attributes: counted with them.

- ``params``: every parameter.
- ``grads``: every ``.grad`` that exists right now (``None`` grads cost nothing: frozen parameters have none),
  including grads of master copies the optimizer updates.
- ``optimizer``: every tensor reachable from the optimizers' state (moments, step counters, master copies kept in
  the state), broken down by the dtype of the storage (``uint8`` codes and ``float32`` scales for an 8-bit state),
  plus *master copies held as the optimizer's own parameters* (the optimizer steps fp32 clones while the model
  holds low-precision weights). ``master`` is the part of ``optimizer`` that is master copies: state entries whose
  key names a master/fp32 copy of the parameter (``master_param``, ``fp32_param``, ...), and optimizer parameters
  that are not parameters of the model. Several optimizers (a list, a Muon + AdamW pair) are summed; an optimizer
  that holds others (torchao's ``CPUOffloadOptimizer``) is walked through them. Frozen parameters get no state
  (optimizers create it at the first step with a gradient).
- ``host``: on an accelerator, the model state kept in host memory (optimizer offload: torchao's
  ``CPUOffloadOptimizer`` keeps a host copy of each weight, its gradient and the whole optimizer state there, and
  Adam's step counters are host scalars): a line of its own, never on the device lines.
- ``paged``: the part of ``optimizer`` in CUDA managed memory (bitsandbytes' paged optimizers, ``PagedAdamW8bit``
  ...: state tensors over 100k elements). The driver pages it between the device and the host, and the caching
  allocator does not see it: ``peak_allocated`` leaves it out (so ``other`` does not subtract it), and the
  ledger's :attr:`~Ledger.notes` say so.

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
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lightning_ckpt.core.units import GiB, format_bytes
from lightning_ckpt.measure.meter import StepReading
from lightning_ckpt.measure.tracker import storage_key

__all__ = ["LEDGER_LINES", "Ledger", "ModelState", "ModelStateWalk", "build_ledger", "model_state_bytes"]

LEDGER_LINES = ("params", "grads", "optimizer", "activations", "autocast_copies", "other", "cache")
"""The lines of the ledger, in the order they are printed and logged."""

_COMPRESSED = re.compile(r"u?int[48]$|float8|float4")
_HOST_WORTH_NAMING = 1 << 20  # below this the host line is Adam's step counters and the like, not an offload

_MASTER_KEY = re.compile(r"master|fp32_?param|param_?fp32|full_precision|hp_param|high_precision", re.IGNORECASE)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds); any other tensor unchanged."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


# bitsandbytes keeps a quantised weight's metadata on the parameter object: ``Params4bit.quant_state`` (absmax,
# code map, nested statistics), ``Int8Params.SCB`` (row scales). Named, not discovered: other libraries hang
# unrelated tensors on parameters (hooks' buffers, FSDP1 bookkeeping) that are not this parameter's storage.
_ATTACHED = ("quant_state", "SCB")
_PLAIN = (torch.Tensor, nn.Parameter)


def _attached(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside a quantisation-state object (bitsandbytes' ``QuantState``, its nested ``state2``)."""
    if isinstance(obj, torch.Tensor):
        yield from _leaves(obj)
    elif obj is not None and depth < 3 and hasattr(obj, "__dict__") and not isinstance(obj, (type, nn.Module)):
        for value in vars(obj).values():
            yield from _attached(value, depth + 1)


def _leaves(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors whose storages hold ``t``: a traceable wrapper subclass (DTensor, torchao's quantised
    optimizer states and NF4 weights) unwrapped to its inner tensors, recursively, with the quantisation state
    bitsandbytes attaches to its weights."""
    if type(t) in _PLAIN:  # the common case, without the attribute look-ups below
        yield t
        return
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for name in attrs:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # DTensor also lists its device mesh (torch >= 2.10)
                yield from _leaves(inner)
        return
    yield t
    for name in _ATTACHED:
        yield from _attached(getattr(t, name, None))


def _where(leaf: torch.Tensor) -> torch.device:
    """The device whose memory holds ``leaf``. bitsandbytes' paged tensors are CPU tensors over CUDA managed memory
    (``torch.frombuffer`` of a managed pointer) that live on the GPU ``page_deviceid`` until the driver pages them."""
    if getattr(leaf, "is_paged", False) and getattr(leaf, "page_deviceid", None) is not None:
        return torch.device("cuda", leaf.page_deviceid)
    return leaf.device


def _storage(leaf: torch.Tensor) -> Tuple[Tuple[Any, ...], int]:
    """``(key, bytes)`` of the storage behind a plain tensor: the whole storage (a view holds all of it), keyed by
    its identity on its device so that fake tensors (data pointer 0) are told apart too and the forecast
    (:mod:`lightning_ckpt.forecast.trace`) walks its fake model state with this very function. A tensor without a
    storage (sparse, nested) is its own elements."""
    try:
        st = leaf.untyped_storage()
        return (leaf.device.type, leaf.device.index, storage_key(st)), st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return ("id", id(leaf)), leaf.numel() * leaf.element_size()


def _keys(t: torch.Tensor) -> Set[Tuple[Any, ...]]:
    return {_storage(leaf)[0] for leaf in _leaves(t)}


class _Tally:
    """Bytes of distinct storages, by dtype, on one device (``None``: every device).

    With a ``host`` tally, storages in host memory (the device being an accelerator) go there instead of being
    left out: optimizer offload's host line.
    """

    def __init__(self, device: Optional[torch.device], seen: Optional[Set[Tuple[Any, ...]]] = None,
                 host: Optional["_Tally"] = None) -> None:
        self.device = device
        self.seen: Set[Tuple[Any, ...]] = seen if seen is not None else set()
        self.host = host
        self.total = 0
        self.paged = 0
        self.by_dtype: Dict[str, int] = {}

    def add(self, t: Any) -> int:
        """Count ``t``'s storages not counted yet; returns the bytes added to this line."""
        if not isinstance(t, torch.Tensor):
            return 0
        added = 0
        for leaf in _leaves(t):
            where = _where(leaf)
            if self.device is None or _same_device(where, self.device):
                added += self._count(leaf)
            elif self.host is not None and where.type == "cpu":
                self.host.add(leaf)
        return added

    def _count(self, leaf: torch.Tensor) -> int:
        key, n = _storage(leaf)
        if key in self.seen:
            return 0
        self.seen.add(key)
        if n:
            self.total += n
            name = _dtype_name(leaf.dtype)
            self.by_dtype[name] = self.by_dtype.get(name, 0) + n
            if getattr(leaf, "is_paged", False):
                self.paged += n
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
    """Bytes held by the model and its optimizers, measured by walking the real storages.

    Attributes:
        params: distinct parameter bytes.
        params_by_dtype: ``params`` per storage dtype name (``"bfloat16"``, ``"uint8"`` for packed 4-bit, ...).
        grads: bytes of the ``.grad`` tensors that exist (model parameters and optimizer-held master copies).
        grads_by_dtype: ``grads`` per dtype name.
        optimizer: every optimizer-held byte: the state walk plus master copies held as optimizer parameters.
        optimizer_by_dtype: ``optimizer`` per storage dtype name.
        master: the part of ``optimizer`` that is master copies of the parameters.
        master_by_dtype: ``master`` per dtype name.
        host: model state in host memory while the device is an accelerator (optimizer offload), on no other line.
        paged: the part of ``optimizer`` in CUDA managed memory (bitsandbytes' paged optimizers).
        notes: what the lines cannot say by themselves (a paged optimizer's memory is invisible to the allocator).
    """

    params: int = 0
    params_by_dtype: Dict[str, int] = field(default_factory=dict)
    grads: int = 0
    grads_by_dtype: Dict[str, int] = field(default_factory=dict)
    optimizer: int = 0
    optimizer_by_dtype: Dict[str, int] = field(default_factory=dict)
    master: int = 0
    master_by_dtype: Dict[str, int] = field(default_factory=dict)
    host: int = 0
    paged: int = 0
    notes: Tuple[str, ...] = ()


# An optimizer that steps others: torchao's CPUOffloadOptimizer holds one per offloaded weight (``optim_dict``)
# and one for the small weights it keeps on the device (``d_opt``); its own ``state`` does not exist.
_INNER_OPTIMIZERS = ("optim_dict", "d_opt")


def _as_optimizers(optimizers: Any) -> Sequence[Any]:
    """Every optimizer to walk, once: the given ones and the optimizers they hold."""
    if optimizers is None:
        return []
    given = [optimizers] if hasattr(optimizers, "param_groups") else list(optimizers)
    out: list = []
    seen: Set[int] = set()

    def visit(opt: Any) -> None:
        if opt is None or id(opt) in seen:
            return
        seen.add(id(opt))
        out.append(opt)
        for name in _INNER_OPTIMIZERS:
            inner = getattr(opt, name, None)
            for sub in inner.values() if isinstance(inner, Mapping) else [inner]:
                if hasattr(sub, "param_groups"):
                    visit(sub)

    for opt in given:
        visit(opt)
    return out


def _paged_note(optimizers: Sequence[Any]) -> Tuple[str, ...]:
    names = sorted({type(opt).__name__ for opt in optimizers if getattr(opt, "is_paged", False) is True})
    if not names:
        return ()
    return (f"{', '.join(names)} is a paged optimizer: on CUDA its larger state tensors live in managed memory, "
            "which the allocator's peaks do not count and the driver may move to host memory under pressure; "
            "the optimizer line counts them, peak allocated and reserved do not.",)


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
        device: count the device lines on this device (the rank's GPU); on an accelerator, what is in host memory
            goes to the ``host`` line and other devices' tensors are left out. ``None`` counts every device on
            the device lines (no host line).

    Returns:
        A :class:`ModelState`. Adam's moments appear only after its first ``step()`` (it allocates them lazily).
    """
    dev = torch.device(device) if device is not None else None
    host = _Tally(None) if dev is not None and dev.type != "cpu" else None
    params_t = _Tally(dev, host=host)
    grads_t = _Tally(dev, host=host)
    model_params = list(model.parameters())
    for p in model_params:
        params_t.add(p)
    model_keys = params_t.seen | (host.seen if host is not None else set())  # only parameters counted so far
    for p in model_params:
        grads_t.add(p.grad)
    model_ids = {id(p) for p in model_params}

    optimizers = _as_optimizers(optimizers)
    opt_t = _Tally(dev, seen=set(params_t.seen), host=host)  # a state entry aliasing a parameter is not extra memory
    master_t = _Tally(dev)
    for opt in optimizers:
        for group in getattr(opt, "param_groups", ()):
            for p in group.get("params", ()):
                if isinstance(p, torch.Tensor) and id(p) not in model_ids and not _keys(p) <= model_keys:
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
        host=host.total if host is not None else 0,
        paged=opt_t.paged,
        notes=_paged_note(optimizers),
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
        host: model state in host memory (optimizer offload): not on any device line (see the module docstring).
        paged: the part of ``optimizer`` in CUDA managed memory, which ``peak_allocated`` does not count.
        notes: what the lines cannot say by themselves (:attr:`ModelState.notes`); the diagnosis repeats them.
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
    host: int = 0
    paged: int = 0
    notes: Tuple[str, ...] = ()

    @property
    def allocator_comparable(self) -> bool:
        """Whether the allocator's lines mean this step's memory (not under CUDA graphs)."""
        return self.allocator_note is None

    def with_activations(self, activations: int) -> "Ledger":
        """This ledger with another activation figure (``other`` follows: the allocator's peak is unchanged)."""
        other = None
        if self.peak_allocated is not None:
            other = _other(self.peak_allocated, self.params, self.grads, self.optimizer - self.paged, activations,
                           self.autocast_copies)
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
        ``peak_reserved_gib``, ``other_gib``, ``cache_gib``, ``optimizer_master_gib`` (part of
        ``optimizer_gib``) only when master copies exist, and ``host_gib`` only when model state is in host
        memory.
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
            "host": self.host or None,
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
        if top == "optimizer" and self.compressed_state:
            advice = ("checkpointing cannot help, and the state is already compressed (8 bits or fewer per value): "
                      "shard the state (FSDP/ZeRO), offload it to host memory, or train fewer parameters (LoRA).")
        tail = ""
        if self.host >= _HOST_WORTH_NAMING:
            tail = f" Host memory holds another {format_bytes(self.host)} of model state (offloaded), on no line above."
        return f"{head}: {advice}{tail}" + "".join(f" {note}" for note in self.notes)

    @property
    def compressed_state(self) -> bool:
        """Whether the optimizer state is stored in 8 bits or fewer per value (an 8-bit, 4-bit or float8 state)."""
        return any(_COMPRESSED.match(name) for name in self.optimizer_by_dtype)

    def __str__(self) -> str:
        rows = [f"{name:<12} {format_bytes(v):>12}" for name, v in self.lines().items()]
        if self.master:
            rows.append(f"{'  (master)':<12} {format_bytes(self.master):>12}")
        if self.host:
            rows.append(f"{'host':<12} {format_bytes(self.host):>12}")
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
        other = _other(peak_allocated, state.params, state.grads, state.optimizer - state.paged, activations, copies)
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
        host=state.host,
        paged=state.paged,
        notes=tuple(state.notes),
    )


def _other(peak_allocated: int, params: int, grads: int, allocated_optimizer: int, activations: int,
           copies: Optional[int]) -> int:
    """The allocator's peak less the lines it counts (a paged optimizer state is not among them), floored at 0."""
    return max(0, peak_allocated - params - grads - allocated_optimizer - activations - (copies or 0))
