"""What is alive at a step's peak, tensor by tensor, in the model's own vocabulary. Pure torch (no Lightning).

The meter's exact steps (:mod:`lightning_ckpt.measure.meter`, ``exact=True``; the reference steps) follow every
storage an operator creates. Given ``attribute=`` (the blocks' paths) they also keep a log of it: for each storage,
the module that was running when it was made (its path in the model, ``model.layers.3.mlp.up_proj``, from global
module hooks: :class:`ModuleStack`), the operator (``aten.mm``), its shape and dtype, when it was freed, and whether
and by which module it was saved for backward. From that log (:class:`AllocationLog`) :func:`attribute` names every
storage alive at a moment of the step — the activation line's peak, the end of the forward, the whole memory's peak
(CPU) — with its **role**:

- ``kept``: saved for backward (a ``saved_tensors_hooks`` pack saw it) — attributed to the module that *saved* it,
  the one whose backward needs it (``input of fc1`` is kept by ``fc1``, wherever it was made);
- ``replay``: made while a checkpointed block was replayed in backward (its replay transient);
- ``copy``: a low-precision copy of a parameter made by autocast;
- ``temporary``: alive but neither kept nor a copy (the loss's float32 upcast, a kernel's scratch).

Each tensor is placed in the block whose path holds its module (``per_block``), or outside the blocks (embedding,
head, loss). Under ``torch.compile`` the reference steps run eagerly, so compiled runs get the eager attribution.

What it costs: the exact step's per-op work, plus a record per storage and two global module hooks, on exact steps
only; every other step is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["ROLES", "AllocationLog", "ModuleStack", "PeakAttribution", "PeakTensor", "attribute", "role_of"]

ROLES = ("kept", "replay", "copy", "temporary")


class ModuleStack:
    """The path of the innermost module running now, for one model (its ``named_modules`` paths, prefixed).

    Entered, it installs PyTorch's global forward pre- and post-hooks (``always_call``: an error inside a forward
    still pops); they run for every module of every model, and do nothing for modules not of this one.
    """

    def __init__(self, model: nn.Module, prefix: str = "") -> None:
        self.names = {id(m): (f"{prefix}.{name}" if prefix and name else name or prefix)
                      for name, m in model.named_modules()}
        self.stack: List[str] = []
        self._handles: list = []

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def _push(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.stack.append(name)

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is not None and self.stack and self.stack[-1] == name:
            self.stack.pop()

    def __enter__(self) -> "ModuleStack":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._push),
                         register_module_forward_hook(self._pop, always_call=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.stack = [], []


@dataclass
class _Record:
    """One storage's life in the log."""

    start: int
    nbytes: int
    copy: bool
    module: str
    op: str
    shape: Tuple[int, ...]
    dtype: str
    replay: bool
    end: Optional[int] = None
    saved_at: Optional[int] = None
    saved_by: Optional[str] = None
    phase: Optional[str] = None
    grad_mode: bool = True
    twin: Optional["_Record"] = None  # the activation line's record of the same storage (in the whole memory's log)
    key: int = 0
    state: Optional[str] = None  # a storage of the model state alive when the step started: its ledger line


class _Clock:
    """One event counter for the logs of a step, so that their events interleave in the order they happened."""

    def __init__(self) -> None:
        self.now = 0

    def tick(self) -> int:
        self.now += 1
        return self.now - 1


class AllocationLog:
    """Storages as they are made, saved and freed, in event order (see the module docstring).

    Args:
        modules: the :class:`ModuleStack` that says which module runs.
        replaying: ``replaying()`` is true while a checkpointed block is replayed in backward.
    """

    def __init__(self, modules: ModuleStack, replaying: Callable[[], bool] = lambda: False,
                 phase: Callable[[], Optional[str]] = lambda: None, clock: Optional[_Clock] = None,
                 partner: Optional["AllocationLog"] = None) -> None:
        self.modules, self.replaying, self.phase = modules, replaying, phase
        self.clock = clock if clock is not None else _Clock()
        self.partner = partner  # the whole memory's log: each of this log's records is linked to its own there
        self.live: Dict[int, _Record] = {}
        self.records: List[_Record] = []
        self.marks: Dict[str, Tuple[int, int, Optional[str]]] = {}  # label -> (event, value, phase)
        self.boundaries: List[Tuple[int, str]] = []  # (event, phase that starts there)

    @property
    def events(self) -> int:
        return self.clock.now

    def alloc(self, key: int, nbytes: int, copy: bool, func: Any, tensor: torch.Tensor) -> None:
        op = str(getattr(func, "_overloadpacket", func)).replace("aten::", "aten.").split(".default")[0]
        rec = _Record(self.clock.tick(), nbytes, copy, self.modules.current, op, tuple(tensor.shape),
                      str(tensor.dtype).replace("torch.", ""), self.replaying(), phase=self.phase(),
                      grad_mode=torch.is_grad_enabled(), key=key)
        self.live[key] = rec
        self.records.append(rec)
        other = self.partner.live.get(key) if self.partner is not None else None
        if other is not None:
            other.twin = rec

    def adopt(self, key: int, nbytes: int, line: str) -> None:
        """A storage of the model state alive when the step starts (``line``: ``parameters``, ``gradients``,
        ``optimizer state``), followed until it is freed (a ``zero_grad(set_to_none=True)`` frees the gradients)."""
        if key not in self.live:  # all at the step's first event: they were there before it
            rec = _Record(0, nbytes, False, "", "(state)", (), "", False, key=key, state=line)
            self.live[key] = rec
            self.records.append(rec)

    def free(self, key: int) -> None:
        rec = self.live.pop(key, None)
        if rec is not None:
            rec.end = self.clock.tick()

    def saved(self, key: int) -> None:
        """A pack hook saw the storage ``key`` (first save wins: the keeper)."""
        rec = self.live.get(key)
        if rec is not None and rec.saved_at is None:
            rec.saved_at, rec.saved_by = self.clock.tick(), self.modules.current

    def boundary(self, phase: str) -> None:
        """A phase starts now."""
        self.boundaries.append((self.events, phase))

    def mark(self, label: str, value: int = 0) -> None:
        """Remember this moment (the last event so far) under ``label``, with the step's phase; a later mark of the
        same label replaces it only at a value as high (a running peak restarted at a phase boundary keeps the
        step's highest)."""
        old = self.marks.get(label)
        if old is None or value >= old[1]:
            self.marks[label] = (self.events - 1, value, self.phase())

    def alive(self, at: int) -> List[_Record]:
        """The records alive at event ``at``."""
        return [r for r in self.records if r.start <= at and (r.end is None or r.end > at)]


