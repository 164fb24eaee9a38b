"""One optimizer step's measurements, ready to log: the ledger, tokens/s, step time. Pure torch (no Lightning).

:class:`StepMonitor` is what the callback drives from its hooks: :meth:`~StepMonitor.begin_step` before the
first micro-batch of an optimizer step, :meth:`~StepMonitor.add_batch` for every micro-batch,
:meth:`~StepMonitor.end_step` after the optimizer step. It owns a :class:`~lightning_ckpt.measure.meter.StepMeter`.

Time and throughput: a step's time runs from its own start (:meth:`~StepMonitor.begin_step`, before its first
micro-batch's forward) to its end (:meth:`~StepMonitor.end_step`, after the optimizer step). What runs between two
steps is no step's: a checkpoint save (``ModelCheckpoint`` runs after the callback in ``on_train_batch_end``), the
fetch of the first micro-batch, validation between steps. Validation inside an accumulation window is cut out with
:meth:`~StepMonitor.pause` / :meth:`~StepMonitor.resume`. Each step's own time, not an average over the steps
between two logging steps: on CUDA from CUDA events recorded at the step's start and end (the device's timeline,
see :mod:`lightning_ckpt.measure.clock`), on the CPU from the host's ``perf_counter``. A step's time and tokens are
read only on steps that count tokens (``begin_step(tokens=True)``, the logging steps, and a step :attr:`owed` one's
figures): reading an event waits for the device once, so every other step records no event and waits for nothing;
their ``step_s`` is ``None``.

A step that ran the plugin's own per-operation instrumentation (an exact reference step, or one run eagerly for
the budget's block hooks) is ``instrumented``: its time is the instrumentation's as much as the training's, so its
throughput is not the run's. The caller then times the next steps (``begin_step(tokens=True)``, or sets
:attr:`StepMonitor.owed`) until an ordinary one gives the figures (the plugin's
:class:`~lightning_ckpt.lightning.curves.LoggedCurves` logs them at the reference step's place).
``tokens_per_sec = tokens / step_s``; tokens are counted from the batch (``attention_mask`` non-padding when
present, else the token ids' size) or by ``tokens_fn``. A step whose batches carry no token ids (images, waveforms:
see :mod:`lightning_ckpt.measure.tokens`) has ``tokens=None`` and logs ``samples_per_sec`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from lightning_ckpt.measure.clock import EventClock, HostClock, clock_for
from lightning_ckpt.measure.ledger import Ledger, ModelStateWalk, build_ledger
from lightning_ckpt.measure.meter import StepMeter, StepReading
from lightning_ckpt.measure.tokens import count_samples, count_tokens

__all__ = ["StepMonitor", "StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step measured on this rank (``tokens`` and ``step_s`` are ``None`` when not read;
    ``tokens`` is ``None`` too when the step's batches had no tokens, see :mod:`lightning_ckpt.measure.tokens`)."""

    reading: Optional[StepReading]
    ledger: Optional[Ledger]
    tokens: Optional[int]
    samples: int
    step_s: Optional[float]
    checkpointed_blocks: int
    instrumented: bool = False  # the step ran the per-op instrumentation: its time is not the run's (module doc)

    @property
    def tokens_per_sec(self) -> float:
        return (self.tokens or 0) / self.step_s if self.step_s else 0.0

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.step_s if self.step_s else 0.0

    def throughput(self, prefix: str = "") -> Dict[str, float]:
        """The time and throughput lines, when this step was timed (also on an ``instrumented`` step: the caller
        decides, every rank alike, whether they are logged)."""
        root = f"{prefix}/" if prefix else ""
        out: Dict[str, float] = {}
        if self.step_s is not None:  # read on counting steps only: then samples were counted too
            if self.tokens is not None:  # batches without token ids (images) have samples, no tokens
                out[f"{root}throughput/tokens_per_sec"] = self.tokens_per_sec
            out[f"{root}throughput/samples_per_sec"] = self.samples_per_sec
            out[f"{root}time/step_s"] = self.step_s
        return out

    def metrics(self, prefix: str = "") -> Dict[str, float]:
        """Every metric name of DESIGN.md that this step measured (GiB floats for memory)."""
        root = f"{prefix}/" if prefix else ""
        out = dict(self.ledger.as_metrics(prefix=f"{root}memory")) if self.ledger is not None else {}
        out.update(self.throughput(prefix))
        out[f"{root}checkpointing/blocks"] = float(self.checkpointed_blocks)
        return out


