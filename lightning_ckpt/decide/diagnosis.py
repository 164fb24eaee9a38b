"""Out-of-memory diagnosis by phase: where a step died says which ledger line to suspect.

From the seed's "What to do on Monday morning":

- before a meaningful forward: parameters, inputs, initialization, or preallocated sharding state;
- forward / start of backward, peak scaling with depth or tokens: retained activations;
- backward despite checkpointing: attention workspaces and un-checkpointed kernels (or the replay transient);
- the **first** ``optimizer.step()``: lazy optimizer-state allocation;
- a later optimizer step: not the state itself (it exists already) — temporaries, fragmentation, or growth.

:class:`PhaseTracker` is a tiny state machine the callback advances from its hooks; :func:`diagnose` turns a
phase and the last measured ledger into the text attached to the re-raised error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional

from lightning_ckpt.core.units import GiB, format_bytes, unit_for

__all__ = ["METER_PHASE", "PHASES", "OutOfMemoryDiagnosis", "PhaseTracker", "diagnose", "is_out_of_memory",
           "phase_forecast"]

PHASES = ("before_forward", "forward", "backward", "first_optimizer_step", "optimizer_step")

_SUSPECTS: Dict[str, str] = {
    "before_forward": (
        "the step died before a meaningful forward pass: suspect parameters, inputs, initialization, or "
        "preallocated sharding state. Activation checkpointing cannot help here; reduce model state (lower "
        "precision, sharding, offload) or the input size."
    ),
    "forward": (
        "the step died in the forward pass: suspect retained activations, which grow with depth and with tokens "
        "(micro-batch × sequence length). Checkpoint more blocks (policy 'all', 'group:sqrt' or 'offload'), "
        "reduce the micro-batch and use gradient accumulation, or use a fused attention kernel."
    ),
    "backward": (
        "the step died in the backward pass: with few blocks checkpointed, suspect retained activations; with "
        "checkpointing on, suspect the replay transient of a large region (use smaller regions than 'group:K'), "
        "attention workspaces or un-checkpointed kernels, especially at long sequence lengths."
    ),
    "first_optimizer_step": (
        "the step died at the first optimizer.step(): suspect lazy optimizer-state allocation (Adam allocates "
        "two moments per parameter here). Checkpointing will not rescue this run: use an optimizer with a "
        "smaller state, parameter-efficient fine-tuning, sharding or optimizer offload."
    ),
    "optimizer_step": (
        "the step died in a later optimizer.step(): the optimizer state already existed, so suspect temporaries "
        "of the update, fragmentation (compare reserved with allocated), or memory that grows across steps."
    ),
}


_RAN_OUT = (
    "out of memory",
    "not enough memory",  # the CPU allocator raises a plain RuntimeError ("DefaultCPUAllocator: not enough memory")
    # libraries that allocate outside the caching allocator (cuBLAS creating its handle, cuDNN its plans) report:
    # CUBLAS_STATUS_ALLOC_FAILED, CUDNN_STATUS_ALLOC_FAILED, hipBLAS alike; cuDNN 9's
    # CUDNN_STATUS_INTERNAL_ERROR_{HOST,DEVICE}_ALLOCATION_FAILED. They are not sticky CUDA errors: once the cache is
    # emptied and the step checkpoints more, the same call usually succeeds, so they are retried like the rest.
    "_status_alloc_failed",
    "_allocation_failed",
)


def is_out_of_memory(error: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` and errors (CUDA, cuBLAS, cuDNN or the CPU) that say memory ran out."""
    import torch

    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    text = str(error).lower()
    return isinstance(error, oom_type) or any(words in text for words in _RAN_OUT)