@dataclass(frozen=True)
class PeakTensor:
    """One storage alive at a moment: who made it, who keeps it, what it is."""

    module: str
    op: str
    shape: Tuple[int, ...]
    dtype: str
    bytes: int
    role: str
    block: Optional[int]
    kept_by: Optional[str] = None

    def describe(self) -> str:
        """``'output of model.h.0.mlp.c_fc (aten.addmm), kept by model.h.0.mlp.act'``."""
        made = f"output of {self.module or '(outside any module)'} ({self.op})"
        return made + (f", kept by {self.kept_by}" if self.role == "kept" and self.kept_by else f", {self.role}")

    def as_dict(self) -> Dict[str, Any]:
        return {"module": self.module, "op": self.op, "shape": list(self.shape), "dtype": self.dtype,
                "bytes": self.bytes, "role": self.role, "block": self.block, "kept_by": self.kept_by}


@dataclass
class PeakAttribution:
    """The storages alive at one moment of a step, attributed (see the module docstring).

    Attributes:
        moment: ``"activation peak"``, ``"forward end"`` or ``"total peak"``.
        phase: the step's phase at that moment (``forward``, ``backward``, ``optimizer``).
        tensors: every storage alive then, largest first.
        per_block: bytes per block index; ``outside``: bytes of the rest (embedding, head, loss).
    """

    moment: str
    phase: str
    tensors: List[PeakTensor] = field(default_factory=list)
    per_block: Dict[int, int] = field(default_factory=dict)
    outside: int = 0

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    def by_role(self) -> Dict[str, int]:
        out = {role: 0 for role in ROLES}
        for t in self.tensors:
            out[t.role] += t.bytes
        return out

    def as_dict(self, top: int = 20) -> Dict[str, Any]:
        return {"moment": self.moment, "phase": self.phase, "bytes": self.bytes, "by_role": self.by_role(),
                "per_block": {str(k): v for k, v in sorted(self.per_block.items())}, "outside_blocks": self.outside,
                "tensors": [t.as_dict() for t in self.tensors[:top]]}


def _block_of(path: Optional[str], blocks: Sequence[str]) -> Optional[int]:
    if not path:
        return None
    for i, name in enumerate(blocks):
        if path == name or path.startswith(name + "."):
            return i
    return None


def role_of(r: _Record, at: int) -> str:
    """A record's role at event ``at``; a record of the whole memory's log takes its activation-line twin's."""
    src = r.twin if r.twin is not None else r
    if r.copy:
        return "copy"
    if src.saved_at is not None and src.saved_at <= at:
        return "kept"
    return "replay" if src.replay else "temporary"


def attribute(log: AllocationLog, at: int, moment: str, phase: str, blocks: Sequence[str] = (),
              copies: bool = True) -> PeakAttribution:
    """Name every storage alive at event ``at`` of ``log`` (roles, blocks: see the module docstring). ``blocks``
    are the blocks' paths in the model, in order; ``copies=False`` leaves autocast's copies out (the activation
    line never holds them: then the tensors add up to it)."""
    tensors = []
    for r in log.alive(at):
        if (r.copy and not copies) or r.state is not None:  # the model state is the ledger's, not a tensor here
            continue
        role = role_of(r, at)
        src = r.twin if r.twin is not None else r
        kept = role == "kept"
        owner = src.saved_by if kept else r.module
        tensors.append(PeakTensor(r.module, r.op, r.shape, r.dtype, r.nbytes, role, _block_of(owner, blocks),
                                  src.saved_by if kept else None))
    tensors.sort(key=lambda t: -t.bytes)
    result = PeakAttribution(moment, phase, tensors)
    for t in tensors:
        if t.block is None:
            result.outside += t.bytes
        else:
            result.per_block[t.block] = result.per_block.get(t.block, 0) + t.bytes
    return result