class StepMonitor:
    """Measures optimizer steps for one training run (see the module docstring).

    Args:
        device: this rank's training device.
        tokens_fn: ``tokens_fn(batch) -> int`` overriding the token count.
        capacity: device capacity in bytes for the ledger, if known.
        exact_every_n_steps: make every n-th measured step an exact (calibration) step; 0 never.
        clock: where step times come from (default :func:`~lightning_ckpt.measure.clock.clock_for` the device:
            CUDA events on CUDA, the host's clock elsewhere); a test passes a fake event clock.
        allocator_note: why the allocator's lines are not comparable this run (CUDA graphs), or ``None``; passed to
            every ledger (:func:`~lightning_ckpt.measure.ledger.build_ledger`).
    """

    def __init__(self, device: Union[torch.device, str], *, tokens_fn: Optional[Callable[[Any], Any]] = None,
                 capacity: Optional[int] = None, exact_every_n_steps: int = 0,
                 clock: Union[HostClock, EventClock, None] = None, allocator_note: Optional[str] = None) -> None:
        self.meter = StepMeter(device)
        self.tokens_fn = tokens_fn
        self.capacity = capacity
        self.exact_every_n_steps = exact_every_n_steps
        self.clock = clock if clock is not None else clock_for(self.meter.device)
        self.allocator_note = allocator_note
        self._start: Any = None  # the mark the open step's time starts at: its own start (counting steps only)
        self._paused_at: Any = None
        self._pauses: List[Tuple[Any, Any]] = []  # (pause, resume) marks since _start
        self.owed = False  # an instrumented step's figures are owed: steps count and are timed until one is not
        self._eager = False
        self._measured = 0
        self._tokens: Any = None  # the open step's token count; None until a batch with tokens is added
        self._samples = 0
        self._open = False
        self._ledger_wanted = False
        self._counting = False
        self._state_walk = ModelStateWalk()  # the model state, walked again only when its make-up changes

    def watch(self, model: nn.Module) -> None:
        self.meter.watch(model)

    @property
    def in_step(self) -> bool:
        return self._open

    def begin_step(self, measure: bool, key: Any = None, eager: bool = False, tokens: Optional[bool] = None,
                   state: Iterable[torch.Tensor] = (), exact: Optional[bool] = None,
                   hidden_recompute: bool = False, size: Optional[float] = None,
                   attribute: Optional[Sequence[str]] = None, batch: Iterable[torch.Tensor] = ()) -> None:
        """Start an optimizer step; ``measure`` counts activations and builds the ledger at the end.

        ``key`` (what determines the step's memory: plan, batch shapes, precision) makes the first step of each key
        an exact reference step (see :mod:`lightning_ckpt.measure.meter`); ``eager`` runs compiled code eagerly;
        ``tokens`` (default: ``measure``) counts tokens and samples and reads the step's time, for the time and
        throughput lines (on CUDA reading the time waits for the device once, at :meth:`end_step`); ``state`` are the
        model state's tensors and ``batch`` the batch's (for the phase peaks of an exact step on the CPU);
        ``exact`` forces the step exact or not (``None``: every ``exact_every_n_steps``-th measured step);
        ``hidden_recompute``, ``size`` and ``attribute`` (the blocks' paths: an exact step names what is alive at its
        peaks): see
        :meth:`~lightning_ckpt.measure.meter.StepMeter.start_step`. A step that is not measured touches nothing:
        no hook, no allocator counter reset (other tools' peaks stay as they are).
        """
        self._counting = (measure if tokens is None else tokens) or self.owed
        # the step's own start: what ran since the last step (a checkpoint save, validation) is no step's
        self._start = self.clock.mark() if self._counting else None
        self._pauses, self._paused_at, self._eager = [], None, eager
        if measure:
            if exact is None:
                exact = bool(self.exact_every_n_steps and self._measured % self.exact_every_n_steps == 0)
            self.meter.start_step(exact=exact, key=key, eager=eager, state=state, hidden_recompute=hidden_recompute,
                                  size=size, attribute=attribute, batch=batch)
        self._ledger_wanted = measure
        self._tokens, self._samples, self._open = None, 0, True

    def phase(self, name: str) -> None:
        """A phase boundary of a measured step (see :meth:`lightning_ckpt.measure.meter.StepMeter.phase`)."""
        if self._ledger_wanted:
            self.meter.phase(name)

    def restart_step(self, key: Any = None, state: Iterable[torch.Tensor] = (),
                     hidden_recompute: Optional[bool] = None) -> None:
        """The open step is retried after an error inside it: a measured step's figures start over under ``key``
        (:meth:`lightning_ckpt.measure.meter.StepMeter.restart_step`); its time, tokens and samples run on (the
        same batches, the time the failed attempt took included)."""
        if self._open and self._ledger_wanted:
            self.meter.restart_step(key=key, state=state, hidden_recompute=hidden_recompute)

    def add_batch(self, batch: Any, size: Optional[float] = None) -> None:
        """Count a micro-batch of the open step; ``size`` (its tokens, for a measured step after its first
        micro-batch) goes to :meth:`~lightning_ckpt.measure.meter.StepMeter.grow`."""
        if self._ledger_wanted and size is not None:
            self.meter.grow(size)
        if not self._counting:  # counts are only read on logging steps: no work (or GPU op) otherwise
            return
        tokens = count_tokens(batch, self.tokens_fn)
        if tokens is not None:  # None: a batch without token ids (an image batch) has samples only
            self._tokens = tokens if self._tokens is None else self._tokens + tokens
        self._samples += count_samples(batch)

    def end_step(self, model: nn.Module, optimizers: Iterable[Any], checkpointed_blocks: int) -> StepResult:
        """Close the step; the ledger is built only when the step was measured."""
        reading = self.meter.stop_step() if self._ledger_wanted else None
        # read only where the figures are read: on CUDA this waits for the device (once; the tokens then cost nothing)
        step_s = None
        if self._counting:
            end = self.clock.mark()
            pauses = self._pauses + ([(self._paused_at, end)] if self._paused_at is not None else [])  # still paused
            step_s = self.clock.elapsed(self._start, end, pauses)
        self._start, self._pauses, self._paused_at = None, [], None
        self._open = False
        instrumented = self._eager or (reading is not None and reading.exact)
        ledger = None
        if self._ledger_wanted:
            self._measured += 1
            optimizers = list(optimizers)
            state = self._state_walk(model, optimizers, device=self.meter.device)
            ledger = build_ledger(model, optimizers, reading, capacity=self.capacity, device=self.meter.device,
                                  allocator_note=self.allocator_note, state=state)
        # a token count on the GPU is read only on logging steps: reading it waits for the device
        tokens = int(self._tokens) if self._counting and self._tokens is not None else None
        return StepResult(reading, ledger, tokens, self._samples, step_s, checkpointed_blocks, instrumented)

    def pause(self) -> None:
        """Time from now until :meth:`resume` is not part of the open step (validation inside an accumulation
        window; between steps nothing is timed, so there is nothing to cut)."""
        if self._open and self._counting and self._paused_at is None:
            self._paused_at = self.clock.mark()

    def resume(self) -> None:
        """End a :meth:`pause`: the paused interval is cut out of the open step's time."""
        if self._paused_at is not None and self._open:
            self._pauses.append((self._paused_at, self.clock.mark()))
        self._paused_at = None

    def abort(self) -> None:
        """Drop an open step (an exception inside it) and remove every hook."""
        self.meter.close()
        self._open = False
        self._start = self._paused_at = None
        self._pauses = []

    def close(self) -> None:
        self.abort()