@dataclass
class PhaseTracker:
    """Where the current training step is; advanced by the callback's hooks (no torch, no Lightning)."""

    phase: str = "before_forward"
    optimizer_steps: int = 0
    history: Dict[str, int] = field(default_factory=dict)

    def batch_start(self) -> None:
        self.phase = "before_forward"

    def forward_start(self) -> None:
        if self.phase == "before_forward":
            self.phase = "forward"

    def backward_start(self) -> None:
        self.phase = "backward"

    def optimizer_step_start(self) -> None:
        self.phase = "first_optimizer_step" if self.optimizer_steps == 0 else "optimizer_step"

    def optimizer_step_end(self) -> None:
        self.optimizer_steps += 1
        self.phase = "before_forward"

    def state_dict(self) -> Dict[str, int]:
        return {"optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.optimizer_steps = int(state.get("optimizer_steps", 0))


# the step phases the meter measures (``memory/peak_{phase}_gib``) for each phase an error can happen in
METER_PHASE = {"before_forward": "forward", "forward": "forward", "backward": "backward",
               "first_optimizer_step": "optimizer", "optimizer_step": "optimizer"}


def phase_forecast(phase: str, phase_peaks: Mapping[str, int], capacity: Optional[int]) -> Optional[str]:
    """What the last measured step's phase peaks (bytes) say about an error in ``phase``: which phase's peak
    crosses capacity, or how close the dying phase came (``None`` without phase peaks)."""
    if not phase_peaks:
        return None
    own = METER_PHASE[phase]
    shown = ", ".join(f"{name} {format_bytes(v)}" + (f" ({v / capacity:.0%})" if capacity else "")
                      for name, v in phase_peaks.items())
    text = f"Phase peaks of the last measured step: {shown}."
    if capacity:
        crossing = [name for name, v in phase_peaks.items() if v > capacity]
        if crossing:
            text += f" The {' and '.join(crossing)} peak crossed capacity"
            text += "." if own in crossing else f"; this error came in the {own} phase, which had fit."
        elif own in phase_peaks:
            margin = format_bytes(capacity - phase_peaks[own])
            text += (f" No phase had crossed capacity: the {own} phase peaked {margin} below it, so this step "
                     "was larger (longer sequence, new plan) or memory grew (fragmentation, a leak).")
    return text


def diagnose(phase: str, ledger_lines: Optional[Mapping[str, float]] = None, capacity: Optional[int] = None,
             phase_peaks: Optional[Mapping[str, int]] = None) -> str:
    """The text for an out-of-memory error in ``phase``, with the last measured ledger (GiB values, as logged; printed
    in the unit that fits its largest line) and, when measured, the last step's phase peaks (bytes; see
    :func:`phase_forecast`)."""
    if phase not in _SUSPECTS:
        raise ValueError(f"phase={phase!r} is not one of {list(PHASES)}.")
    label = phase.replace("_", " ")
    lines = [f"lightning_ckpt: CUDA out of memory during the {label} phase — {_SUSPECTS[phase]}"]
    forecast = phase_forecast(phase, phase_peaks or {}, capacity)
    if forecast:
        lines.append(forecast)
    if ledger_lines:
        cap = f" of {format_bytes(capacity)} capacity" if capacity else ""
        lines.append(f"Ledger at the last measured step{cap}:")
        unit, scale = unit_for(max(ledger_lines.values()) * GiB)
        for name, gib in ledger_lines.items():
            share = f"  ({gib * GiB / capacity:6.1%})" if capacity else ""
            lines.append(f"  {name:<22} {gib * GiB / scale:10.2f} {unit}{share}")
    else:
        lines.append("No step was measured before the error (it happened in the first step).")
    return "\n".join(lines)


import torch as _torch  # noqa: E402  (only for the exception base class)


class OutOfMemoryDiagnosis(_torch.OutOfMemoryError):
    """Raised from the original out-of-memory error (``__cause__``) with the phase diagnosis as message.

    It is itself a ``torch.OutOfMemoryError``, so code that catches that type keeps working.
    """

    def __init__(self, message: str, phase: str) -> None:
        super().__init__(message)
        self.phase = phase
