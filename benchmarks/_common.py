"""Shared helpers for the scripts in ``benchmarks/``: environment header, models, memory tracker, timers, and the
CPU allocator's peak (:func:`allocation_peaks`, the one instrument that sees inside a compiled graph).

Nothing here imports Lightning. The activation numbers come from PyTorch's own live-tensor tracker
(``torch.distributed._tools.mem_tracker.MemTracker``), not from :mod:`lightning_ckpt.measure.meter`, so the benchmark
checks the plugin with an instrument the plugin does not own.

How the activation peak is read (and why not simply ``get_tracker_snapshot("peak")``):

* ``MemTracker.get_tracker_snapshot("peak")[device]`` is the breakdown *at the moment the Total peaked*. Its
  ``_MemRefType.ACT`` entry is therefore "activations when everything together was highest", which can be
  lower than the highest activation level of the step (gradients and temporaries shift when Total peaks).
  :class:`ActivationPeakTracker` keeps a running maximum of the ACT line itself, updated on every change to
  the tracker's current snapshot, per device.
* Stock ``MemTracker`` labels tensors created during backward as ``TEMP`` unless a module's forward
  pre-hook fired during backward (its heuristic for "we are inside an activation-checkpoint replay"). A replay
  that re-runs a function rather than an ``nn.Module`` call (a patched ``block.forward``, a residual add between
  two sub-modules) is then counted as ``TEMP`` and the replayed interior disappears from ACT.
  :class:`ActivationPeakTracker` also labels as ACT every tensor created in backward *while grad mode is on*:
  the autograd engine runs backward formulas with grad mode off (``create_graph=False``) and non-reentrant
  ``torch.utils.checkpoint`` replays the forward under ``torch.enable_grad()``, so this picks out exactly the
  recomputation. ``verify_tracker()`` checks both points on a hand-written chain whose answer is known.
"""

from __future__ import annotations

import copy
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint

MIB = 1024**2
_CPU = torch.device("cpu")

from lightning_ckpt.demos.gpt import GPT, GPTConfig  # noqa: E402

# ------------------------------------------------------------------------------------------ environment


def header_lines(argv: Optional[List[str]] = None) -> List[str]:
    """Torch version, threads and the exact command, for the top of every benchmark printout."""
    argv = sys.argv if argv is None else argv
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a test dependency
        tf = "not installed"
    return [
        f"command: {' '.join(shlex.quote(a) for a in [os.path.basename(sys.executable), *argv])}",
        f"torch {torch.__version__} | transformers {tf} | python {platform.python_version()} | "
        f"{platform.machine()} | torch.get_num_threads()={torch.get_num_threads()} | os.cpu_count()={os.cpu_count()}",
    ]


# ------------------------------------------------------------------------------------------ memory tracker


class ActivationPeakTracker(MemTracker):
    """``MemTracker`` that also keeps the running peak of the ACT line and counts replays as ACT.

    Use one instance per measured step (``MemTracker`` refuses a second iteration of the same root module).

    Attributes:
        act_peak: per device, the highest number of bytes labelled ACT at any moment inside the context.
    """

    def __init__(self, stock_labels: bool = False) -> None:
        super().__init__()
        self.act_peak: Dict[torch.device, int] = {}
        self._in_ac_by_hook = False
        self._stock_labels = stock_labels  # True: MemTracker's own ACT/TEMP labelling (for verify_tracker)

    # MemTracker decides the label of a new tensor with ``is_bw and not self._in_ac``; make replays ACT.
    @property
    def _in_ac(self) -> bool:  # type: ignore[override]
        if self._in_ac_by_hook or self._stock_labels:
            return self._in_ac_by_hook
        return self._mod_tracker.is_bw and torch.is_grad_enabled()

    @_in_ac.setter
    def _in_ac(self, value: bool) -> None:
        self._in_ac_by_hook = value

    def _update_snap(self, *args, **kwargs) -> None:  # type: ignore[override]
        super()._update_snap(*args, **kwargs)
        for dev, snap in self._curr_mem_snap.items():
            act = snap[_MemRefType.ACT]
            if act > self.act_peak.get(dev, 0):
                self.act_peak[dev] = act


