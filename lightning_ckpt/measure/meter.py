"""Per-step measurement: allocator peaks, the activation peak, tokens and samples. Pure torch (no Lightning).

A :class:`StepMeter` is started before the first forward of an optimizer step and stopped after the last backward
(with gradient accumulation: started once, stopped after the last micro-batch, so every figure is the peak over
all of them). :meth:`StepMeter.stop_step` returns a :class:`StepReading`.

**Allocator counters** (``peak_allocated``, ``peak_reserved``): the CUDA caching allocator's peak counters,
reset at every :meth:`~StepMeter.start_step` (and at each phase boundary, see below; after
:meth:`~StepMeter.stop_step` ``torch.cuda.max_memory_allocated()`` reads the step's last phase: the whole step when no
phase was marked). Both the reset and the read touch host-side counters only; the
device is never synchronized. The allocator updates them when the host enqueues an allocation, so they are exact
without a sync. On a device without allocator counters (the CPU) they are ``None``, never a fake zero.

**The activation figure** (``activations``) is device independent and means: *the peak, over the step, of the
bytes held for backward*, i.e.

- every tensor autograd saves for backward (seen through an outer ``saved_tensors_hooks``), counted once per
  storage while that storage is alive, parameters and the watched model's buffers excluded;
- plus, while a checkpointed region is replayed in backward, the replay's own live bytes (the recomputed
  interior of the block, which outer hooks cannot see), counted while grad mode is on, as in exact mode: what the
  block allocates under ``no_grad`` (FSDP2's all-gathered parameters, caches) is not an activation. Each replay
  is reported by
  :func:`lightning_ckpt.core.wrap.register_replay_hook`; its interior is measured once per (region, mode, input
  shapes, autocast) with a live-tensor tracker scoped to that replay (the *calibration*, on the first step that
  sees the region and whenever its input shapes change) and then reused, so later steps add a table lookup per
  replay and no per-op work.

What runs per step in the default mode: one Python pack and one unpack call per tensor saved outside
checkpointed regions (a checkpointed region saves only its inputs there) and one hook call per replayed region;
no per-op work. That is a few microseconds of host time per saved tensor (the benchmark GPT saves 301 tensors
per step without checkpointing, 25 with ``all``), hidden behind the device while it is the bottleneck. To stay
under 1 % on a host-bound step, measure activations on logging steps only: ``start_step(activations=False)``
installs nothing and still reads the allocator peaks.

**Exact mode** (``exact=True``, meant for calibration steps) adds a ``TorchDispatchMode`` that follows every
storage created by an operator while grad mode is on (per-op Python work, several times slower): the forward, and
the replays of checkpointed regions in backward (checkpoint replays with grad enabled; ordinary backward runs
without). It reports ``activations_exact``, the peak of those live bytes, excluding parameters, gradients,
backward temporaries (activation gradients) and the optimizer step (which runs under ``no_grad``), and
``autocast_copies``, the peak of the low-precision copies of parameters autocast makes (``_to_copy`` of an
``nn.Parameter``: held by autocast's cache until the autocast region exits, or saved for backward), which are not
activations and are never inside ``activations``. That is what ``torch.distributed._tools.mem_tracker.MemTracker``
calls ``ACT`` (outputs of the forward and of checkpoint recomputation), taken as the maximum of ``ACT`` over the
step. In exact mode ``activations`` is the exact figure. Exact steps run with the compiler's stance set to
``force_eager``: compiled regions run their Python, so replays and operators are seen.

**Phases** (:meth:`StepMeter.phase`, called at the start of each micro-batch's forward, before its backward and
before the optimizer step): ``phase_peaks`` holds the peak memory of the forward, the backward and the optimizer
phase (the maximum over the step's micro-batches). On CUDA they are the allocator's peaks, reset at each boundary
(host-side counters, no sync). On the CPU, exact steps follow every storage of the step (the model state at its
start included, until freed) with a second, ungated live-tensor count; other steps of a key report their
reference step's phase peaks.

**Reference steps** (``start_step(key=...)``): the first step of each key — the caller's description of what
determines the step's memory: the plan, the batch shapes, the precision — is measured exactly; later steps of the
same key are measured in the default mode and corrected by the difference the reference step saw between the two
figures (temporaries that are live but not saved, such as the float32 upcast of the logits at the loss, and the
autocast copies). So every step reports the exact figures at the default mode's cost, and the saved-tensor figure
still follows any drift. A step whose replays were not seen (a ``torch.compile``d model replays inside the
compiled backward, invisible to Python) reports its reference step's figures.

Known limitations:
    - Tensors saved under another ``saved_tensors_hooks`` pushed inside the step (``offload`` blocks,
      ``torch.autograd.graph.save_on_cpu``, the parent's work *between* the blocks of a ``group:K`` region) are
      invisible to the outer hook and not counted; for offloaded tensors that is right on an accelerator
      (they live in host memory).
    - Replays of regions checkpointed by other code than :mod:`lightning_ckpt.core.wrap` (``torch.utils.checkpoint``
      called by the model itself) are not reported, so their interior is missing from the default figure (exact
      mode and reference steps count them).
    - With ``create_graph=True`` (double backward), backward runs with grad enabled and exact mode counts its
      temporaries as activations.
    - A block whose interior changes without its inputs' shapes changing (data-dependent routing) keeps its
      first calibration; call :meth:`StepMeter.forget_calibration` to re-measure.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from lightning_ckpt.core.replay import register_replay_hook
from lightning_ckpt.measure.attribution import AllocationLog, ModuleStack, PeakAttribution, attribute
from lightning_ckpt.measure.timeline import Timeline, build_timeline
from lightning_ckpt.measure.tracker import LiveBytes, SavedBytes, exit_mode, exit_saved_hooks, storage_key, storages

__all__ = ["CudaMemoryQueries", "StepMeter", "StepReading", "cuda_peaks", "device_capacity"]


# ------------------------------------------------------------------------------------------------- readings


@dataclass(frozen=True)
class StepReading:
    """What one optimizer step measured. Bytes are ``int``; ``None`` means "not measured", never zero.

    Attributes:
        activations: the activation peak of the step in bytes (see the module docstring); the exact figure on
            exact steps, the saved-tensor figure otherwise; ``None`` when activations were not measured.
        activations_estimate: the saved-tensor figure (also computed on exact steps, to compare).
        activations_exact: the live-tensor figure, only on exact steps.
        autocast_copies: peak bytes of low-precision copies of parameters made by autocast, on exact steps and on
            steps of a calibrated key (``None`` otherwise); never part of ``activations``.
        reference: this step was the exact reference step of its key.
        eager_figure: ``activations`` was counted on an eager run (an exact step, which runs compiled code eagerly, or
            the reference step's figure reused because this compiled step's replays were unseen), not on this step's
            compiled graphs: what a compiler's per-graph choice saves is not in it.
        phase_peaks: ``{"forward", "backward", "optimizer"}`` peak bytes of the step's phases (see the module
            docstring); ``None`` when not measured.
        peak_allocated: peak bytes allocated by the CUDA caching allocator during the step (``None`` off CUDA).
        peak_reserved: peak bytes reserved by the allocator (allocated plus its cache; ``None`` off CUDA).
        replays: checkpointed regions replayed in backward during the step.
        calibrations: replays whose interior was measured per op this step (the rest reused a measurement).
        wall_s: host time from ``start_step`` to ``stop_step`` (no device sync: on an accelerator a single
            step's value runs ahead of the device; averages over several steps are accurate).
        attribution: on an attributed exact step, what was alive at ``"activation peak"``, ``"forward end"`` and
            (CPU) ``"total peak"`` (:class:`~lightning_ckpt.measure.attribution.PeakAttribution`); else ``None``.
        timeline: on an attributed exact step, its memory over its operations by ledger line
            (:class:`~lightning_ckpt.measure.timeline.Timeline`); else ``None``.
    """

    activations: Optional[int]
    peak_allocated: Optional[int] = None
    peak_reserved: Optional[int] = None
    activations_estimate: Optional[int] = None
    activations_exact: Optional[int] = None
    replays: int = 0
    calibrations: int = 0
    wall_s: float = 0.0
    autocast_copies: Optional[int] = None
    reference: bool = False
    phase_peaks: Optional[Dict[str, int]] = None
    eager_figure: bool = False
    attribution: Optional[Dict[str, PeakAttribution]] = None
    timeline: Optional[Timeline] = None

    @property
    def exact(self) -> bool:
        return self.activations_exact is not None

    @property
    def cache(self) -> Optional[int]:
        """Peak reserved minus peak allocated: memory the allocator holds but no tensor uses."""
        if self.peak_reserved is None or self.peak_allocated is None:
            return None
        return self.peak_reserved - self.peak_allocated


# ------------------------------------------------------------------------------------------ allocator counters


def _normalize_device(device: Union[torch.device, str, int, None]) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _storage_keys(tensors: Iterable[torch.Tensor]) -> set:
    return {storage_key(st) for t in tensors for st in storages(t)}


def _storage_sizes(tensors: Iterable[torch.Tensor], seen: Optional[set] = None) -> Iterator[Tuple[int, int]]:
    """``(key, bytes)`` of each storage behind ``tensors``, once (not again if in ``seen``, which it fills)."""
    seen = set() if seen is None else seen
    for t in tensors:
        for st in storages(t):
            key = storage_key(st)
            if key not in seen:
                seen.add(key)
                yield key, st.nbytes()


def _has_allocator_counters(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def cuda_peaks(device: Union[torch.device, int]) -> Tuple[int, int]:
    """``(peak allocated, peak reserved)`` bytes of a CUDA device from host-side counters (no sync).

    Same values as ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, without building and sorting
    the flat ``memory_stats`` dict.
    """
    index = device if isinstance(device, int) else _normalize_device(device).index
    try:
        stats = torch._C._cuda_memoryStats(index)
        return int(stats["allocated_bytes"]["all"]["peak"]), int(stats["reserved_bytes"]["all"]["peak"])
    except (AttributeError, KeyError, TypeError, RuntimeError):  # private API moved: the public, slower way
        return torch.cuda.max_memory_allocated(index), torch.cuda.max_memory_reserved(index)


class CudaMemoryQueries:
    """The CUDA memory queries :func:`device_capacity` makes, by device index (a test passes its own figures)."""

    def mem_get_info(self, index: int) -> Tuple[int, int]:
        """``(free, total)`` bytes of the device, every process included (``cudaMemGetInfo``)."""
        return torch.cuda.mem_get_info(index)

    def memory_reserved(self, index: int) -> int:
        """Bytes this process's caching allocator holds (in use or cached): usable by this run, not free."""
        return torch.cuda.memory_reserved(index)

    def memory_fraction(self, index: int) -> Optional[float]:
        """The allocator's limit as a fraction of the total (``set_per_process_memory_fraction``), ``None`` when this
        torch has no getter (the limit is then not known; free + reserved still bounds the capacity)."""
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        return float(getter(index)) if getter is not None else None


def device_capacity(device: Union[torch.device, str, int, None],
                    queries: Optional[CudaMemoryQueries] = None) -> Optional[int]:
    """Bytes of device memory this run can really use; ``None`` on the CPU.

    The smaller of the allocator's limit, ``total × torch.cuda.get_per_process_memory_fraction()`` (the allocator
    raises out-of-memory beyond it), and ``free + this process's reserved`` (``torch.cuda.mem_get_info``,
    ``torch.cuda.memory_reserved``): memory outside the allocator — the CUDA context, NCCL's buffers, other
    processes — is neither free nor ours. Read when called (once per run, when the plan is applied): what is
    allocated outside the allocator later (NCCL's communicators at the first collective) is not taken off. A host
    query, no stream sync.

    Args:
        device: the device; anything else than CUDA gives ``None``.
        queries: the CUDA queries to make (default :class:`CudaMemoryQueries`, the real ones; with others the
            device need not exist).
    """
    device = _normalize_device(device)
    if device.type != "cuda" or (queries is None and not _has_allocator_counters(device)):
        return None
    queries = queries if queries is not None else CudaMemoryQueries()
    index = device.index if device.index is not None else 0
    free, total = queries.mem_get_info(index)
    # the allocator's limit is the fraction of the total cudaMemGetInfo gives (CUDACachingAllocator setMemoryFraction)
    fraction = queries.memory_fraction(index)
    limit = int(fraction * total) if fraction is not None else int(total)
    return min(limit, int(free) + int(queries.memory_reserved(index)))


# ---------------------------------------------------------------------------------------------------- meter


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.device, x.requires_grad)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (tuple, list)):
        return tuple(_signature(v) for v in x)
    return type(x).__name__


