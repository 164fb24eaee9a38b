"""The one live-tensor tracker: what the activation meter counts, on real tensors and on fake ones alike.

Two counters, each with a running peak, keyed by the identity of the memory they count:

- :class:`SavedBytes` — the bytes of tensors autograd saves for backward, seen through an outer
  ``saved_tensors_hooks``; a saved view counts as its base tensor, once, while that base is alive. This is the
  meter's per-step figure (:mod:`lightning_ckpt.measure.meter`).
- :class:`LiveBytes` — a ``TorchDispatchMode`` that follows every storage an operator creates while it is
  active, until it is freed: the replay interior of a checkpointed block, or the exact (per-op) figure.

Keys: a storage's data pointer; on fake and meta tensors, which have none (it reads 0), the storage object's
identity instead, so :mod:`lightning_ckpt.forecast.trace` runs this very code on a model built under
``FakeTensorMode`` to forecast what the meter will measure.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "SavedBytes", "exit_mode", "exit_saved_hooks", "storage_key", "storages"]


def storage_key(st: Any) -> int:
    """Identity of an untyped storage: its data pointer, or the storage object's identity when that is 0
    (fake, meta and empty storages)."""
    return st.data_ptr() or st._cdata


def storages(t: torch.Tensor):
    """The untyped storages behind ``t`` (several for a traceable wrapper subclass); empty when it has none."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        # DTensor lists its device mesh among the attributes (torch >= 2.10): only tensors have storages
        inner = (getattr(t, a) for a in attrs)
        return [s for x in inner if isinstance(x, torch.Tensor) for s in storages(x)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, meta without storage, ...
        return []


class _StorageRef(weakref.ref):
    """A weak reference to a counted tensor or storage that remembers its key and size."""

    __slots__ = ("alias", "copy", "key", "nbytes")


class SavedBytes:
    """Bytes of tensors saved for backward, one count per live base tensor, with the running peak.

    Installed as the outermost ``saved_tensors_hooks``; the only effect is bookkeeping. ``pack`` returns views and
    tensors without autograd history unchanged, and for a tensor with history a detached alias of it (the same
    storage; autograd puts the history back when it unpacks, as ``saved_tensors_hooks`` documents), one alias per
    tensor, reused by every save of it. Returned as it is, a saved *output* (``exp``, ``softmax``, a custom
    Function's ``ctx.save_for_backward(out)``) would hold its own autograd node, which holds it: a cycle through
    C++ that no ``gc`` sees and only running that node's backward breaks, so every graph that is never
    backpropagated — a forward that ran out of memory before its retry, a grad-enabled side computation for a log —
    would stay in memory for good. Such a tensor is counted until both it and its alias are dead, which is when it
    was uncounted before (the saved tensor kept it alive). A saved view is counted as its base tensor
    (``t._base``), which views keep alive: the base is counted once, when first saved, with its
    ``numel × element_size``, and uncounted by a weakref callback when it dies, i.e. when its memory is freed.
    Going through the base rather than ``untyped_storage()`` avoids creating a storage object per tensor
    (about 2.5 µs each); the two agree except for storages shared by unrelated tensors (``.data``, ``set_``).
    """

    def __init__(self, device: torch.device, static: frozenset) -> None:
        self.device = device
        self.static = static  # storage keys never counted (the watched model's buffers)
        self.tracked: Dict[int, _StorageRef] = {}
        self.live = 0
        self.peak = 0
        kind = device.type
        # one near-identical pack function per device kind, chosen once: the hook runs for every saved tensor,
        # so the device test is specialised here rather than branched on at each call
        self.pack = self._pack_cpu if kind == "cpu" else self._pack_cuda if kind == "cuda" else self._pack_any
        self.index = device.index if device.index is not None else 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)
        self.on_save: Optional[Callable[[int], None]] = None  # told each saved storage's key (attribution only)

    def _pack_cpu(self, t: torch.Tensor) -> torch.Tensor:
        root = t._base
        if root is None:
            root = t
        if type(root) is not torch.Tensor:
            return self._pack_unusual(t, root)
        ref = None
        if root.is_cpu:
            key = root.data_ptr()
            if key and key not in self.static:
                ref = self.tracked.get(key)
                if ref is None:
                    ref = self._add(root, key)
                if self.on_save is not None:
                    self.on_save(key)
        return self._held(t, ref) if t is root and t.requires_grad else t

    def _pack_cuda(self, t: torch.Tensor) -> torch.Tensor:
        root = t._base
        if root is None:
            root = t
        if type(root) is not torch.Tensor:
            return self._pack_unusual(t, root)
        ref = None
        if root.is_cuda and root.get_device() == self.index:
            key = root.data_ptr()
            if key and key not in self.static:
                ref = self.tracked.get(key)
                if ref is None:
                    ref = self._add(root, key)
                if self.on_save is not None:
                    self.on_save(key)
        return self._held(t, ref) if t is root and t.requires_grad else t

    def _pack_any(self, t: torch.Tensor) -> torch.Tensor:
        root = t._base
        if root is None:
            root = t
        if type(root) is not torch.Tensor:
            return self._pack_unusual(t, root)
        ref = None
        if root.device == self.device:
            key = root.data_ptr()
            if key and key not in self.static:
                ref = self.tracked.get(key)
                if ref is None:
                    ref = self._add(root, key)
                if self.on_save is not None:
                    self.on_save(key)
        return self._held(t, ref) if t is root and t.requires_grad else t

    def _held(self, t: torch.Tensor, ref: Optional[_StorageRef]) -> torch.Tensor:
        """What autograd keeps of ``t``, a tensor with history (not a view): its detached alias, one per tensor,
        followed with ``t``'s count (see the class docstring); a fresh one when ``t`` is not what is counted."""
        if ref is None or ref() is not t:
            return t.detach()
        alias = ref.alias() if ref.alias is not None else None
        if alias is None:
            alias = t.detach()
            held = _StorageRef(alias, self._freed)
            held.key, held.nbytes, held.alias = ref.key, 0, None
            ref.alias = held
        return alias

    def _pack_unusual(self, t: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """Parameters (never counted) and tensor subclasses (counted through their storages, whose lifetime a
        detached alias does not change)."""
        if isinstance(root, nn.Parameter) or isinstance(t, nn.Parameter):
            return t
        held = t.detach() if t.requires_grad and t._base is None else t  # no cycle with its node (class docstring)
        try:
            if root.device != self.device:
                return held
        except (RuntimeError, NotImplementedError):
            return held
        for st in storages(root):
            key = storage_key(st)
            if key not in self.tracked and key not in self.static:
                self._add(st, key, st.nbytes())
            if self.on_save is not None:
                self.on_save(key)
        return held

    def _add(self, obj, key: int, nbytes: Optional[int] = None) -> _StorageRef:
        ref = _StorageRef(obj, self._freed)
        ref.key, ref.alias = key, None
        ref.nbytes = n = obj.nbytes if nbytes is None else nbytes
        self.tracked[key] = ref
        self.live += n
        if self.live > self.peak:
            self.peak = self.live
        return ref

    def _freed(self, ref: _StorageRef) -> None:
        """A counted tensor or its alias died: uncount it once both are dead."""
        head = self.tracked.get(ref.key)
        if head is None or (head is not ref and head.alias is not ref):
            return
        if head() is None and (head.alias is None or head.alias() is None):
            del self.tracked[ref.key]
            self.live -= head.nbytes

    def note(self, level: int) -> None:
        if level > self.peak:
            self.peak = level


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages that operators create while this mode is active, with the running peaks.

    A storage counts when an operator returns it and none of the operator's inputs used it (views, in-place and
    ``out=`` results are not new memory), unless it is already counted or listed in ``skip``. It is uncounted
    when freed. ``gate()`` (optional) decides per operator whether its new storages count at all.

    Copies of parameters — what ``_to_copy`` returns for an ``nn.Parameter``: the low-precision weights autocast
    makes, held by its cache or saved for backward — are counted apart, in ``copies_live`` / ``copies_peak``;
    ``live`` / ``peak`` count everything else; ``total_peak`` is the running peak of the two together.
    """

    def __init__(self, device: torch.device, skip: Optional[Dict[int, Any]] = None,
                 gate: Optional[Callable[[], bool]] = None, log: Any = None) -> None:
        super().__init__()
        self.device = device
        self.skip = skip if skip is not None else {}
        self.gate = gate
        self.log = log  # an AllocationLog (lightning_ckpt.measure.attribution): told every storage's life
        self.tracked: Dict[int, _StorageRef] = {}
        self.live = self.peak = 0
        self.copies_live = self.copies_peak = 0
        self.total_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.gate is not None and not self.gate():
            return out
        outs, _ = tree_flatten(out)
        fresh = [t for t in outs if isinstance(t, torch.Tensor) and t.device == self.device]
        if not fresh:
            return out
        inputs, _ = tree_flatten((args, kwargs))
        used = {storage_key(st) for t in inputs if isinstance(t, torch.Tensor) for st in storages(t)}
        copy = func is _TO_COPY and isinstance(args[0], nn.Parameter)
        for t in fresh:
            for st in storages(t):
                key = storage_key(st)
                if key not in used and key not in self.tracked and key not in self.skip:
                    self._add(st, key, copy, func, t)
        return out

    def adopt(self, tensors) -> None:
        """Count tensors that exist already (the model state at the start of a step), until they are freed."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device == self.device:
                for st in storages(t):
                    key = storage_key(st)
                    if key not in self.tracked and key not in self.skip:
                        self._add(st, key, False)

    def reset_peak(self) -> None:
        """Start a new running peak from what is live now (a phase boundary)."""
        self.peak, self.copies_peak = self.live, self.copies_live
        self.total_peak = self.live + self.copies_live

    def _add(self, st, key: int, copy: bool, func: Any = None, tensor: Optional[torch.Tensor] = None) -> None:
        ref = _StorageRef(st, self._freed)
        ref.key, ref.copy = key, copy
        ref.nbytes = n = st.nbytes()
        self.tracked[key] = ref
        if self.log is not None and tensor is not None:
            self.log.alloc(key, n, copy, func, tensor)
        if copy:
            self.copies_live += n
            self.copies_peak = max(self.copies_peak, self.copies_live)
        elif self.live + n > self.peak:
            self.live += n
            self.peak = self.live
            if self.log is not None:
                self.log.mark("peak", self.live)
        else:
            self.live += n
        if self.live + self.copies_live > self.total_peak:
            self.total_peak = self.live + self.copies_live
            if self.log is not None:
                self.log.mark("total peak", self.total_peak)

    def _freed(self, ref: _StorageRef) -> None:
        if self.tracked.get(ref.key) is ref:
            if self.log is not None:
                self.log.free(ref.key)
            del self.tracked[ref.key]
            if ref.copy:
                self.copies_live -= ref.nbytes
            else:
                self.live -= ref.nbytes


