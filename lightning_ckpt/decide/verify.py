"""Equivalence check, block by block: does every checkpointed block compute what it computes plain?

The check of "loss and gradient behaviour on a fixed small batch", automated, in the regime being trained and within
the memory of the checkpointed step. :func:`verify_equivalence` runs the batch's forward once, under
``torch.no_grad()`` with every block plain, and keeps each checkpointed unit's inputs (a block, or the ``K`` blocks
of a ``group:K`` region as one unit), its autocast state and the random-number state it started from; the forward
stops as soon as the last unit's inputs are kept. Then, unit by unit, it runs the unit in its planned mode
(``recompute``, ``selective``, ``offload``, a group region, ``compiler:<f>``) and plain, each from that random-number
state, under the autocast it ran under in the forward, forward and backward (``torch.autograd.grad`` against one
fixed random cotangent per output), and compares the outputs, the gradients of the inputs and the gradients of the
unit's parameters; the unit's results are freed before the next unit runs.

Why block by block, not the whole step twice (what this check did before) nor a slice of the batch:

- memory: a whole plain step holds every block's interior at once, on exactly the runs that need checkpointing,
  and two full gradient copies on top. Block by block holds the unit boundaries (the tensors the checkpointed step
  keeps anyway; they are the forward's own tensors, not copies), one unit's interior, and one unit's results, the
  planned run's moved to host memory when they live on an accelerator. A slice of the batch would shrink the
  activations but not the gradients, and needs to know where the batch dimension of an arbitrary batch structure is.
- equivalence: when each unit gives the same outputs and the same vector-Jacobian product for the same inputs and
  cotangent, the chained step gives the same loss and gradients; a random cotangent (not ones, whose product is
  blind to, e.g., a softmax) makes a difference in any Jacobian show up.
- generic over batch structures and training steps: the forward runs as the user wrote it, and no backward or
  optimizer call of the training step is reached (manual optimization included).

Comparison: element-wise ``|a - b| <= max(atol, rtol * max|b|) + rtol * |b|`` with ``(rtol, atol)`` from
:data:`TOLERANCES`, keyed on the dtype the unit computed in: the autocast dtype when it ran under autocast (its
gradients are float32, but a backend may replay a bf16 kernel with another reduction order, a few bf16 ulps apart),
the tensors' own dtype otherwise (float32 on the CPU stays tight: recompute there is bitwise). The ``rtol * max|b|``
floor keeps elements near zero, which collect the rounding of large terms that cancel, from failing alone.

Parameter ``.grad``, buffers and the random-number state are left as they were (gradients go through
``torch.autograd.grad``, never into ``.grad``; buffers are copied to host memory and restored); Python-level state
a module mutates itself cannot be restored. Blocks compiled on their own run compiled, as in training; blocks
inside a whole-model compiled graph run eagerly (the kept inputs are taken eagerly in either case).

Verdicts beyond the numbers: a replay that ``torch.utils.checkpoint`` itself refuses (another shape, dtype or number
of saved tensors) and a unit input changed in place after the call (no checkpoint can replay it) are mismatches of
that unit. A block called more than once per forward is verified on its first call; a checkpointed block the
forward never calls is listed as not verified.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map
from torch.utils.checkpoint import CheckpointError

from lightning_ckpt.core.wrap import CheckpointPlan
from lightning_ckpt.decide.block_timing import BlockInput

__all__ = ["TOLERANCES", "BlockDiff", "EquivalenceError", "EquivalenceReport", "verify_equivalence"]

# (rtol, atol) per compute dtype, applied with the scale floor of the module docstring: torch.testing's defaults for
# float64 / float32 / bfloat16 (bf16's rtol is 2 x its eps); float16 at 2 x its eps too (torch.testing's 1e-3 is one
# ulp, less than a replay with another reduction order can differ)
TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (2e-3, 1e-5),
}
_COTANGENT_SEED = 20240


class EquivalenceError(AssertionError):
    """A checkpointed block's outputs or gradients differ from its plain run's beyond the dtype tolerance."""


@dataclass(frozen=True)
class BlockDiff:
    """One unit's comparison (a block, or a ``group:K`` region's blocks as one unit).

    Attributes:
        block: the block's name, or ``first…last`` for a group region.
        mode: the planned mode (``group`` for a region).
        max_abs: the largest absolute difference over the compared tensors.
        max_rel: the largest difference relative to its tensor's largest magnitude.
        worst: the tensor where ``max_rel`` was found (``output``, ``grad of args[0]``, ``grad of <param>``), or
            why the unit could not be compared.
        compared: how many tensors were compared.
        within_tolerance: every compared tensor is within the tolerance of :data:`TOLERANCES`.
    """

    block: str
    mode: str
    max_abs: float
    max_rel: float
    worst: str
    compared: int
    within_tolerance: bool


@dataclass(frozen=True)
class EquivalenceReport:
    """What :func:`verify_equivalence` ran and found.

    Attributes:
        plan: the plan verified (its policy and per-block modes).
        regime: the precision the units ran under (the trainer's precision when given, and the autocast state).
        tolerance: the ``(rtol, atol)`` used, per compute dtype seen.
        blocks: one row per checkpointed unit that ran on the batch.
        not_called: checkpointed blocks the forward never called (not verified).
    """

    plan: str
    regime: str
    tolerance: Tuple[Tuple[str, float, float], ...]
    blocks: Tuple[BlockDiff, ...]
    not_called: Tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(b.within_tolerance for b in self.blocks)

    def table(self) -> str:
        tol = ", ".join(f"{d} rtol {r:.1e} atol {a:.0e}" for d, r, a in self.tolerance) or "none used"
        lines = [f"plan {self.plan}, run under {self.regime}, block by block against 'off' "
                 f"(tolerance {tol}, floor rtol x max|tensor|)",
                 f"{'block':<32} {'mode':<12} {'max abs diff':>13} {'max rel diff':>13} {'tensors':>7}  worst"]
        for b in self.blocks:
            flag = "" if b.within_tolerance else "  <-- beyond tolerance" if b.compared else "  <-- failed"
            lines.append(f"{b.block:<32} {b.mode:<12} {b.max_abs:>13.3e} {b.max_rel:>13.3e} {b.compared:>7}  "
                         f"{b.worst}{flag}")
        if self.not_called:
            lines.append(f"not called on this batch, not verified: {', '.join(self.not_called)}")
        return "\n".join(lines)


def verify_equivalence(
    model: nn.Module,
    plan: CheckpointPlan,
    forward_fn: Callable[[], Any],
    *,
    context: Optional[Callable[[], ContextManager]] = None,
    precision: Optional[str] = None,
    raise_on_mismatch: bool = True,
) -> EquivalenceReport:
    """Compare every checkpointed unit of ``plan`` in its mode with the same unit plain (module docstring).

    Args:
        model: the module owning the blocks (its buffers are restored afterwards; its CUDA devices' RNG is forked).
        plan: the applied :class:`~lightning_ckpt.core.wrap.CheckpointPlan` to verify, as it is.
        forward_fn: runs the forward on a fixed batch (a training step, or ``lambda: model(x).sum()``); called once,
            under ``torch.no_grad()`` with every block plain, and stopped once the last checkpointed unit has its
            inputs. The autocast each block sees there (entered in ``forward_fn`` or by ``context``) is the one
            its unit runs under.
        context: returns the context the training step runs in (Lightning: the precision plugin's
            ``train_step_context``); entered around that forward and around each block's forward (not around the
            backward, which training runs outside it too).
        precision: a label for the report (Lightning's ``trainer.precision``).
        raise_on_mismatch: raise :class:`EquivalenceError` when a unit is beyond tolerance.

    Returns:
        The :class:`EquivalenceReport`: one row per checkpointed unit the forward called.

    Raises:
        EquivalenceError: a unit differs beyond tolerance (with ``raise_on_mismatch``).
    """
    context = context or contextlib.nullcontext
    units = _units(plan)
    # host copies: restoring must not need device memory the checkpointed step would not
    buffers = [(b, b.detach().to("cpu", copy=True)) for b in model.buffers()]
    rows: List[BlockDiff] = []
    dtypes, regimes = set(), set()
    devices = _cuda_devices(model)
    try:
        with torch.random.fork_rng(devices=devices):
            kept = _capture(plan, units, forward_fn, context, devices)
            _restore(buffers)
            for unit in units:
                if unit.index not in kept:
                    continue
                unit_kept = kept.pop(unit.index)  # its boundaries go once it is verified
                regimes.add(_autocast_label(unit_kept.inputs[0]))
                row, used = _verify_unit(plan, unit, unit_kept, context, buffers)
                rows.append(row)
                dtypes |= used
                del unit_kept
    finally:
        _restore(buffers)
    called = {r.block for r in rows}
    report = EquivalenceReport(
        plan=_describe_plan(plan),
        regime=", ".join(([f"precision {precision!r}"] if precision is not None else []) + sorted(regimes)),
        tolerance=tuple((str(d).replace("torch.", ""), *TOLERANCES.get(d, TOLERANCES[torch.float32]))
                        for d in sorted(dtypes, key=str)),
        blocks=tuple(rows),
        not_called=tuple(u.name for u in units if u.name not in called),
    )
    if raise_on_mismatch and not report.ok:
        raise EquivalenceError(
            "lightning_ckpt verify: a checkpointed block differs from its plain run on the same inputs and RNG "
            "state — it is not replay-safe (it reads mutable Python state, draws a data-dependent shape, or uses "
            "randomness outside torch's RNG). See the docs' Diagnosis page, 'Replay safety' (docs/diagnosis.md).\n"
            + report.table()
        )
    return report


# ------------------------------------------------------------------------------------------------ units


@dataclass(frozen=True)
class _Unit:
    """Blocks verified as one: a checkpointed block, or the members of a group region."""

    index: int  # its first block
    members: Tuple[int, ...]
    name: str
    mode: str


class _FromPrevious:
    """An input that is output leaf ``i`` of the previous member of the unit (recomputed in the unit's run, as the
    group region recomputes it)."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


@dataclass
class _Kept:
    """What the forward gave one unit: each member's inputs, their versions, the RNG state at the unit's start."""

    inputs: List[BlockInput]
    versions: List[Tuple[torch.Tensor, int]]
    rng: Any


class _Captured(BaseException):
    """Stops the forward once every unit has its inputs (a BaseException: ``except Exception`` in a training step
    does not swallow it)."""


def _units(plan: CheckpointPlan) -> List[_Unit]:
    groups = dict(plan.layout.groups)
    modes, names, units, i = plan.modes, plan.names, [], 0
    while i < plan.num_blocks:
        stop = groups.get(i)
        if stop is not None:
            units.append(_Unit(i, tuple(range(i, stop)), f"{names[i]}…{names[stop - 1]}", "group"))
            i = stop
            continue
        if modes[i] != "off":
            units.append(_Unit(i, (i,), names[i], modes[i]))
        i += 1
    return units


# ------------------------------------------------------------------------------------------------ capture


def _capture(plan: CheckpointPlan, units: Sequence[_Unit], forward_fn: Callable[[], Any],
             context: Callable[[], ContextManager], devices: List[int]) -> Dict[int, _Kept]:
    """Run the forward once (no grad, every block plain) and keep each unit's inputs; see the module docstring."""
    member_of = {b: (unit, pos) for unit in units for pos, b in enumerate(unit.members)}
    kept: Dict[int, _Kept] = {}
    links: Dict[int, Tuple[Dict[int, int], Any]] = {}  # unit -> ({id(output leaf): leaf index}, the output)
    waiting = {unit.index for unit in units}

    def pre_hook(index: int):
        @torch._dynamo.disable
        def hook(module, args, kwargs):
            unit, pos = member_of[index]
            entry = kept.get(unit.index)
            if pos == 0:
                if entry is not None:  # a block called twice: its first call is verified
                    return
                entry = kept[unit.index] = _Kept([], [], _rng_state(devices))
            elif entry is None or len(entry.inputs) != pos:  # not called in order: the region would not form
                return
            chain = links.pop(unit.index, ({}, None))[0] if pos else {}

            def keep(x):
                if not isinstance(x, torch.Tensor):
                    return x
                if id(x) in chain:
                    return _FromPrevious(chain[id(x)])
                alias = x.detach()  # the forward's own tensor (no copy); shares its version counter
                entry.versions.append((alias, alias._version))
                return alias

            entry.inputs.append(_block_input(tree_map(keep, args), tree_map(keep, kwargs)))
            if pos == len(unit.members) - 1:
                waiting.discard(unit.index)
                if not waiting:
                    raise _Captured

        return hook

    def post_hook(index: int):
        @torch._dynamo.disable
        def hook(module, args, output):
            unit, pos = member_of[index]
            entry = kept.get(unit.index)
            if pos < len(unit.members) - 1 and entry is not None and len(entry.inputs) == pos + 1:
                leaves = tree_flatten(output)[0]
                links[unit.index] = ({id(t): i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}, output)

        return hook

    handles = []
    for index in member_of:
        block = plan.blocks[index]
        handles.append(block.register_forward_pre_hook(pre_hook(index), with_kwargs=True))
        handles.append(block.register_forward_hook(post_hook(index)))
    try:
        with plan.plain(list(member_of)), torch.no_grad(), _eager(), context():
            forward_fn()
    except _Captured:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return {i: k for i, k in kept.items() if len(k.inputs) == len(member_of[i][0].members)}


def _block_input(args, kwargs) -> BlockInput:
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    device_type = tensors[0].device.type if tensors else "cpu"
    autocast = None
    if torch.is_autocast_enabled(device_type):
        autocast = (torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled())
    return BlockInput(args, kwargs, device_type, autocast)


def _eager():
    """Compiled code runs its Python for the capture forward (the hooks see every block; torch >= 2.6)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------ one unit


def _verify_unit(plan: CheckpointPlan, unit: _Unit, kept: _Kept, context: Callable[[], ContextManager],
                 buffers: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[BlockDiff, set]:
    moved = [t for t, version in kept.versions if t._version != version]
    if moved:
        return BlockDiff(unit.name, unit.mode, float("nan"), float("nan"),
                         "an input was modified in place after the block's call: checkpointing cannot replay it",
                         0, False), set()
    blocks = [plan.blocks[i] for i in unit.members]
    ids = {id(b) for block in blocks for b in block.buffers()}
    own_buffers = [(b, copy) for b, copy in buffers if id(b) in ids]
    params, seen = [], set()
    for i, block in zip(unit.members, blocks):
        for name, p in block.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append((f"{plan.names[i]}.{name}", p))
    prefixes = [f"{plan.names[i]} " if len(blocks) > 1 else "" for i in unit.members]
    try:
        planned = _run(blocks, prefixes, kept, context, params, stash=True)
    except CheckpointError as err:  # torch's own check saw the replay differ (shapes, dtypes, tensor count)
        _restore(own_buffers)
        reason = str(err).splitlines()[0].removeprefix("torch.utils.checkpoint: ")
        return BlockDiff(unit.name, unit.mode, float("nan"), float("nan"), f"its replay failed: {reason}", 0,
                         False), set()
    _restore(own_buffers)
    with plan.plain(unit.members):
        plain = _run(blocks, prefixes, kept, context, params, stash=False)
    _restore(own_buffers)
    autocast = kept.inputs[0].autocast
    return _compare(unit, planned, plain, autocast[0] if autocast else None)


def _run(blocks: Sequence[nn.Module], prefixes: Sequence[str], kept: _Kept, context: Callable[[], ContextManager],
         params: Sequence[Tuple[str, torch.Tensor]], stash: bool) -> Dict[str, Optional[torch.Tensor]]:
    """One forward and backward of the unit as the plan runs it now; outputs and gradients by name."""
    _set_rng_state(kept.rng)
    leaves: List[Tuple[str, torch.Tensor]] = []
    outputs: List[Tuple[str, torch.Tensor]] = []
    previous: Optional[list] = None
    with torch.enable_grad():
        for block, prefix, block_input in zip(blocks, prefixes, kept.inputs):
            args, kwargs = block_input.fresh()
            leaves += _named(prefix, "args", args) + _named(prefix, "kwargs", kwargs)
            if previous is not None:
                fill = lambda x, p=previous: p[x.i] if isinstance(x, _FromPrevious) else x  # noqa: E731
                args, kwargs = tree_map(fill, args), tree_map(fill, kwargs)
            with context(), block_input.context():
                out = block(*args, **kwargs)
            previous = tree_flatten(out)[0]
            outputs += [(f"{prefix}output{keystr(path)}", t) for path, t in tree_flatten_with_path(out)[0]
                        if isinstance(t, torch.Tensor)]
    differentiable = [t for _, t in outputs if t.requires_grad]
    wrt = [t for _, t in leaves] + [p for _, p in params]
    grads: Sequence[Optional[torch.Tensor]] = [None] * len(wrt)
    if differentiable and wrt:  # outside the autocast context, as training's backward
        grads = torch.autograd.grad(differentiable, wrt, _cotangents(differentiable), allow_unused=True)
    keep = _to_host if stash else (lambda t: t)
    result: Dict[str, Optional[torch.Tensor]] = {name: keep(t.detach()) for name, t in outputs}
    for (name, _), g in zip([*leaves, *params], grads):
        result[f"grad of {name}"] = None if g is None else keep(g)
    return result


def _named(prefix: str, label: str, tree) -> List[Tuple[str, torch.Tensor]]:
    return [(f"{prefix}{label}{keystr(path)}", t) for path, t in tree_flatten_with_path(tree)[0]
            if isinstance(t, torch.Tensor) and t.requires_grad]


def _cotangents(outputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The same random cotangents in both runs: a private generator, so training's random stream is untouched."""
    out = []
    for k, t in enumerate(outputs):
        generator = torch.Generator(device=t.device).manual_seed(_COTANGENT_SEED + k)
        if t.is_floating_point() or t.is_complex():
            out.append(torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype))
        else:
            out.append(torch.ones_like(t))
    return out


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """The planned run's results wait in host memory while the plain run holds the device."""
    return t if t.device.type == "cpu" else t.to("cpu")


# ------------------------------------------------------------------------------------------------ comparing


def _compare(unit: _Unit, planned: Dict[str, Optional[torch.Tensor]], plain: Dict[str, Optional[torch.Tensor]],
             autocast_dtype: Optional[torch.dtype]) -> Tuple[BlockDiff, set]:
    max_abs = max_rel = 0.0
    worst, worst_failing, failing_rel, ok, compared, dtypes = "-", None, -1.0, True, 0, set()
    for name in dict.fromkeys([*planned, *plain]):
        a, b = planned.get(name), plain.get(name)
        if a is None and b is None:
            continue
        compared += 1
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            ok, worst_failing, failing_rel = False, f"{name} (differs in presence, shape or dtype)", float("inf")
            continue
        dtype = autocast_dtype or b.dtype
        dtypes.add(dtype if dtype in TOLERANCES else torch.float32)
        abs_err, rel_err, within = _difference(a.to(b.device), b, dtype)
        if abs_err != abs_err or abs_err > max_abs:  # NaN first
            max_abs = abs_err
        if rel_err != rel_err or rel_err >= max_rel:
            max_rel, worst = rel_err, name
        if not within:
            ok = False
            if not rel_err <= failing_rel:
                worst_failing, failing_rel = name, rel_err
    worst = worst_failing or (worst if max_abs else "-")  # identical everywhere: no tensor is worst
    return BlockDiff(unit.name, unit.mode, max_abs, max_rel, worst, compared, ok), dtypes


def _difference(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> Tuple[float, float, bool]:
    """(max abs difference, that relative to ``b``'s largest magnitude, within tolerance)."""
    if not b.numel():
        return 0.0, 0.0, True
    rtol, atol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    af, bf = a.float(), b.float()
    same = (af == bf) | (af.isnan() & bf.isnan())  # equal infinities and NaNs in both places are equal
    diff = (af - bf).abs().masked_fill(same, 0.0)
    magnitude = bf.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    scale = magnitude.max().item()
    within = bool((diff <= max(atol, rtol * scale) + rtol * magnitude).all())
    abs_err = diff.max().item()
    return abs_err, abs_err / max(scale, torch.finfo(torch.float32).tiny), within


# ------------------------------------------------------------------------------------------------ describing


def _describe_plan(plan: CheckpointPlan) -> str:
    counts = Counter(plan.modes)
    parts = [f"{mode} x{n}" for mode, n in counts.items() if mode != "off"]
    if plan.layout.groups:
        parts.append(f"{len(plan.layout.groups)} group region{'s' if len(plan.layout.groups) > 1 else ''}")
    if counts.get("off"):
        parts.append(f"off x{counts['off']}")
    return f"{plan.spec!r} ({', '.join(parts)})"


def _autocast_label(block_input: BlockInput) -> str:
    if block_input.autocast is None:
        return f"no autocast ({block_input.device_type})"
    return f"autocast {block_input.device_type} {str(block_input.autocast[0]).replace('torch.', '')}"


# ------------------------------------------------------------------------------------------------ state


def _cuda_devices(model: nn.Module) -> List[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _rng_state(devices: Sequence[int]):
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices]


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for device, s in cuda:
        torch.cuda.set_rng_state(s, device)


def _restore(buffers: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buf, saved in buffers:
            buf.copy_(saved)