class PhasePeakTracker(MemTracker):
    """``MemTracker`` with a running peak of its Total line per phase of a training step.

    :meth:`phase` starts a phase (``"forward"``, ``"backward"``, ``"optimizer"``): its peak starts from what is
    live at that moment, so a phase's figure is the highest memory reached while it ran, everything tracked
    included (the external model and optimizer state, and every tensor created inside the context).

    Attributes:
        phase_peaks: ``{phase: bytes}`` on ``device`` (the maximum over repeated phases, e.g. micro-batches).
    """

    def __init__(self, device: torch.device = _CPU) -> None:
        super().__init__()
        self.device = device
        self.phase_peaks: Dict[str, int] = {}
        self._phase: Optional[str] = None

    def _total(self) -> int:
        return int(self._curr_mem_snap.get(self.device, {}).get("Total", 0))

    def phase(self, name: str) -> None:
        self._phase = name
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self._total())

    def _update_snap(self, *args, **kwargs) -> None:  # type: ignore[override]
        super()._update_snap(*args, **kwargs)
        if self._phase is not None:
            self.phase_peaks[self._phase] = max(self.phase_peaks[self._phase], self._total())


def measure_phase_peaks(phases: List[Tuple[str, Callable[[], None]]], external: Tuple = ()) -> Dict[str, int]:
    """Run ``phases`` (``[(name, fn), ...]``, in order) under one :class:`PhasePeakTracker`; its phase peaks.

    ``external`` (modules, optimizers, tensors that exist before the call) are registered with ``track_external``.
    """
    gc.collect()
    tracker = PhasePeakTracker()
    if external:
        tracker.track_external(*external)
    with tracker:
        for name, fn in phases:
            tracker.phase(name)
            fn()
    return dict(tracker.phase_peaks)


@dataclass
class MemoryReading:
    """One tracked step, in bytes (CPU device)."""

    act_peak: int  # running max of the ACT line
    act_at_total_peak: int  # ACT entry of get_tracker_snapshot("peak") (for reference)
    total_peak: int  # peak of all tracked categories together

    def as_dict(self) -> Dict[str, int]:
        return dict(act_peak=self.act_peak, act_at_total_peak=self.act_at_total_peak, total_peak=self.total_peak)


def measure_memory(
    fn: Callable[[], None], external: Tuple = (), device: torch.device = _CPU, stock_labels: bool = False
) -> MemoryReading:
    """Run ``fn`` (one forward+backward) under a fresh :class:`ActivationPeakTracker`.

    ``external`` objects (modules, tensors) created before the call are registered with ``track_external``
    first; tensors registered that way are labelled PARAM/BUFFER/OTH and never ACT.
    """
    gc.collect()
    tracker = ActivationPeakTracker(stock_labels=stock_labels)
    if external:
        tracker.track_external(*external)
    with tracker:
        fn()
    peak = tracker.get_tracker_snapshot("peak").get(device, {})
    return MemoryReading(
        act_peak=int(tracker.act_peak.get(device, 0)),
        act_at_total_peak=int(peak.get(_MemRefType.ACT, 0)),
        total_peak=int(peak.get("Total", 0)),
    )


def measure_block_interior(block: nn.Module, shape: Tuple[int, ...], dtype=torch.float32) -> int:
    """ACT peak of one block's forward+backward alone, without its input boundary.

    The input (requires grad) and the output gradient are made outside the tracker and registered with
    ``track_external`` so that they count as OTH, not ACT: the reading is the block's interior plus its
    output, i.e. what replaying this block adds on top of the boundaries that are kept anyway.
    """
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape, dtype=dtype)

    def fn() -> None:
        out = block(x)
        out.backward(grad)

    reading = measure_memory(fn, external=(block, x, grad))
    block.zero_grad(set_to_none=True)
    return reading.act_peak