_TO_COPY = torch.ops.aten._to_copy.default


def exit_mode(mode: TorchDispatchMode) -> None:
    try:
        mode.__exit__(None, None, None)
    except Exception as err:  # the mode stack was changed under us
        warnings.warn(f"lightning_ckpt: could not pop the exact-mode memory tracker ({err}).", RuntimeWarning,
                      stacklevel=3)


def exit_saved_hooks(saved: SavedBytes) -> None:
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is not None and top[0] != saved.pack:
        warnings.warn(
            "lightning_ckpt: other saved_tensors_hooks were pushed during the step and not popped; the activation "
            "meter's hooks could not be removed. Pop your hooks before the step ends.",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    saved.hooks.__exit__(None, None, None)


def _never_compiled() -> None:
    """The hooks run for every saved tensor and every operator, always eagerly. When ``torch.compile`` falls back
    to eager around a graph break, dynamo would try to compile every Python frame it meets, these included (and
    fail on their weak references and symbolic sizes); their code is marked to be skipped (no cost per call)."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # pragma: no cover - torch without dynamo
        return
    for cls in (SavedBytes, LiveBytes):
        for fn in vars(cls).values():
            if callable(fn) and hasattr(fn, "__code__"):
                skip_code(fn.__code__)
    for fn in (storage_key, storages):
        skip_code(fn.__code__)


_never_compiled()