def _replay_key(owner: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], device_type: str) -> Tuple[Any, ...]:
    members = getattr(owner, "members", None)
    if members is not None:  # a group:K region
        who: Tuple[Any, ...] = ("group", id(owner), members[0].index, members[-1].index)
    else:
        shared = getattr(owner, "shared", None)
        save_ops = getattr(shared, "save_ops", None) if owner.mode == "selective" else None
        who = ("block", id(owner.block), owner.index, owner.mode, save_ops)
    amp = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)) \
        if torch.amp.is_autocast_available(device_type) else None
    return (who, amp, tuple(_signature(a) for a in args),
            tuple((k, _signature(v)) for k, v in kwargs.items()) if kwargs else ())


class StepMeter:
    """Measures one optimizer step at a time; one instance per training run (see the module docstring).

    Example:
        >>> meter = StepMeter("cpu")
        >>> meter.start_step()
        >>> # forward + backward (all micro-batches of the step)
        >>> reading = meter.stop_step()
        >>> reading.peak_allocated is None  # the CPU has no allocator counters
        True

    Args:
        device: the device whose memory is measured (the training device of this rank).
        exact: make every step an exact (calibration) step; usually left ``False`` and requested per step
            with ``start_step(exact=True)``.
        model: optional; its buffers' storages are never counted as activations (parameters never are).
            Call :meth:`watch` again after moving the model to another device.
    """

    def __init__(self, device: Union[torch.device, str, int, None] = None, exact: bool = False,
                 model: Optional[nn.Module] = None) -> None:
        if not isinstance(exact, bool):
            raise TypeError(f"StepMeter: exact={exact!r} must be True or False.")
        self.device = _normalize_device(device)
        self.exact = exact
        self._static: frozenset = frozenset()
        self._model: Optional[nn.Module] = None  # the watched model (attribution names its modules)
        if model is not None:
            self.watch(model)
        self._interiors: Dict[Tuple[Any, ...], int] = {}
        self._references: Dict[Any, _Reference] = {}
        self._saved: Optional[SavedBytes] = None
        self._live: Optional[LiveBytes] = None
        self._replay_handle = None
        self._stance: Any = None
        self._key: Any = None
        self._size: Optional[float] = None  # the open step's batch size (tokens), to scale a reference's correction
        self._modules: Optional[ModuleStack] = None
        self._logs: Optional[Tuple[AllocationLog, AllocationLog]] = None
        self._attribution_blocks: Tuple[str, ...] = ()
        self._base: Dict[str, int] = {}
        self._total: Optional[LiveBytes] = None  # every storage of the step, on exact CPU steps (phases)
        self._phase: Optional[str] = None
        self._phased = False
        self._phase_peaks: Dict[str, int] = {}
        self._reserved_peak = 0
        self._replay_depth = 0
        self._open = False
        self._t0 = 0.0
        self._replays = 0
        self._calibrations = 0
        self.last: Optional[StepReading] = None

    # -- configuration
    def watch(self, model: nn.Module) -> "StepMeter":
        """Never count ``model``'s buffers (e.g. attention masks, rotary tables) as activations."""
        self._static = frozenset(_storage_keys(model.buffers()))
        self._model = model
        return self

    def forget_calibration(self) -> None:
        """Drop the measured replay interiors and reference steps; the next steps are measured again."""
        self._interiors.clear()
        self._references.clear()

    def has_reference(self, key: Any) -> bool:
        """Whether a step with this key was measured exactly already (see the module docstring)."""
        return key in self._references

    @property
    def calibrated_regions(self) -> int:
        """How many (region, mode, input shapes) interiors are known."""
        return len(self._interiors)

    @property
    def largest_replay_interior(self) -> int:
        """The largest measured interior of one replayed region, in bytes (0 before any replay)."""
        return max(self._interiors.values(), default=0)

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def key(self) -> Any:
        """The open (or last) step's reference key, as passed to :meth:`start_step` or :meth:`restart_step`."""
        return self._key

    def live_bytes(self) -> Optional[int]:
        """Bytes of every storage the step's forward created that is alive now, autocast's copies of parameters
        apart, as in the activation figure (exact steps only, else ``None``)."""
        return self._live.live if self._live is not None else None

    def live_copies_bytes(self) -> Optional[int]:
        """Bytes of autocast's low-precision copies of parameters alive now (exact steps only, else ``None``)."""
        return self._live.copies_live if self._live is not None else None

    def live_saved_bytes(self) -> Optional[int]:
        """Bytes held for backward right now (outer hooks' view), or ``None`` when activations aren't counted."""
        return self._saved.live if self._saved is not None else None

    # -- the step
    def start_step(self, exact: Optional[bool] = None, activations: bool = True, key: Any = None,
                   eager: bool = False, state: Iterable[torch.Tensor] = (), hidden_recompute: bool = False,
                   size: Optional[float] = None, attribute: Optional[Sequence[str]] = None,
                   batch: Iterable[torch.Tensor] = ()) -> None:
        """Reset the allocator peaks (no sync) and start counting activations.

        Args:
            exact: this step is an exact (calibration) step; ``None`` uses the meter's ``exact``.
            activations: count activations this step (``False``: allocator counters only, no hooks at all).
            key: a hashable description of what determines this step's memory (plan, batch shapes, precision);
                the first step of a key is an exact reference step, later ones are corrected by it.
            eager: run compiled code eagerly this step (exact steps always do), e.g. while block hooks measure.
            state: the tensors of the model state (:func:`lightning_ckpt.measure.ledger.state_tensors`), so that an
                exact step's phase peaks on the CPU include them.
            batch: the batch's tensors, alive through the step like the state (in the timeline: temporaries).
            hidden_recompute: the step recomputes inside compiled graphs where no replay is reported (blocks under
                the compiler's own budget, ``compiler:<f>``): a step after the reference reports the reference's
                figure, as when replays go unseen, since its saved-tensor figure lacks those transients.
            size: how big the step's batch is (its tokens), when a key covers batches of several sizes (a bucket of
                shapes): a later step's correction is the reference's scaled by ``size / reference size`` (the
                temporaries it stands for, such as the logits' upcast, grow with the batch). With accumulation,
                :meth:`grow` it by each later micro-batch: the size is the largest micro-batch's, whose peak the
                step's is.
            attribute: on an exact step of a watched model, name what is alive at the step's peaks
                (:mod:`lightning_ckpt.measure.attribution`): the blocks' paths in the model, in order (``()`` for
                none); the reading's ``attribution`` holds the result. ``None``: not attributed.
        """
        if self._open:
            warnings.warn("lightning_ckpt: StepMeter.start_step() called while a step was open; the open step "
                          "was discarded (call stop_step() or close() after every step).", RuntimeWarning,
                          stacklevel=2)
            self.close()
        exact = self.exact if exact is None else exact
        self._key = key if activations else None
        exact = exact or (self._key is not None and self._key not in self._references)
        if _has_allocator_counters(self.device):
            torch.cuda.reset_peak_memory_stats(self.device)
        self._replays = self._calibrations = 0
        self._replay_depth = 0
        self._hidden_recompute = hidden_recompute
        self._size = size
        if exact or eager:
            self._stance = _force_eager()
        if activations or exact:
            self._saved = SavedBytes(self.device, self._static)
            self._replay_handle = register_replay_hook(self._on_replay)
            self._saved.hooks.__enter__()
        self._logs = None
        if exact and attribute is not None and self._model is not None:
            self._logs = self._attribution_logs(attribute)
            state, batch = list(state), list(batch)  # read twice: by the timeline here, and by the tracker below
            self._base = self._timeline_base(state, batch)
        if exact:
            self._live = LiveBytes(self.device, gate=torch.is_grad_enabled,
                                   log=self._logs[0] if self._logs else None)
            if self._logs:
                self._saved.on_save = self._logs[0].saved
            if not _has_allocator_counters(self.device):  # the allocator gives phase peaks on CUDA
                self._total = LiveBytes(self.device, log=self._logs[1] if self._logs else None)
                self._total.adopt(state)
                self._total.adopt(batch)
                self._total.__enter__()
            self._live.__enter__()
        self._phase_peaks = {}
        self._reserved_peak = 0
        self._phase = "forward"
        self._phased = False  # phase peaks are reported only when the caller marks the boundaries
        self._open = True
        self._t0 = time.perf_counter()

    def grow(self, size: Optional[float]) -> None:
        """A later micro-batch of the open step is ``size`` big (see ``size`` in :meth:`start_step`): the step's
        size is its largest micro-batch's, since the activation peak, and the correction of a reference step
        with it, are that micro-batch's (the micro-batches' activations are freed by each one's backward)."""
        if self._open and size is not None:
            self._size = max(self._size or 0, size)

    def phase(self, name: str) -> None:
        """A phase boundary: ``"forward"`` (a micro-batch starts), ``"backward"`` or ``"optimizer"``."""
        if not self._open:
            return
        if self._logs and name == "backward" and self._phase == "forward":
            self._logs[0].mark("forward end", self._logs[0].events)  # the last forward's end
        if self._logs and name != self._phase:
            self._logs[0].boundary(name)
        self._close_phase()
        self._phase, self._phased = name, True

    def _close_phase(self, restart: bool = True) -> None:
        """Fold the running peak into the current phase's and restart it (host-side only, no sync). The last phase
        is not restarted: after a step the allocator's own peak counters hold that phase's peak, as read here."""
        peak = None
        if _has_allocator_counters(self.device):
            peak, reserved = cuda_peaks(self.device)
            self._reserved_peak = max(self._reserved_peak, reserved)
            if restart:
                torch.cuda.reset_peak_memory_stats(self.device)
        elif self._total is not None:
            peak = self._total.total_peak
            if restart:
                self._total.reset_peak()
        if peak is not None and self._phase is not None:
            self._phase_peaks[self._phase] = max(self._phase_peaks.get(self._phase, 0), peak)

    def stop_step(self) -> StepReading:
        """Stop counting and read every figure of the step (no device sync)."""
        if not self._open:
            raise RuntimeError("StepMeter.stop_step() called without start_step(); call start_step() before the "
                               "first forward of the optimizer step.")
        wall = time.perf_counter() - self._t0
        saved, live = self._saved, self._live
        self._close_phase(restart=False)  # the last phase
        phases, self._phase_peaks = dict(self._phase_peaks), {}
        peak_allocated = peak_reserved = None
        if _has_allocator_counters(self.device):  # each phase reset the counters: the step's peak is the highest
            peak_allocated, peak_reserved = max(phases.values(), default=0), self._reserved_peak
        if not self._phased:  # one running peak for the whole step, not a forward phase
            phases = {}
        self.close()
        estimate = saved.peak if saved is not None else None
        exact = live.peak if live is not None else None
        activations, copies = (exact, live.copies_peak) if live is not None else (estimate, None)
        key, reference, eager_figure = self._key, False, exact is not None
        if key is not None and exact is not None:
            self._references[key] = _Reference(exact, live.copies_peak, exact - estimate, self._replays, phases,
                                               self._size)
            reference = True
        elif key is not None and estimate is not None:
            ref = self._references[key]
            copies = ref.copies
            phases = phases or dict(ref.phases)
            # replays unseen (compiled backward): the saved-tensor figure lacks the transient; the reference has it
            eager_figure = self._replays != ref.replays or self._hidden_recompute
            scale = self._size / ref.size if self._size and ref.size else 1.0  # a bucket's batches differ in size
            activations = round(ref.exact * scale) if eager_figure else estimate + round(ref.offset * scale)
        timeline = self._timeline() if self._logs else None
        attribution = self._attributions(phases) if self._logs else None
        reading = StepReading(
            activations=activations,
            peak_allocated=peak_allocated,
            peak_reserved=peak_reserved,
            activations_estimate=estimate,
            activations_exact=exact,
            replays=self._replays,
            calibrations=self._calibrations,
            wall_s=wall,
            autocast_copies=copies,
            reference=reference,
            phase_peaks=phases or None,
            eager_figure=eager_figure,
            attribution=attribution,
            timeline=timeline,
        )
        self.last = reading
        return reading

    # -- attribution
    def _attribution_logs(self, blocks: Sequence[str]) -> Tuple[AllocationLog, AllocationLog]:
        """The activation line's and the whole memory's logs of an attributed exact step, sharing one module
        stack (see :mod:`lightning_ckpt.measure.attribution`)."""
        self._modules = ModuleStack(self._model).__enter__()
        self._attribution_blocks = tuple(blocks)
        replaying, phase = (lambda: self._replay_depth > 0), (lambda: self._phase or "forward")
        total = AllocationLog(self._modules, replaying, phase)
        return AllocationLog(self._modules, replaying, phase, clock=total.clock, partner=total), total

    def _timeline_base(self, state: Sequence[torch.Tensor], batch: Sequence[torch.Tensor] = ()) -> Dict[str, int]:
        """The model state and the batch at the step's start, each storage once under its line (parameters,
        gradients, the rest of the state: optimizer state; the batch: temporaries). On the CPU its storages go into
        the whole memory's log, which follows them until freed (an empty base); on CUDA, where only the activation
        line is logged, they are the constant bands the timeline stacks its step on."""
        params = _storage_keys(self._model.parameters())
        grads = _storage_keys(p.grad for p in self._model.parameters() if p.grad is not None)
        log = None if _has_allocator_counters(self.device) else self._logs[1]
        base: Dict[str, int] = {}
        seen: set = set()  # a storage of the state and the batch both is the state's
        for tensors, rest in ((state, "optimizer state"), (batch, "temporaries")):
            here = (t for t in tensors if isinstance(t, torch.Tensor) and t.device == self.device)
            for key, nbytes in _storage_sizes(here, seen):
                line = "parameters" if key in params else "gradients" if key in grads else rest
                if log is not None:
                    log.adopt(key, nbytes, line)
                else:
                    base[line] = base.get(line, 0) + nbytes
        return base

    def _timeline(self) -> Timeline:
        """The step's memory over its events (:mod:`lightning_ckpt.measure.timeline`): the whole memory's log on
        the CPU, the activation line's where the allocator counts the rest (CUDA)."""
        line, total = self._logs
        grads = _storage_keys(p.grad for p in self._model.parameters() if p.grad is not None)
        return build_timeline(total if total.records else line, self._base, grads, boundaries=line.boundaries)

    def _attributions(self, phases: Dict[str, int]) -> Dict[str, PeakAttribution]:
        """What was alive at the activation peak, at the end of the forward and (CPU) at the whole memory's peak."""
        line, total = self._logs
        self._logs = None
        out = {}
        for moment, log, label in (("activation peak", line, "peak"), ("forward end", line, "forward end"),
                                   ("total peak", total, "total peak")):
            mark = log.marks.get(label)
            if mark is not None:  # the activation line holds no copies: its moments name none (the total's do)
                out[moment] = attribute(log, mark[0], moment, mark[2] or "forward", self._attribution_blocks,
                                        copies=log is total)
        return out

    @contextlib.contextmanager
    def step(self, exact: Optional[bool] = None, activations: bool = True, key: Any = None,
             eager: bool = False, state: Iterable[torch.Tensor] = (), batch: Iterable[torch.Tensor] = (),
             hidden_recompute: bool = False, attribute: Optional[Sequence[str]] = None) -> Iterator["_ReadingBox"]:
        """``with meter.step() as box: ...`` then ``box.reading``; the step is closed even on an exception."""
        box = _ReadingBox()
        self.start_step(exact=exact, activations=activations, key=key, eager=eager, state=state,
                        hidden_recompute=hidden_recompute, attribute=attribute, batch=batch)
        del state, batch  # a list of the model state would keep last step's gradients alive through the step
        try:
            yield box
        except BaseException:
            self.close()
            raise
        box.reading = self.stop_step()

    def restart_step(self, key: Any = None, state: Iterable[torch.Tensor] = (),
                     hidden_recompute: Optional[bool] = None) -> None:
        """Start the open step over: the step is retried after an error inside it (out of memory, retried under a
        stronger plan), and every figure it reports must be the retry's.

        Call it once the failed attempt's memory is released (its tensors freed): the allocator's peak counters are
        reset here (no sync). Nothing the failed attempt counted is kept: the phase peaks, the phase (the retry's
        forward is ``"forward"`` again, whatever phase the error came in), the replay count, the saved-tensor
        tracking (a fresh tracker) and the exact step's live-tensor count (a fresh one; the CPU phase tracker keeps
        the step's state and restarts its peak from what is alive now). The measured replay interiors are dropped
        and measured again: a replay the error cut short stored the part it had reached. The step is stored, at
        :meth:`stop_step`, as the reference of ``key`` (the plan it is retried under) when that key has none yet —
        it is then measured exactly from here on — and never under the key it was started with. With gradient
        accumulation only the retried micro-batch is measured: the earlier ones ran under the old plan. The step's
        ``wall_s`` still runs from :meth:`start_step` (the failed attempt took that time too).

        Args:
            key: the retried step's reference key (``None``: no reference step, as in :meth:`start_step`).
            state: the model state's tensors, for the CPU phase peaks when the retry becomes exact here.
            hidden_recompute: as in :meth:`start_step` for the new plan (``None``: unchanged).
        """
        if not self._open:
            return
        if self._modules is not None:  # the failed attempt's log says nothing of the retry: not attributed
            modules, self._modules, self._logs = self._modules, None, None
            modules.__exit__(None, None, None)
        activations = self._saved is not None
        exact = self._live is not None or (activations and key is not None and key not in self._references)
        # the trackers are popped in the reverse order of start_step's pushes; the phase tracker (below) stays
        if self._live is not None:
            live, self._live = self._live, None
            exit_mode(live)
        if self._saved is not None:
            saved, self._saved = self._saved, None
            exit_saved_hooks(saved)
        self._interiors.clear()
        self._key = key if activations else None
        if hidden_recompute is not None:
            self._hidden_recompute = hidden_recompute
        self._replays = self._calibrations = 0
        self._replay_depth = 0
        if _has_allocator_counters(self.device):
            torch.cuda.reset_peak_memory_stats(self.device)
        if activations:
            self._saved = SavedBytes(self.device, self._static)
            self._saved.hooks.__enter__()
        if exact:
            if self._stance is None:
                self._stance = _force_eager()
            if self._total is not None:
                self._total.reset_peak()
            elif not _has_allocator_counters(self.device):
                self._total = LiveBytes(self.device)
                self._total.adopt(state)
                self._total.__enter__()
            self._live = LiveBytes(self.device, gate=torch.is_grad_enabled)
            self._live.__enter__()
        self._phase_peaks = {}
        self._reserved_peak = 0
        self._phase = "forward"
        self._phased = False

    def close(self) -> None:
        """Remove every hook and mode this meter installed (idempotent); an open step is discarded."""
        if self._live is not None:
            live, self._live = self._live, None
            exit_mode(live)
        if self._total is not None:
            total, self._total = self._total, None
            exit_mode(total)
        if self._saved is not None:
            saved, self._saved = self._saved, None
            exit_saved_hooks(saved)
        if self._replay_handle is not None:
            self._replay_handle.remove()
            self._replay_handle = None
        if self._stance is not None:
            stance, self._stance = self._stance, None
            stance.__exit__(None, None, None)
        if self._modules is not None:
            modules, self._modules = self._modules, None
            modules.__exit__(None, None, None)
        self._open = False

    def __del__(self) -> None:  # a meter dropped mid-step must not leave hooks behind
        try:
            if self._open:
                self.close()
        except Exception:
            pass

    # -- internals
    def _on_replay(self, owner: Any, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        saved = self._saved
        if saved is None:
            return fn(*args, **kwargs)
        self._replays += 1
        key = _replay_key(owner, args, kwargs, self.device.type)
        interior = self._interiors.get(key)
        self._replay_depth += 1
        try:
            if interior is not None and self._live is None:
                saved.note(saved.live + interior)
                return fn(*args, **kwargs)
            # calibration: follow the storages this replay creates (the outer hook cannot see them)
            start = saved.live
            # grad mode only, as in exact mode: no_grad allocations (FSDP2's all-gathers) are not activations
            scope = LiveBytes(self.device, skip=saved.tracked, gate=torch.is_grad_enabled)
            try:
                with scope:
                    return fn(*args, **kwargs)
            finally:  # also on the early-stop exception checkpoint raises to end a replay
                self._interiors[key] = scope.peak
                self._calibrations += 1
                saved.note(start + scope.peak)
        finally:
            self._replay_depth -= 1



@dataclass(frozen=True)
class _Reference:
    """What the exact reference step of a key measured: the two figures, their difference, its replays."""

    exact: int
    copies: int
    offset: int
    replays: int
    phases: Dict[str, int]
    size: Optional[float] = None


class _ReadingBox:
    reading: Optional[StepReading] = None


def _force_eager() -> Any:
    """Run compiled code eagerly until the returned object's ``__exit__`` (``None`` without the API)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else None


