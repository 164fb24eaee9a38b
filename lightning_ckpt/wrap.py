"""Checkpoint blocks in place: non-reentrant, RNG-preserving, switchable per block without re-wrapping.

Each selected block gets an instance attribute ``forward`` (a :class:`_BlockForward`) that decides at every
call whether to run the plain forward or a checkpointed one. Nothing is re-parented, so ``state_dict()`` keys,
``named_parameters()``, ``named_modules()`` and ``named_buffers()`` never change (unlike
``torch.distributed...checkpoint_wrapper``, which inserts ``_checkpoint_wrapped_module.``). The block's own
forward hooks run once per call; only the body of ``forward`` is replayed.

Modes (per block, changeable at any time through :class:`CheckpointPlan`):

- ``off``: the plain forward.
- ``recompute``: ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.
- ``selective``: the same with ``create_selective_checkpoint_contexts`` keeping the outputs of the policy's
  save list (matmuls and attention by default) and recomputing the rest.
- ``offload``: no recompute; tensors saved for backward move to (pinned) host memory and come back in
  backward. Tensors already on the CPU stay where they are, so on a CPU-only machine this mode is a no-op.

``group:K`` policies make K consecutive ``recompute`` blocks one region: the region opens when its first block
is called and closes after its last block returns; in backward the blocks are replayed back to back. Block
inputs that are exactly the previous block's outputs are recomputed; every other input (masks, position
tensors, or a hidden state the parent changed between blocks) is kept as it was. Tensors saved by the parent's
own code between two blocks are stored normally, outside the region.

Recompute happens only while the block is training and grad is enabled: ``eval()``, ``torch.no_grad()`` and
``torch.inference_mode()`` always take the plain forward.

Replays can be observed with :func:`register_replay_hook` (the activation meter measures the transient interior
of a block while it is replayed in backward this way). Without a registered hook nothing extra runs.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils.checkpoint as _cp
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_ckpt.blocks import BlockSelector, describe_blocks, find_blocks
from lightning_ckpt.policy import MODES, Layout, ModesPolicy, Policy, parse_policy

__all__ = [
    "MODES",
    "CheckpointPlan",
    "ForeignCheckpointingError",
    "apply_policy",
    "get_plan",
    "register_replay_hook",
    "remove_checkpointing",
]

_PLAN_ATTR = "_lightning_ckpt_plan"
_DETERMINISM_CHECKS = ("default", "none")
_STATE_VERSION = 1


class ForeignCheckpointingError(ValueError):
    """The model already holds activation checkpointing applied by another library."""


@dataclass(frozen=True)
class _Options:
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False


class _Shared:
    """State every block of one plan reads on the hot path: checkpoint options and the SAC save list."""

    def __init__(self, options: _Options) -> None:
        self.options = options
        self.set_save_ops(())

    def set_save_ops(self, names: Sequence[str]) -> None:
        self.save_ops = frozenset(getattr(torch.ops.aten, n) for n in names)
        self._selective = functools.partial(_cp.create_selective_checkpoint_contexts, self._save_or_recompute)

    def _save_or_recompute(self, ctx, op, *args, **kwargs):
        # packets, so every overload of a listed op (mm.default, mm.out, ...) is kept
        if getattr(op, "overloadpacket", op) in self.save_ops:
            return _cp.CheckpointPolicy.MUST_SAVE
        return _cp.CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn(self, mode: str):
        return self._selective if mode == "selective" else _cp.noop_context_fn

    def checkpoint_kwargs(self, mode: str) -> Dict[str, Any]:
        o = self.options
        kwargs = dict(
            use_reentrant=False,
            preserve_rng_state=o.preserve_rng_state,
            determinism_check=o.determinism_check,
            debug=o.debug,
            context_fn=self.context_fn(mode),
        )
        if mode == "selective" and _SAC_RESPECTS_HOOKS:
            # tensors SAC keeps then pass through outer saved-tensor hooks (offload, the activation meter)
            kwargs["respect_saved_tensors_hooks"] = True
        return kwargs


_SAC_RESPECTS_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(_cp.checkpoint).parameters
_RESERVED_KWARGS = frozenset(inspect.signature(_cp.checkpoint).parameters) - {"args", "kwargs"}


class _BlockForward:
    """The callable installed as ``block.forward``; see the module docstring."""

    def __init__(self, block: nn.Module, index: int, name: str, shared: _Shared) -> None:
        self.block = block
        self.index = index
        self.name = name
        self.shared = shared
        self.mode = "off"
        self.region: Optional[_GroupRegion] = None
        prior = block.__dict__.get("forward")
        # an instance-level forward set by someone else (e.g. accelerate hooks) must keep running
        if inspect.ismethod(prior) and prior.__self__ is block:
            prior = prior.__func__
        self.prior = prior

    def run(self, *args, **kwargs):
        """The block's own forward, whatever the mode."""
        if self.prior is None:
            return type(self.block).forward(self.block, *args, **kwargs)
        if inspect.isfunction(self.prior):
            return self.prior(self.block, *args, **kwargs)
        return self.prior(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        mode = self.mode
        if mode == "off" or not (self.block.training and torch.is_grad_enabled()):
            return self.run(*args, **kwargs)
        if self.region is not None:
            return self.region.call(self, args, kwargs)
        if mode == "offload":
            with _OffloadToHost():
                return self.run(*args, **kwargs)
        fn = _observed(self, self.run) if _REPLAY_HOOKS else self.run
        if _RESERVED_KWARGS.intersection(kwargs):
            return _cp.checkpoint(lambda *a: fn(*a, **kwargs), *args, **self.shared.checkpoint_kwargs(mode))
        return _cp.checkpoint(fn, *args, **self.shared.checkpoint_kwargs(mode), **kwargs)

    def __repr__(self) -> str:
        return f"<lightning_ckpt forward of {self.name} mode={self.mode}>"


class _OffloadToHost(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors go to (pinned) host memory in forward and come back in backward."""

    def __init__(self) -> None:
        super().__init__(_pack_to_host, _unpack_from_host)


def _pack_to_host(tensor: torch.Tensor):
    if tensor.device.type == "cpu":
        return tensor
    pinned = torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
    host.copy_(tensor, non_blocking=pinned)
    return tensor.device, host


def _unpack_from_host(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=host.is_pinned())


# ---------------------------------------------------------------------------------------------- replay hooks

_REPLAY_HOOKS: List[Callable[..., Any]] = []


class _ReplayHookHandle:
    """Returned by :func:`register_replay_hook`; ``remove()`` unregisters the hook (idempotent)."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def remove(self) -> None:
        for i in range(len(_REPLAY_HOOKS) - 1, -1, -1):
            if _REPLAY_HOOKS[i] is self.hook:
                del _REPLAY_HOOKS[i]
                return

    def __enter__(self) -> "_ReplayHookHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def register_replay_hook(hook: Callable[..., Any]) -> _ReplayHookHandle:
    """Observe every backward replay of a checkpointed region (all plans, all models).

    ``hook(owner, fn, args, kwargs)`` is called instead of ``fn(*args, **kwargs)`` each time a region is
    recomputed in backward, and must call ``fn(*args, **kwargs)`` exactly once and return its result (it may
    do work before and after, e.g. push a ``TorchDispatchMode``). ``owner`` is the block's forward object
    (attributes ``index``, ``name``, ``mode``, ``block``, ``shared``) for a block that is its own region, or the
    group region (attribute ``members``: the forward objects of its blocks, in order) for ``group:K``. The
    first, forward execution of a region is not reported. Only regions entered while at least one hook is
    registered are observed. Hooks registered later wrap earlier ones.

    Returns:
        A handle whose ``remove()`` unregisters the hook.
    """
    if not callable(hook):
        raise TypeError(f"register_replay_hook: hook={hook!r} is not callable; pass a function "
                        "hook(owner, fn, args, kwargs) that calls fn(*args, **kwargs) and returns its result.")
    _REPLAY_HOOKS.append(hook)
    return _ReplayHookHandle(hook)


def _notify_replay(owner: Any, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]):
    for hook in _REPLAY_HOOKS[:-1]:
        fn = functools.partial(_call_hook, hook, owner, fn)
    return _REPLAY_HOOKS[-1](owner, fn, args, kwargs) if _REPLAY_HOOKS else fn(*args, **kwargs)


def _call_hook(hook, owner, fn, *args, **kwargs):
    return hook(owner, fn, args, kwargs)


def _observed(owner: Any, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` as handed to ``checkpoint``: the first call is the forward, every later call a replay."""
    calls = 0

    def body(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1 or not _REPLAY_HOOKS:
            return run(*args, **kwargs)
        return _notify_replay(owner, run, args, kwargs)

    return body


# --------------------------------------------------------------------------------------------- group regions


class _FromPrevious:
    """Placeholder for an input that is output leaf ``i`` of the previous block in the region."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _PassThrough(torch.autograd.graph.saved_tensors_hooks):
    """Saves tensors normally; pushed between two blocks so the parent's own saves escape the region."""

    def __init__(self) -> None:
        super().__init__(_identity, _identity)


def _identity(x):
    return x


def _frame_generator(fn, args, kwargs, options: _Options):
    """Open a non-reentrant checkpoint frame around code we do not call ourselves (torch private API)."""
    impl = getattr(_cp, "_checkpoint_without_reentrant_generator_impl", None)
    config = dict(
        preserve_rng_state=options.preserve_rng_state,
        context_fn=_cp.noop_context_fn,
        determinism_check=options.determinism_check,
        debug=options.debug,
    )
    if impl is not None:
        return impl(fn, args, kwargs, **config)
    legacy = _cp._checkpoint_without_reentrant_generator
    positional = [fn, *config.values()]
    if "early_stop" in inspect.signature(legacy).parameters:
        positional.append(True)
    return legacy(*positional, *args, **kwargs)


class _GroupRegion:
    """Consecutive blocks replayed as one checkpointed region (``group:K``)."""

    def __init__(self, members: List[_BlockForward], anchor: nn.Module) -> None:
        self.members = members
        self.anchor = anchor  # closest called ancestor; its forward hook closes a region left open
        self._reset()
        anchor.register_forward_hook(self._close_if_open, always_call=True)

    def _reset(self) -> None:
        self.gen = None
        self.records: List[Tuple[_BlockForward, Any, Any]] = []
        self.next = 0
        self.prev_leaves: Dict[int, int] = {}
        self.between: Optional[_PassThrough] = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(gen=None, records=[], next=0, prev_leaves={}, between=None)
        return state

    def call(self, member: _BlockForward, args, kwargs):
        if member is self.members[0]:
            self._close(warn=self.gen is not None)
            return self._open(member, args, kwargs)
        if self.gen is None or member is not self.members[self.next]:
            self._close(warn=self.gen is not None)
            return _cp.checkpoint(member.run, *args, **member.shared.checkpoint_kwargs("recompute"), **kwargs)
        self.between.__exit__(None, None, None)
        self.between = None
        self.records.append((member, *self._template(args, kwargs)))
        return self._step(member, args, kwargs)

    def _open(self, first: _BlockForward, args, kwargs):
        self.records = [(first, None, None)]
        self.gen = _frame_generator(self._replay, args, kwargs, first.shared.options)
        next(self.gen)
        self.next = 0
        return self._step(first, args, kwargs)

    def _step(self, member: _BlockForward, args, kwargs):
        try:
            out = member.run(*args, **kwargs)
        except BaseException as err:
            self._abort(err)
            raise
        self.next += 1
        if self.next == len(self.members):
            self._finish()
        else:
            leaves, _ = tree_flatten(out)
            self.prev_leaves = {id(t): i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
            self.between = _PassThrough()
            self.between.__enter__()
        return out

    def _template(self, args, kwargs):
        def mark(x):
            i = self.prev_leaves.get(id(x)) if isinstance(x, torch.Tensor) else None
            return x if i is None else _FromPrevious(i)

        return tree_map(mark, args), tree_map(mark, kwargs)

    def _replay(self, *first_args, **first_kwargs):
        if _REPLAY_HOOKS:
            return _notify_replay(self, self._replay_members, first_args, first_kwargs)
        return self._replay_members(*first_args, **first_kwargs)

    def _replay_members(self, *first_args, **first_kwargs):
        out = self.records[0][0].run(*first_args, **first_kwargs)
        for member, args, kwargs in self.records[1:]:
            leaves, _ = tree_flatten(out)
            fill = lambda x, leaves=leaves: leaves[x.i] if isinstance(x, _FromPrevious) else x  # noqa: E731
            out = member.run(*tree_map(fill, args), **tree_map(fill, kwargs))

    def _finish(self) -> None:
        gen, records = self.gen, self.records
        self._reset()
        self.records = records  # the replay closure reads them in backward
        try:
            next(gen)
        except StopIteration:
            pass

    def _abort(self, err: BaseException) -> None:
        if self.between is not None:
            self.between.__exit__(None, None, None)
        gen = self.gen
        self._reset()
        if gen is not None:
            try:
                gen.throw(err)
            except BaseException:
                pass

    def _close(self, warn: bool) -> None:
        if self.gen is None:
            return
        if warn:
            names = [m.name for m in self.members]
            warnings.warn(
                f"lightning_ckpt: group region {names[0]}…{names[-1]} was left open: its blocks were not "
                f"called back to back in order ({len(self.members)} expected, {self.next} seen). The region "
                "was closed early; if this repeats, use 'all' or 'every:N' instead of 'group:K'.",
                RuntimeWarning,
                stacklevel=4,
            )
        if self.between is not None:
            self.between.__exit__(None, None, None)
            self.between = None
        self._finish()

    def _close_if_open(self, module, args, output):
        self._close(warn=True)

    def detach(self) -> None:
        self._close(warn=False)
        for hooks in (self.anchor._forward_hooks, getattr(self.anchor, "_forward_hooks_always_called", {})):
            for key in [k for k, h in hooks.items() if getattr(h, "__self__", None) is self]:
                del hooks[key]


# ------------------------------------------------------------------------------------------------------ plan


class CheckpointPlan:
    """Which blocks of a model are checkpointed and how; re-targetable in place.

    Obtained from :func:`apply_policy` (or :func:`get_plan`). Changing the policy or the per-block modes flips
    an attribute on each block's forward: no module is re-wrapped, so parameters, optimizer state, DDP/FSDP
    wrappers and module paths are untouched.

    Attributes:
        names: fully qualified block names relative to the model given to :func:`apply_policy`.
        policy: the current :class:`~lightning_ckpt.policy.Policy`.
    """

    def __init__(self, model: nn.Module, found: List[Tuple[str, nn.Module]], options: _Options) -> None:
        self.names: Tuple[str, ...] = tuple(n for n, _ in found)
        self.shared = _Shared(options)
        self._forwards = [_BlockForward(block, i, name, self.shared) for i, (name, block) in enumerate(found)]
        # resolved now: an ancestor wrapped later (FSDP) would change the paths
        self._anchors = [_anchor(model, name) for name, _ in found]
        self._regions: List[_GroupRegion] = []
        self._model_name = type(model).__name__
        self._root = model
        self.policy: Policy = parse_policy("none")
        self.layout: Layout = Layout(("off",) * len(found))
        for fwd, (_, block) in zip(self._forwards, found):
            block.forward = fwd

    # -- reading
    @property
    def spec(self) -> str:
        return self.policy.spec

    @property
    def modes(self) -> Tuple[str, ...]:
        return tuple(f.mode for f in self._forwards)

    @property
    def num_checkpointed(self) -> int:
        return sum(f.mode != "off" for f in self._forwards)

    @property
    def num_blocks(self) -> int:
        return len(self._forwards)

    @property
    def blocks(self) -> List[nn.Module]:
        return [f.block for f in self._forwards]

    @property
    def options(self) -> Dict[str, Any]:
        return dict(vars(self.shared.options))

    # -- changing
    def retarget(self, policy: Union[str, Policy]) -> "CheckpointPlan":
        """Switch to another policy in place (between optimizer steps, never inside one)."""
        policy = parse_policy(policy)
        layout = policy.layout(self.num_blocks)
        self._install(layout)
        self.policy = policy
        return self

    def set_modes(self, modes: Sequence[str]) -> "CheckpointPlan":
        """Set each block's mode explicitly (``len(modes)`` must equal the number of blocks)."""
        return self.retarget(ModesPolicy(tuple(modes), self.layout.save_ops))

    def _install(self, layout: Layout) -> None:
        for region in self._regions:
            region.detach()
        self._regions = []
        self.shared.set_save_ops(layout.save_ops)
        for fwd, mode in zip(self._forwards, layout.modes):
            fwd.mode, fwd.region = mode, None
        for start, stop in layout.groups:
            members = self._forwards[start:stop]
            region = _GroupRegion(members, self._anchors[start])
            for member in members:
                member.region = region
            self._regions.append(region)
        self.layout = layout
        if layout.num_checkpointed:
            _disable_hf_cache(self._root)

    def set_options(self, options: _Options) -> None:
        self.shared.options = options

    def remove(self) -> None:
        """Restore every block's original forward and forget the plan."""
        for region in self._regions:
            region.detach()
        self._regions = []
        for fwd in self._forwards:
            if fwd.block.__dict__.get("forward") is fwd:
                if fwd.prior is None:
                    del fwd.block.forward
                else:
                    fwd.block.forward = fwd.prior.__get__(fwd.block) if inspect.isfunction(fwd.prior) else fwd.prior
        if self._root.__dict__.get(_PLAN_ATTR) is self:
            delattr(self._root, _PLAN_ATTR)

    # -- persistence
    def state_dict(self) -> Dict[str, Any]:
        """Primitives only, so ``torch.load(weights_only=True)`` can read a checkpoint holding it."""
        return {"version": _STATE_VERSION, "policy": self.spec, "names": list(self.names), "modes": list(self.modes)}

    def load_state_dict(self, state: Dict[str, Any]) -> "CheckpointPlan":
        """Re-apply a saved plan: its policy, then its per-block modes when they were changed at run time."""
        if state.get("version") != _STATE_VERSION:
            warnings.warn(f"lightning_ckpt: plan state version {state.get('version')!r} is not "
                          f"{_STATE_VERSION}; loading what is compatible.", RuntimeWarning, stacklevel=2)
        modes = tuple(state.get("modes", ()))
        if list(state.get("names", [])) != list(self.names):
            policy = parse_policy(state["policy"])
            if isinstance(policy, ModesPolicy):  # a per-block list for other blocks means nothing here
                warnings.warn("lightning_ckpt: the saved plan names different blocks than this model has; "
                              "the plan was left as it is.", RuntimeWarning, stacklevel=2)
                return self
            warnings.warn(
                "lightning_ckpt: the saved plan names different blocks than this model has; only its policy "
                f"{state['policy']!r} was re-applied.", RuntimeWarning, stacklevel=2,
            )
            return self.retarget(policy)
        self.retarget(state["policy"])
        if modes and modes != self.modes:
            self.set_modes(modes)
        return self

    # -- reporting
    def summary(self) -> str:
        """A small table: block, class, mode, region."""
        region_of = {id(f): r for r in self._regions for f in r.members}
        lines = [
            f"lightning_ckpt plan for {self._model_name}: policy {self.spec!r}, "
            f"{self.num_checkpointed}/{self.num_blocks} blocks checkpointed "
            f"({describe_blocks([(f.name, f.block) for f in self._forwards])})",
            f"  {'#':>3}  {'block':<40} {'class':<24} {'mode':<10} region",
        ]
        for f in self._forwards:
            region = region_of.get(id(f))
            own = "own" if f.mode != "off" else "-"
            where = f"{region.members[0].index}-{region.members[-1].index}" if region else own
            lines.append(f"  {f.index:>3}  {f.name:<40} {type(f.block).__name__:<24} {f.mode:<10} {where}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CheckpointPlan(policy={self.spec!r}, checkpointed={self.num_checkpointed}/{self.num_blocks})"


def _anchor(root: nn.Module, block_name: str) -> nn.Module:
    """The closest ancestor of a block that is itself called (ModuleList/ModuleDict never are)."""
    parts = block_name.split(".")[:-1]
    while parts:
        module = root.get_submodule(".".join(parts))
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return module
        parts.pop()
    return root


# ------------------------------------------------------------------------------------------------ public API


def get_plan(model: nn.Module) -> Optional[CheckpointPlan]:
    """The plan :func:`apply_policy` installed on ``model``, or ``None``."""
    return model.__dict__.get(_PLAN_ATTR)


def apply_policy(
    model: nn.Module,
    policy: Union[str, Policy] = "all",
    blocks: BlockSelector = None,
    *,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    use_reentrant: bool = False,
) -> CheckpointPlan:
    """Checkpoint ``model``'s repeated blocks in place under ``policy``.

    Idempotent: on a model that already has a plan over the same blocks, the existing plan is re-targeted and
    returned; with a different ``blocks`` selector the old plan is removed first.

    Args:
        model: the model (or ``LightningModule``) that owns the blocks.
        policy: a policy string (see :mod:`lightning_ckpt.policy`) or object.
        blocks: block selector for :func:`~lightning_ckpt.blocks.find_blocks`; ``None`` detects them.
        preserve_rng_state: stash and restore the RNG state so dropout masks are identical on replay.
        determinism_check: ``"default"`` compares shapes/dtypes/devices of recomputed tensors; ``"none"`` skips it.
        debug: include operator traces in checkpoint errors.
        use_reentrant: must stay ``False``; reentrant checkpointing is refused.

    Returns:
        The :class:`CheckpointPlan`, also reachable with :func:`get_plan`.

    Raises:
        ValueError: reentrant requested, a bad policy/selector/``determinism_check``, no repeated blocks.
        ForeignCheckpointingError: the model is already checkpointed by another library.
    """
    options = _validate_options(use_reentrant, preserve_rng_state, determinism_check, debug)
    policy = parse_policy(policy)
    plan = get_plan(model)
    if plan is not None:
        if blocks is None or tuple(n for n, _ in find_blocks(model, blocks)) == plan.names:
            plan.set_options(options)
            return plan.retarget(policy)
        plan.remove()
    _refuse_foreign_checkpointing(model)
    found = find_blocks(model, blocks)
    for name, block in found:
        if isinstance(block.__dict__.get("forward"), _BlockForward):
            raise ValueError(
                f"block {name!r} is already wrapped by another lightning_ckpt plan (applied to a submodule). "
                "Call remove_checkpointing() on that submodule first, or apply the policy there only."
            )
    plan = CheckpointPlan(model, found, options)
    model.__dict__[_PLAN_ATTR] = plan
    try:
        return plan.retarget(policy)
    except Exception:
        plan.remove()
        raise


def remove_checkpointing(model: nn.Module) -> None:
    """Undo :func:`apply_policy`: every block gets its own forward back. A no-op without a plan."""
    plan = get_plan(model)
    if plan is not None:
        plan.remove()


def _validate_options(use_reentrant, preserve_rng_state, determinism_check, debug) -> _Options:
    if use_reentrant:
        raise ValueError(
            "use_reentrant=True is not supported: reentrant checkpointing breaks with DDP when blocks are "
            "checkpointed twice or have unused parameters, gives no gradients to frozen inputs (LoRA), and "
            "cannot stop replay early. lightning_ckpt always uses use_reentrant=False; drop the argument."
        )
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check={determinism_check!r} is not valid; choose one of {list(_DETERMINISM_CHECKS)}."
        )
    for name, value in (("preserve_rng_state", preserve_rng_state), ("debug", debug)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be True or False.")
    return _Options(preserve_rng_state, determinism_check, debug)


def _refuse_foreign_checkpointing(model: nn.Module) -> None:
    for name, module in model.named_modules():
        label = name or type(model).__name__
        if type(module).__name__ == "CheckpointWrapper" or hasattr(module, "_checkpoint_wrapped_module"):
            raise ForeignCheckpointingError(
                f"{label!r} is already wrapped by torch.distributed's checkpoint_wrapper (it adds "
                "'_checkpoint_wrapped_module.' to parameter names). Remove that wrapping (or Lightning FSDP's "
                "activation_checkpointing_policy) and let lightning_ckpt apply the policy instead."
            )
        if "checkpoint" in _composable_registry(module):
            raise ForeignCheckpointingError(
                f"{label!r} already has torch.distributed._composable.checkpoint applied; remove it before "
                "applying a lightning_ckpt policy."
            )
        if getattr(module, "gradient_checkpointing", False) is True:
            raise ForeignCheckpointingError(
                f"{label!r} has Hugging Face gradient checkpointing enabled; call "
                "model.gradient_checkpointing_disable() first and let lightning_ckpt choose the boundaries."
            )


def _composable_registry(module: nn.Module) -> Dict[str, Any]:
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # torch built without distributed
        return {}
    return _get_registry(module) or {}


def _disable_hf_cache(model: nn.Module) -> None:
    """Hugging Face KV caching is incompatible with checkpointed training: switch it off, warn once."""
    changed = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
            changed.append(type(module).__name__)
    if changed:
        warnings.warn(
            f"lightning_ckpt: set {changed[0]}.config.use_cache=False: a key/value cache is for generation and "
            "is incompatible with activation checkpointing during training. Pass use_cache=True explicitly to "
            "generate().",
            UserWarning,
            stacklevel=4,
        )
