"""Out-of-memory diagnosis by phase: where a step died says which ledger line to suspect.

The checklist "What to do on Monday morning", automated:

- before a meaningful forward: parameters, inputs, initialization, or preallocated sharding state;
- forward / start of backward, peak scaling with depth or tokens: retained activations;
- backward despite checkpointing: attention workspaces and un-checkpointed kernels (or the replay transient);
- the **first** ``optimizer.step()``: lazy optimizer-state allocation;
- a later optimizer step: not the state itself (it exists already) — temporaries, fragmentation, or growth;
- validation, the sanity check, test or predict: no gradients, nothing saved for backward — checkpointing cannot
  help; the evaluation batch and what training leaves on the device.

:class:`PhaseTracker` is a tiny state machine the callback advances from its hooks; :meth:`PhaseTracker.where`
names the phase of an error from it, the Trainer's stage (an evaluation loop runs the same block hooks as training)
and whether the error came up through compiled code (a compiled graph applies the hooks' effects only after it
returns); :func:`diagnose` turns a phase and the last measured ledger into the text attached to the re-raised error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from lightning_ckpt.core.units import GiB, format_bytes, unit_for

__all__ = ["EVALUATION_PHASES", "METER_PHASE", "PHASES", "OutOfMemoryDiagnosis", "PhaseTracker", "diagnose",
           "is_out_of_memory", "phase_forecast", "raised_in_compiled_code"]

PHASES = ("before_forward", "forward", "backward", "first_optimizer_step", "optimizer_step", "validation",
          "sanity_check", "evaluation")
# the Trainer's stage (``trainer.state.stage.value``) of a loop without gradients -> its phase
_EVALUATION_STAGES = {"sanity_check": "sanity_check", "validate": "validation", "test": "evaluation",
                      "predict": "evaluation"}
EVALUATION_PHASES = frozenset(_EVALUATION_STAGES.values())

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
    "validation": (
        "lower the validation batch size (or its sequence length). The error came in the validation loop, which "
        "runs without gradients, so activation checkpointing cannot help there; the parameters, the optimizer "
        "state and the allocator's cache of training stay on the device through it."
    ),
    "sanity_check": (
        "lower the validation batch size (or its sequence length). The error came in the sanity check "
        "(num_sanity_val_steps: validation steps before training starts), which runs without gradients, so "
        "activation checkpointing cannot help there."
    ),
    "evaluation": (
        "lower the batch size of the test or predict loop (or its sequence length). It runs without gradients, so "
        "activation checkpointing cannot help there."
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


def raised_in_compiled_code(error: BaseException) -> bool:
    """Whether ``error`` came up through a ``torch.compile``d call (read before its traceback is released).

    Every compiled call enters through a frame of dynamo's context (``torch._dynamo.eval_frame``) that holds the
    context as ``self``; a region dynamo only *skips* (``torch.compiler.disable``, the eager path of every custom op)
    enters through the same code with a ``DisableContext``, which is not compiled code.
    """
    from torch._dynamo import eval_frame

    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__", "") == eval_frame.__name__:
            context = frame.f_locals.get("self")
            if isinstance(context, eval_frame._TorchDynamoContext) and \
                    not isinstance(context, eval_frame.DisableContext):
                return True
        tb = tb.tb_next
    return False


@dataclass
class PhaseTracker:
    """Where the current training step is; advanced by the callback's hooks (no torch, no Lightning).

    Whether an optimizer step is the first is decided from the optimizer itself, not from a count of steps (which
    a second ``fit`` with a fresh optimizer, or a resumed run, would get wrong): the caller tells
    :meth:`optimizer_ready` whether the optimizer about to step holds state already.
    """

    phase: str = "before_forward"
    optimizer_has_state: bool = False

    def batch_start(self) -> None:
        self.phase = "before_forward"

    def forward_start(self) -> None:
        if self.phase == "before_forward":
            self.phase = "forward"

    def backward_start(self) -> None:
        self.phase = "backward"

    def optimizer_ready(self, has_state: bool) -> None:
        """The optimizer about to step holds state already (or keeps none and has stepped before): a later step."""
        self.optimizer_has_state = has_state

    def optimizer_step_start(self) -> None:
        self.phase = "optimizer_step" if self.optimizer_has_state else "first_optimizer_step"

    def optimizer_step_end(self) -> None:
        self.phase = "before_forward"

    def where(self, stage: Optional[str] = None, compiled: bool = False) -> str:
        """The phase an error happened in.

        Args:
            stage: the Trainer's stage (``trainer.state.stage.value``): an evaluation loop's own phase, whatever
                the block hooks (which fire there too) last set.
            compiled: the error came up through compiled code (:func:`raised_in_compiled_code`): a compiled graph
                applies the hooks' effects after it returns, so "before forward" there is the forward.
        """
        if stage in _EVALUATION_STAGES:
            return _EVALUATION_STAGES[stage]
        if compiled and self.phase == "before_forward":
            return "forward"
        return self.phase


# the step phases the meter measures (``memory/peak_{phase}_gib``) for each phase an error can happen in
METER_PHASE = {"before_forward": "forward", "forward": "forward", "backward": "backward",
               "first_optimizer_step": "optimizer", "optimizer_step": "optimizer"}


def phase_forecast(phase: str, phase_peaks: Mapping[str, int], capacity: Optional[int]) -> Optional[str]:
    """What the last measured step's phase peaks (bytes) say about an error in ``phase``: which phase's peak
    crosses capacity, or how close the dying phase came (``None`` without phase peaks)."""
    if not phase_peaks or phase not in METER_PHASE:  # an evaluation loop: the training step's phases are not its own
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
             phase_peaks: Optional[Mapping[str, int]] = None, remedy: Optional[str] = None) -> str:
    """The text for an out-of-memory error in ``phase``, with the last measured ledger (GiB values, as logged; printed
    in the unit that fits its largest line) and, when measured, the last step's phase peaks (bytes; see
    :func:`phase_forecast`). ``remedy``: the remedy priced from that ledger, fix first
    (:func:`lightning_ckpt.forecast.measured.oom_sentence`), the line after the first."""
    if phase not in _SUSPECTS:
        raise ValueError(f"phase={phase!r} is not one of {list(PHASES)}.")
    label = phase.replace("_", " ")
    lines = [f"lightning_ckpt: CUDA out of memory during the {label} phase — {_SUSPECTS[phase]}"]
    if remedy:
        lines.append(remedy)
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
    elif phase in EVALUATION_PHASES:
        lines.append("No training step was measured before the error.")
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
