"""Time one block in each checkpointing mode on its own: the budget's time costs when the blocks run compiled.

Inside a compiled graph a block's forward and its replay are invisible to Python hooks, and their eager times are
the wrong prices: a compiled replay of pointwise ops fuses into the backward's kernels and costs almost nothing,
while eagerly it costs one kernel launch and one memory pass per op. On the demo GPT (8 blocks × 256, micro-batch
4 × 256, CPU) compiled block by block, a ``selective`` block added 0.0–0.3 ms per step against 24 ms for a
recompute; priced eagerly, the budget chose full recompute where ``selective`` fit and was nearly free.

:func:`time_block_modes` therefore runs the block alone, as it runs in training (its compiled callable, the
captured input, the training step's autocast state), forward and backward, in every mode: one untimed call per mode
first (it compiles that mode's graph), then ``repeats`` rounds in rotating order. A mode's cost is the median over
rounds of its time minus ``off``'s time *in the same round*, so a slow drift of a shared machine cancels. The
backward is ``torch.autograd.grad`` with respect to the block's floating-point inputs only: no ``.grad`` is
touched (gradient accumulation and DDP's gradient hooks never see these calls) and the replay, which is what
differs between modes, runs in full. The random-number state is forked, so dropout in the training steps draws
what it would have drawn without the timing.

:func:`saved_block_bytes` measures what the block's compiled graph keeps for backward in each mode, the same way
(alone, its captured input): the ``compiler:<fraction>`` modes exist only inside a compiled graph, so an eager bytes
step cannot see what they keep. An outer ``saved_tensors_hooks`` sees the tensors a compiled graph saves (AOTAutograd
packs them through the hooks at run time), counted once per storage, the parameters and the block's inputs left out.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["BlockInput", "capture_block_input", "saved_block_bytes", "time_block_modes"]


@dataclass(frozen=True)
class BlockInput:
    """A block's arguments on a training forward (detached copies) and the autocast state it ran under."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    device_type: str
    autocast: Optional[Tuple[torch.dtype, bool]]  # (dtype, cache enabled), or None when autocast was off

    def context(self):
        """The training step's autocast, re-entered."""
        if self.autocast is None:
            return contextlib.nullcontext()
        dtype, cache = self.autocast
        return torch.autocast(self.device_type, dtype=dtype, cache_enabled=cache)

    def fresh(self) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """New leaves for one call: floating-point tensors require grad (the backward is taken w.r.t. them)."""

        def leaf(value):
            if isinstance(value, torch.Tensor):
                return value.detach().requires_grad_(value.is_floating_point())
            return value

        return tree_map(leaf, self.args), tree_map(leaf, self.kwargs)


def capture_block_input(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> BlockInput:
    """Copy a block's call (inside its forward pre-hook) for :func:`time_block_modes`."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    device_type = tensors[0].device.type if tensors else "cpu"
    copy = tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
    autocast = None
    if torch.is_autocast_enabled(device_type):
        autocast = (torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled())
    return BlockInput(copy[0], copy[1], device_type, autocast)


@contextlib.contextmanager
def _alone(set_mode: Callable[[str], None], block_input: BlockInput):
    """Around a block's solo runs: the random-number state forked (training's dropout draws are untouched), grad
    on, and the block left ``off`` whatever happens."""
    devices = [torch.cuda.current_device()] if block_input.device_type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            yield
    finally:
        set_mode("off")


def _forward_backward(call: Callable, block_input: BlockInput, pack: Optional[Callable] = None) -> None:
    args, kwargs = block_input.fresh()
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack) if pack else contextlib.nullcontext()
    with block_input.context(), hooks:
        out = call(*args, **kwargs)
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if outputs and leaves:
        torch.autograd.grad(outputs, leaves, [torch.ones_like(t) for t in outputs], allow_unused=True)


def time_block_modes(call: Callable, set_mode: Callable[[str], None], block_input: BlockInput,
                     modes: Sequence[str], repeats: int = 5,
                     synchronize: Optional[Callable[[], None]] = None) -> Dict[str, float]:
    """Seconds each of ``modes`` adds to one forward + backward of a block over ``off`` (see the module docstring).

    Args:
        call: runs the block as training runs it (its compiled callable when it is compiled).
        set_mode: puts the block in a mode (``off`` and each of ``modes``); left ``off`` on return.
        block_input: from :func:`capture_block_input`.
        modes: the modes to price (``off`` is the reference and need not be listed).
        repeats: timed rounds (after one untimed call per mode).
        synchronize: called around each timed call (``torch.cuda.synchronize`` on a GPU).

    Returns:
        ``{mode: seconds added}`` (never negative), one entry per mode in ``modes`` other than ``off``.
    """
    sync = synchronize or (lambda: None)
    order = ["off", *[m for m in modes if m != "off"]]
    times: Dict[str, list] = {m: [] for m in order}
    with _alone(set_mode, block_input):
        for mode in order:  # the first call of a mode compiles its graph: not timed
            set_mode(mode)
            _forward_backward(call, block_input)
        for r in range(repeats):
            for mode in order[r % len(order):] + order[:r % len(order)]:
                set_mode(mode)
                sync()
                t0 = time.perf_counter()
                _forward_backward(call, block_input)
                sync()
                times[mode].append(time.perf_counter() - t0)
    return {m: max(statistics.median(t - off for t, off in zip(times[m], times["off"])), 0.0) for m in order[1:]}


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def saved_block_bytes(call: Callable, set_mode: Callable[[str], None], block_input: BlockInput,
                      modes: Sequence[str], exclude: Sequence[torch.Tensor] = ()) -> Dict[str, int]:
    """Bytes the block keeps for backward in each of ``modes``, run alone as training runs it (module docstring).

    Args:
        call, set_mode, block_input: as for :func:`time_block_modes` (``set_mode`` is left at ``off``).
        modes: the modes to measure (``off`` included if wanted).
        exclude: tensors whose storages are not counted (the block's parameters).

    Returns:
        ``{mode: bytes}``: distinct storages saved during the forward, less ``exclude`` and the block's inputs.
    """
    inputs = [t for t in tree_flatten((block_input.args, block_input.kwargs))[0] if isinstance(t, torch.Tensor)]
    skip = {t.untyped_storage().data_ptr() for t in (*exclude, *inputs)}  # fresh() leaves share these storages
    out: Dict[str, int] = {}
    with _alone(set_mode, block_input):
        for mode in modes:
            set_mode(mode)
            seen: Dict[int, int] = {}

            def pack(tensor: torch.Tensor, seen=seen) -> torch.Tensor:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in skip:
                    seen[storage.data_ptr()] = storage.nbytes()
                return tensor

            _forward_backward(call, block_input, pack)
            out[mode] = sum(seen.values())
    return out