class _Chain(nn.Module):
    """``x + tanh(tanh(tanh(2x)))``: three saved tensors per block, one transient, one output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(torch.tanh(torch.tanh(x * 2)))


def verify_tracker(num_blocks: int = 6, numel: int = 1 << 18) -> List[Dict[str, float]]:
    """Check :class:`ActivationPeakTracker` on a chain of :class:`_Chain` blocks whose answer is known by hand.

    Units of S = one block-sized float32 tensor; the chain input is registered as OTH (not ACT).

    * ``none``: block k leaves its 3 tanh outputs; at the last block's add, 3(L-1) saved + input + 3 saved +
      output are alive and the input (block L-1's output) is still referenced: **3L + 2**.
    * every block under non-reentrant ``checkpoint`` (as a module or as a plain function): the forward peaks at
      (L-1) boundaries + 2 transients = L+1; in backward the L boundaries (out_1..out_L, the last one held by
      the caller) are alive while the last block is replayed: 2x, then tanh keeps 3 outputs and early stop skips
      the add: **L + 3**.

    Returns:
        One dict per case: ``measured`` (this tracker, running ACT max), ``stock`` (plain ``MemTracker``
        labelling, running ACT max), ``stock_peak_snapshot`` (ACT in ``get_tracker_snapshot("peak")`` of plain
        ``MemTracker``) and ``expected``, all in S. Raises ``AssertionError`` if ``measured`` is off.
    """
    S = numel * 4
    rows = []
    expected = {"none": 3 * num_blocks + 2, "checkpoint(module)": num_blocks + 3, "checkpoint(fn)": num_blocks + 3}
    for case, want in expected.items():
        readings = []
        for stock in (False, True):
            torch.manual_seed(0)
            blocks = [_Chain() for _ in range(num_blocks)]
            x0 = torch.randn(numel, requires_grad=True)

            def fn(x0=x0, blocks=blocks, case=case) -> None:
                x = x0
                for b in blocks:
                    if case == "none":
                        x = b(x)
                    elif case == "checkpoint(fn)":
                        x = checkpoint(b.forward, x, use_reentrant=False)
                    else:
                        x = checkpoint(b, x, use_reentrant=False)
                x.sum().backward()

            readings.append(measure_memory(fn, external=(x0,), stock_labels=stock))
        got = readings[0].act_peak / S
        rows.append(
            dict(
                case=case,
                measured=got,
                stock=readings[1].act_peak / S,
                stock_peak_snapshot=readings[1].act_at_total_peak / S,
                expected=float(want),
            )
        )
        # the scalar loss and its grad seed add a few bytes: compare to 1/1000 of S
        assert abs(got - want) < 1e-3, f"ActivationPeakTracker: {case}: measured {got:.4f} S, expected {want} S"
    return rows


# ------------------------------------------------------------------------------------------ models


def build_gpt(cfg: GPTConfig, seed: int = 0) -> GPT:
    """The demo GPT in training mode, seeded."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    model.train()
    return model


class HandCheckpointedGPT(nn.Module):
    """A GPT whose forward loops its blocks by hand with ``checkpoint(block, x, use_reentrant=False)``.

    It mirrors :meth:`lightning_ckpt.demos.gpt.GPT.forward` line for line; only the block loop differs. This is
    the baseline for the wrapper's own overhead.
    """

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        tr = self.gpt.transformer
        _, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = tr.drop(tr.wte(idx) + tr.wpe(pos))
        for block in tr.h:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.gpt.lm_head(tr.ln_f(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        return logits, loss


def build_hf_gpt2(n_layer: int, n_embd: int, n_head: int, n_positions: int, vocab_size: int, seed: int = 0):
    """A Hugging Face ``GPT2LMHeadModel`` from config (no download): all dropouts 0, SDPA attention, no cache."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()

    cfg = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        vocab_size=vocab_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        use_cache=False,
        bos_token_id=0,  # the GPT-2 default 50256 is outside a 512-token vocabulary
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    model.config.use_cache = False
    model.train()
    return model


def clone_model(model: nn.Module) -> nn.Module:
    """An identical copy (same weights, same mode)."""
    return copy.deepcopy(model)


# ------------------------------------------------------------------------------------------ timing


@dataclass
class StepTime:
    total: float  # zero_grad + forward + backward, wall seconds
    forward: float
    backward: float
    cpu_total: float  # the same intervals in process CPU seconds (all threads of this process)
    cpu_forward: float
    cpu_backward: float


def timed_step(model: nn.Module, forward: Callable[[], torch.Tensor]) -> StepTime:
    """``zero_grad(set_to_none=True)`` + forward + backward, timed with ``perf_counter`` (CPU: no sync needed).

    No optimizer step: the benchmark compares activation schedules, which the optimizer does not see.
    Process CPU time (``time.process_time``) is recorded beside wall time: on a shared machine other
    processes stretch wall time while barely changing the CPU seconds this process needs.
    """
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    model.zero_grad(set_to_none=True)
    c1, t1 = time.process_time(), time.perf_counter()
    loss = forward()
    c2, t2 = time.process_time(), time.perf_counter()
    loss.backward()
    t3, c3 = time.perf_counter(), time.process_time()
    del loss
    return StepTime(t3 - t0, t2 - t1, t3 - t2, c3 - c0, c2 - c1, c3 - c2)


def load_average() -> Optional[Tuple[float, float, float]]:
    """``os.getloadavg()`` where available (1, 5, 15 minutes), else ``None``."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())  # type: ignore[return-value]
    except (AttributeError, OSError):
        return None


def median(xs: List[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def mib(n: float) -> float:
    return n / MIB


# ------------------------------------------------------------------ the CPU allocator's peak (compiled or not)

GRAD_MARK = "lightning_ckpt.bench.grad:"


def _gradient_marks(params):
    """Mark, in the profile, the storage of every gradient handed to a parameter (before it is accumulated)."""

    def mark(grad):
        with record_function(f"{GRAD_MARK}{grad.untyped_storage().data_ptr()}"):
            pass

    return [p.register_hook(mark) for p in params if p.requires_grad]


def _allocations_and_marks(prof) -> Tuple[List[Tuple[int, int, int]], List[Tuple[int, int]]]:
    """CPU allocations ``(time, address, +/-bytes)`` in time order, and gradient marks ``(address, time)``."""
    allocations, marks = [], []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            allocations.append((node.start_time_ns, node.typed[1].ptr, node.typed[1].alloc_size))
        elif node.name.startswith(GRAD_MARK):
            marks.append((int(node.name[len(GRAD_MARK):]), node.start_time_ns))
    return sorted(allocations), marks


def _gradient_allocations(allocations, marks) -> set:
    """``(time, address)`` of the allocations that held a gradient when its parameter's hook saw it."""
    opened, lifetimes = {}, []
    for t, ptr, size in allocations:
        if size > 0:
            opened[ptr] = t
        else:
            lifetimes.append((ptr, opened.pop(ptr, None), t))
    found = set()
    for ptr, when in marks:
        for address, born, freed in lifetimes:
            if address == ptr and born is not None and born <= when <= freed:
                found.add((born, ptr))
                break
    return found


def allocation_peaks(step, params) -> Tuple[int, int]:
    """Peak bytes allocated on the CPU during ``step()`` above its starting level: ``(step, activations)``.

    ``step`` counts every allocation. ``activations`` leaves out the buffers that carried a parameter's new gradient
    to its ``.grad`` (found by the parameter's gradient hook, by address and lifetime): eager autograd frees each
    one as soon as it is accumulated, while a whole-model compiled backward returns every gradient from one graph
    at its end, so with ``.grad`` kept (gradient accumulation) it holds a parameter-sized set of buffers that no
    checkpointing policy creates or removes.
    """
    handles = _gradient_marks(params)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        for handle in handles:
            handle.remove()
    allocations, marks = _allocations_and_marks(prof)
    gradients = _gradient_allocations(allocations, marks)
    live = peak = kept = kept_peak = 0
    carrying = set()
    for t, ptr, size in allocations:
        live += size
        peak = max(peak, live)
        if size > 0 and (t, ptr) in gradients:
            carrying.add(ptr)
        elif size < 0 and ptr in carrying:
            carrying.discard(ptr)
        else:
            kept += size
            kept_peak = max(kept_peak, kept)
    return peak, kept_peak
